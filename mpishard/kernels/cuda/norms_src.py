"""The CUDA source of the GPU's layer norm and RMS norm (:mod:`.norms` launches it).

* :data:`NORM_KERNELS`: the ``cupy.RawKernel`` s, one module of CUDA C with ``{T}``
  for float or double and ``{S}`` for the rows in memory, the same, ``__half`` or
  ``__nv_bfloat16`` (:func:`norm_kernel_source` fills them in): either norm forward
  and backward, a thread block per row, and the weight's and bias's gradients, a
  block per 32 columns and group of rows;
* :data:`SOURCES` and :data:`REDUCTIONS`: the ``cupy.ElementwiseKernel`` s and
  ``cupy.ReductionKernel`` s of the fallback, for rows the RawKernels do not take
  (a row reduction per statistic and one elementwise kernel).

``scripts/compile_kernels.py`` compiles all of it with NVRTC, without a GPU.
"""
from __future__ import annotations

from mpishard.kernels.cuda.ops_src import BLOCK_REDUCE, COLUMN_SUMS, ROWS16, rows16_source

__all__ = ["NORM_KERNELS", "norm_kernel_source", "SOURCES", "REDUCTIONS"]

#: the RawKernels (see the module docstring); an absent optional array is passed as a
#: flag 0 and any valid pointer
NORM_KERNELS = r"""
typedef {T} T;
typedef {S} S;   /* the rows in memory: T, or __half or __nv_bfloat16 (computed in float) */
""" + BLOCK_REDUCE + COLUMN_SUMS + r"""
/* Layer norm (centred) or RMS norm of a row: the mean (layer norm), the mean square of
   x - mean, rstd = 1 / sqrt(that + eps), xhat = (x - mean) rstd, y = xhat w + b (w and
   b where has_w, has_b). */
extern "C" __global__ void mpishard_norm_forward_{N}(const S* x, const S* w, const S* b,
                                                    S* y, T* xhat, T* rstd, const int n,
                                                    const T eps, const int centred,
                                                    const int has_w, const int has_b) {
  __shared__ T shared[32];
  const long long row = blockIdx.x;
  const S* xr = x + row * n;
  T mean = 0;
  if (centred) {
    T s = 0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) s += (T)xr[j];
    mean = mpishard_block_reduce(s, false, shared) / (T)n;
  }
  T ss = 0;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const T c = (T)xr[j] - mean;
    ss += c * c;
  }
  const T r = (T)1 / sqrt(mpishard_block_reduce(ss, false, shared) / (T)n + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const T h = ((T)xr[j] - mean) * r;
    T v = has_w ? h * (T)w[j] : h;
    if (has_b) v += (T)b[j];
    xhat[row * n + j] = h;
    y[row * n + j] = (S)v;
  }
}

/* The input's gradient of a row of either norm, for output gradient g:
   rstd (gh - mean(gh) - xhat mean(gh xhat)) with gh = g w, the first mean for
   layer norm only; with add, added into dx (the input's gradient so far). */
extern "C" __global__ void mpishard_norm_backward_{N}(const S* g, const T* xhat,
                                                     const T* rstd, const S* w, S* dx,
                                                     const int n, const int centred,
                                                     const int has_w, const int add) {
  __shared__ T shared[32];
  const long long row = blockIdx.x;
  const S* gr = g + row * n;
  const T* hr = xhat + row * n;
  T sum_gh = 0, sum_ghx = 0;                 /* gh = g w, as the reference's */
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const T gh = has_w ? (T)gr[j] * (T)w[j] : (T)gr[j];
    sum_gh += gh;
    sum_ghx += gh * hr[j];
  }
  T mean_gh = 0;
  if (centred) mean_gh = mpishard_block_reduce(sum_gh, false, shared) / (T)n;
  const T mean_ghx = mpishard_block_reduce(sum_ghx, false, shared) / (T)n;
  const T r = rstd[row];
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const T gh = has_w ? (T)gr[j] * (T)w[j] : (T)gr[j];
    const T v = r * (gh - mean_gh - hr[j] * mean_ghx);
    dx[row * n + j] = (S)(add ? (T)dx[row * n + j] + v : v);  /* add: into the gradient */
  }                                                            /* so far */
}

/* The norms' weight and bias gradients: column sums of g xhat (gw, where need_w) and of
   g (gb, where need_b) over rows x n. A block of 32 columns x blockDim.y (at most 32)
   row threads per group of rows, each thread summing every blockDim.y-th row of the
   group in its column, the sums then added in a fixed order: deterministic, no
   floating-point atomics (see [Note: column sums] in ops_src.py). */
extern "C" __global__ void __launch_bounds__(1024)  /* 32 x 32 threads */
mpishard_norm_param_grads_{N}(
    const S* g, const T* xhat, T* gw, T* gb, const long long rows, const int n,
    const int need_w, const int need_b, const long long group_rows, T* partial,
    unsigned int* counters) {
  const int col = blockIdx.x * 32 + threadIdx.x;
  T sw = 0, sb = 0;
  if (col < n) {
    const long long end = mpishard_group_end(rows, group_rows);
    for (long long i = blockIdx.y * group_rows + threadIdx.y; i < end; i += blockDim.y) {
      const T v = (T)g[i * n + col];
      if (need_w) sw += v * xhat[i * n + col];
      sb += v;
    }
  }
  mpishard_column_totals<2>(sw, sb, need_w, need_b, col, n, gw, gb, partial, counters);
}
"""


def norm_kernel_source(T: str, S: str | None = None) -> str:
    """:data:`NORM_KERNELS` for compute type ``T`` (``"float"`` or ``"double"``) and row
    storage ``S`` (default ``T``; ``"__half"`` or ``"__nv_bfloat16"`` for 16-bit rows with
    ``T`` float), each kernel named ``<name>_<T>`` (``<name>_float_h`` with ``__half``,
    ``<name>_float_bf`` with ``__nv_bfloat16``)."""
    S = S or T
    suffix = next((x for c, _, x in ROWS16.values() if c == S), None)
    code = NORM_KERNELS.replace("{T}", T).replace("{S}", S).replace(
        "{N}", T if suffix is None else f"{T}_{suffix}")
    return rows16_source(S, code)


#: name -> (inputs, outputs, CUDA body) of each ElementwiseKernel of the fallback
SOURCES = {
    "mpishard_norm_apply": ("T x, T mu, T rstd, T w, T b", "T y, T h",
                            "h = (x - mu) * rstd; y = h * w + b;"),
    "mpishard_layer_norm_grad": ("T g, T w, T h, T mg, T mgh, T rstd", "T gx",
                                 "gx = rstd * (g * w - mg - h * mgh);"),
    "mpishard_rms_apply": ("T x, T rstd, T w", "T y, T h", "h = x * rstd; y = h * w;"),
    "mpishard_rms_norm_grad": ("T g, T w, T h, T mgh, T rstd", "T gx",
                               "gx = rstd * (g * w - h * mgh);"),
}
#: name -> (inputs, outputs, map, reduce, post-map) of each ReductionKernel of the
#: fallback (over rows)
REDUCTIONS = {
    "mpishard_row_mean": ("T x, float64 inv_n", "T y", "x", "a + b", "y = (T)(a * inv_n)"),
    "mpishard_row_rstd": ("T x, T mu, float64 inv_n, float64 eps", "T y",
                          "(x - mu) * (x - mu)", "a + b", "y = (T)(1.0 / sqrt(a * inv_n + eps))"),
    "mpishard_row_rms_rstd": ("T x, float64 inv_n, float64 eps", "T y", "x * x", "a + b",
                              "y = (T)(1.0 / sqrt(a * inv_n + eps))"),
    "mpishard_row_mean_gw": ("T g, T w, float64 inv_n", "T y", "g * w", "a + b",
                             "y = (T)(a * inv_n)"),
    "mpishard_row_mean_gwh": ("T g, T w, T h, float64 inv_n", "T y", "g * w * h", "a + b",
                              "y = (T)(a * inv_n)"),
}

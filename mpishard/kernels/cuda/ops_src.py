"""The CUDA source of the GPU kernel set (:mod:`.gpu` compiles and launches it).

* :data:`SOURCES`: the bodies of the ``cupy.ElementwiseKernel`` s, per name
  (inputs, outputs, body; ``T`` the array dtype);
* :data:`REDUCTIONS`: the ``cupy.ReductionKernel`` s of the norms' fallback;
* :data:`ROW_KERNELS`: the ``cupy.RawKernel`` s, one module of CUDA C with
  ``{T}`` for float or double (``{S}``, the norms' rows in memory, the same or
  ``__half``; :func:`row_kernel_source` fills them in).

``scripts/compile_kernels.py`` compiles all of it with NVRTC, without a GPU.
"""
from __future__ import annotations

from mpishard.kernels.reference import GELU_C, GELU_K

__all__ = ["SOURCES", "FLOAT16_SOURCES", "REDUCTIONS", "ROW_KERNELS", "row_kernel_source"]

#: name -> (inputs, outputs, CUDA body) of each ElementwiseKernel
SOURCES = {
    "mpishard_gelu_forward": (
        "T a", "T y, T t",
        f"t = tanh((T){GELU_C!r} * (a + (T){GELU_K!r} * a * a * a));"
        " y = (T)0.5 * a * ((T)1 + t);"),
    "mpishard_gelu_backward": (
        "T a, T t, T g", "T gx",
        f"gx = g * ((T)0.5 * ((T)1 + t) + (T)0.5 * a * ((T)1 - t * t) * (T){GELU_C!r}"
        f" * ((T)1 + (T)3 * (T){GELU_K!r} * a * a));"),
    "mpishard_swiglu_forward": (
        "T g, T u", "T y, T s",
        "s = (T)1 / ((T)1 + exp(-g)); y = g * s * u;"),
    "mpishard_swiglu_backward": (
        "T g, T u, T s, T d", "T dg, T du",
        "T gu = d * g * s; du = gu; dg = u * (gu + s * (d - gu));"),
    "mpishard_adam_update": (
        "T g, float64 b1, float64 b2, float64 step, float64 ib2, float64 eps",
        "T p, T m, T v",
        "m = (T)b1 * m + (T)(1.0 - b1) * g; v = (T)b2 * v + (T)(1.0 - b2) * g * g;"
        " p -= (T)step * (m / (sqrt(v) * (T)ib2 + (T)eps));"),
    # kept where u >= p (compared in float32, as NumPy does), times the scale in T
    "mpishard_dropout": (
        "T y, float32 u, float64 p, float64 scale", "T z",
        "z = u >= (float)p ? (T)(y * (T)scale) : (T)0;"),
    "mpishard_dropout_add": (
        "T x, T y, float32 u, float64 p, float64 scale", "T z",
        "z = x + (u >= (float)p ? (T)(y * (T)scale) : (T)0);"),
    # a linear layer's bias added in the consumer's kernel: GELU, dropout, residual add
    "mpishard_bias_gelu_forward": (
        "T a, T b", "T y, T t",
        f"T x = a + b; t = tanh((T){GELU_C!r} * (x + (T){GELU_K!r} * x * x * x));"
        " y = (T)0.5 * x * ((T)1 + t);"),
    "mpishard_bias_dropout": (
        "T y, T b, float32 u, float64 p, float64 scale", "T z",
        "z = u >= (float)p ? (T)((T)(y + b) * (T)scale) : (T)0;"),
    "mpishard_bias_dropout_add": (
        "T x, T y, T b, float32 u, float64 p, float64 scale", "T z",
        "z = x + (u >= (float)p ? (T)((T)(y + b) * (T)scale) : (T)0);"),
    "mpishard_bias_add": ("T x, T y, T b", "T z", "z = x + (T)(y + b);"),
    "mpishard_add_bias": ("T y, T b", "T z", "z = y + b;"),
    # GELU on float16 rows, computed in float32 term for term as the kernels above with
    # T = float (the tanh kept in float32; y and gx rounded to float16 once, as a cast
    # would), so no float32 copies of a, b, g and gx around them
    "mpishard_gelu16_forward": (
        "T a", "T y, float32 t",
        f"const float x = (float)a; t = tanh((float){GELU_C!r} * (x + (float){GELU_K!r}"
        " * x * x * x)); y = (T)((float)0.5 * x * ((float)1 + t));"),
    "mpishard_bias_gelu16_forward": (
        "T a, T b", "T y, float32 t",
        f"const float x = (float)a + (float)b; t = tanh((float){GELU_C!r} * (x +"
        f" (float){GELU_K!r} * x * x * x)); y = (T)((float)0.5 * x * ((float)1 + t));"),
    "mpishard_gelu16_backward": (
        "T a, float32 t, T g", "T gx",
        f"const float x = (float)a; gx = (T)((float)g * ((float)0.5 * ((float)1 + t) +"
        f" (float)0.5 * x * ((float)1 - t * t) * (float){GELU_C!r} * ((float)1 + (float)3"
        f" * (float){GELU_K!r} * x * x)));"),
    # with the float32 gradient too, for the bias's column sums
    "mpishard_bias_gelu16_backward": (
        "T a, T b, float32 t, T g", "T gx, float32 gf",
        f"const float x = (float)a + (float)b; gf = (float)g * ((float)0.5 * ((float)1 + t)"
        f" + (float)0.5 * x * ((float)1 - t * t) * (float){GELU_C!r} * ((float)1 +"
        f" (float)3 * (float){GELU_K!r} * x * x)); gx = (T)gf;"),
    # the norms' fallback for inputs the row kernels do not take (see the docstring)
    "mpishard_norm_apply": ("T x, T mu, T rstd, T w, T b", "T y, T h",
                            "h = (x - mu) * rstd; y = h * w + b;"),
    "mpishard_layer_norm_grad": ("T g, T w, T h, T mg, T mgh, T rstd", "T gx",
                                 "gx = rstd * (g * w - mg - h * mgh);"),
    "mpishard_rms_apply": ("T x, T rstd, T w", "T y, T h", "h = x * rstd; y = h * w;"),
    "mpishard_rms_norm_grad": ("T g, T w, T h, T mgh, T rstd", "T gx",
                               "gx = rstd * (g * w - h * mgh);"),
}
#: the kernels of :data:`SOURCES` that also run on float16 (dropout, on a 16-bit model's
#: activations and gradients; the others get float32 or float64)
FLOAT16_SOURCES = ("mpishard_dropout", "mpishard_dropout_add", "mpishard_bias_dropout",
                   "mpishard_bias_dropout_add", "mpishard_bias_add", "mpishard_add_bias",
                   "mpishard_gelu16_forward", "mpishard_bias_gelu16_forward",
                   "mpishard_gelu16_backward", "mpishard_bias_gelu16_backward")
#: name -> (inputs, outputs, map, reduce, post-map) of each ReductionKernel (over rows),
#: the norms' fallback
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
    # a gradient's sum of squares in float64 (the clipping norm), no float64 copy
    "mpishard_sq_sum": ("T x", "float64 y", "(double)x * (double)x", "a + b", "y = a"),
}
#: the RawKernels, ``{T}`` float or double. All but the last take a thread block per
#: row: a sum or max over the block (warp shuffles, then the warps' results), then the
#: row's passes. An absent optional array is passed as a flag 0 and any valid pointer.
ROW_KERNELS = f"""
#define MPISHARD_GELU_C {GELU_C!r}
#define MPISHARD_GELU_K {GELU_K!r}""" + r"""
typedef {T} T;
typedef {S} S;   /* the norms' rows in memory: T, or __half (computed in float) */
__device__ T mpishard_block_reduce(T v, const bool is_max, T* shared) {
  for (int o = 16; o > 0; o >>= 1) {
    const T w = __shfl_xor_sync(0xffffffff, v, o);
    v = is_max ? (w > v ? w : v) : v + w;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  if (warp == 0) {
    v = lane < warps ? shared[lane] : (is_max ? shared[0] : (T)0);
    for (int o = 16; o > 0; o >>= 1) {
      const T w = __shfl_xor_sync(0xffffffff, v, o);
      v = is_max ? (w > v ? w : v) : v + w;
    }
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  v = shared[0];
  __syncthreads();
  return v;
}

/* Softmax of a row of scaled, causally masked scores, in place; with has_drop also
   the dropped weights: kept where du >= dp, times dscale. */
extern "C" __global__ void mpishard_causal_softmax_{N}(T* a, const int n, const T scale,
                                                      const int has_drop, const float* du,
                                                      const float dp, const T dscale,
                                                      T* dropped) {
  __shared__ T shared[32];
  const long long row = blockIdx.x;
  T* r = a + row * n;
  const int limit = (int)(row % n) + 1;      /* query row % n sees keys 0..row % n */
  T m = r[0] * scale;
  for (int j = threadIdx.x; j < limit; j += blockDim.x) {
    const T v = r[j] * scale;
    m = v > m ? v : m;
  }
  m = mpishard_block_reduce(m, true, shared);
  T s = 0;
  for (int j = threadIdx.x; j < limit; j += blockDim.x) {
    const T e = exp(r[j] * scale - m);
    r[j] = e;
    s += e;
  }
  s = mpishard_block_reduce(s, false, shared);
  const T inv = (T)1 / s;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const T v = j < limit ? r[j] * inv : (T)0;
    r[j] = v;
    if (has_drop) dropped[row * n + j] = du[row * n + j] >= dp ? v * dscale : (T)0;
  }
}

/* The scores' gradient from the weights' d, in place: (d - rowdot(d, p)) p scale; with
   has_drop, d first goes back through the forward's dropout (written back to d), and
   with has_dropped the dropped weights (p kept where du >= dp, times dscale) are
   written to dropped on the way, for the values' gradient. */
extern "C" __global__ void mpishard_softmax_backward_{N}(T* d, const T* p, const int n,
                                                        const T scale, const int has_drop,
                                                        const float* du, const float dp,
                                                        const T dscale,
                                                        const int has_dropped,
                                                        T* dropped) {
  __shared__ T shared[32];
  const long long row = blockIdx.x;
  T* dr = d + row * n;
  const T* pr = p + row * n;
  T s = 0;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    T v = dr[j];
    const T pj = pr[j];
    if (has_drop) {
      const bool kept = du[row * n + j] >= dp;
      v = kept ? v * dscale : (T)0;
      dr[j] = v;
      if (has_dropped) dropped[row * n + j] = kept ? pj * dscale : (T)0;
    }
    s += v * pj;
  }
  s = mpishard_block_reduce(s, false, shared);
  for (int j = threadIdx.x; j < n; j += blockDim.x) dr[j] = (dr[j] - s) * pr[j] * scale;
}

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
   row threads, each summing every blockDim.y-th row of its column, then the partial
   sums added in a fixed order: deterministic, no atomics. */
extern "C" __global__ void __launch_bounds__(1024)  /* 32 x 32 threads */
mpishard_norm_param_grads_{N}(
    const S* g, const T* xhat, T* gw, T* gb, const long long rows, const int n,
    const int need_w, const int need_b) {
  __shared__ T part_w[32][32], part_b[32][32];
  const int col = blockIdx.x * 32 + threadIdx.x;
  T sw = 0, sb = 0;
  if (col < n) {
    for (long long i = threadIdx.y; i < rows; i += blockDim.y) {
      const T v = (T)g[i * n + col];
      if (need_w) sw += v * xhat[i * n + col];
      sb += v;
    }
  }
  part_w[threadIdx.y][threadIdx.x] = sw;
  part_b[threadIdx.y][threadIdx.x] = sb;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    for (int k = 1; k < blockDim.y; ++k) {
      sw += part_w[k][threadIdx.x];
      sb += part_b[k][threadIdx.x];
    }
    if (need_w) gw[col] = sw;
    if (need_b) gb[col] = sb;
  }
}

/* The column-sum kernels' end: thread (x, y) holds the partial sum s of its rows of
   column col; the block adds them in a fixed order (deterministic, no atomics) and row
   thread 0 writes the column's total to out[col]. */
__device__ void mpishard_column_total(T s, const int col, const int n, T* out) {
  __shared__ T part[32][32];
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    for (int k = 1; k < blockDim.y; ++k) s += part[k][threadIdx.x];
    out[col] = s;
  }
}

/* GELU's backward with its input's bias b (a linear layer's, added in the forward's
   kernel): gx = g gelu'(a + b) per element, and gb, the column sums of gx (b's
   gradient). Blocks of 32 columns x blockDim.y row threads, as norm_param_grads. */
extern "C" __global__ void __launch_bounds__(1024)  /* 32 x 32 threads */
mpishard_bias_gelu_backward_{N}(
    const T* a, const T* b, const T* t, const T* g, T* gx, T* gb, const long long rows,
    const int n) {
  const int col = blockIdx.x * 32 + threadIdx.x;
  T s = 0;
  if (col < n) {
    const T bc = b[col];
    for (long long i = threadIdx.y; i < rows; i += blockDim.y) {
      const long long k = i * n + col;
      const T x = a[k] + bc, th = t[k];
      const T v = g[k] * ((T)0.5 * ((T)1 + th) + (T)0.5 * x * ((T)1 - th * th)
                          * (T)MPISHARD_GELU_C * ((T)1 + (T)3 * (T)MPISHARD_GELU_K * x * x));
      gx[k] = v;
      s += v;
    }
  }
  mpishard_column_total(s, col, n, gb);
}

/* The gradient through a dropout with a bias before it: gy = g / (1 - p) where
   du >= dp, else 0 (with has_drop; else gy is g, not written), and gb, the column
   sums of gy (the bias's gradient). Blocks as above. */
extern "C" __global__ void __launch_bounds__(1024)  /* 32 x 32 threads */
mpishard_bias_dropout_backward_{N}(
    const T* g, const int has_drop, const float* du, const float dp, const T dscale,
    T* gy, T* gb, const long long rows, const int n) {
  const int col = blockIdx.x * 32 + threadIdx.x;
  T s = 0;
  if (col < n) {
    for (long long i = threadIdx.y; i < rows; i += blockDim.y) {
      const long long k = i * n + col;
      T v = g[k];
      if (has_drop) {
        v = du[k] >= dp ? v * dscale : (T)0;
        gy[k] = v;
      }
      s += v;
    }
  }
  mpishard_column_total(s, col, n, gb);
}

/* Attention's q, k and v gradients from the head-major (3, B, nh, Tn, hs) buffer h
   back to packed rows (B Tn, n = 3 nh hs), column (w nh + head) hs + j, with has_sum
   their column sums (c_attn's bias gradient) into sums. Blocks as above: a warp's
   32 columns are 32 neighbouring elements of a head on both sides. */
extern "C" __global__ void __launch_bounds__(1024)  /* 32 x 32 threads */
mpishard_unpack_heads_{N}(
    const T* h, T* rows, const int has_sum, T* sums, const long long B, const int Tn,
    const int nh, const int hs) {
  const int n = 3 * nh * hs;
  const int col = blockIdx.x * 32 + threadIdx.x;
  T s = 0;
  if (col < n) {
    const int j = col % hs, wh = col / hs;
    const long long base = ((long long)(wh / nh) * B * nh + wh % nh) * Tn * hs + j;
    for (long long i = threadIdx.y; i < B * Tn; i += blockDim.y) {
      const long long b = i / Tn, t = i % Tn;
      const T v = h[base + (b * nh * Tn + t) * hs];
      rows[i * n + col] = v;
      s += v;
    }
  }
  if (has_sum) mpishard_column_total(s, col, n, sums);
}
"""


def row_kernel_source(T: str, S: str | None = None) -> str:
    """:data:`ROW_KERNELS` for compute type ``T`` (``"float"`` or ``"double"``) and row
    storage ``S`` (default ``T``; ``"__half"`` for float16 rows with ``T`` float), each
    kernel named ``<name>_<T>`` (``<name>_float_h`` with ``__half``)."""
    S = S or T
    code = ROW_KERNELS.replace("{T}", T).replace("{S}", S).replace(
        "{N}", T if S == T else f"{T}_h")
    return ("#include <cuda_fp16.h>\n" + code) if S == "__half" else code

"""The CUDA source of the GPU kernel set's elementwise and row kernels (:mod:`.ops`
launches them; the norms' are :mod:`.norms_src`'s).

* :data:`SOURCES`: the bodies of the ``cupy.ElementwiseKernel`` s, per name
  (inputs, outputs, body; ``T`` the array dtype), :data:`FLOAT16_SOURCES` those that
  also take float16;
* :data:`ROW_KERNELS`: the ``cupy.RawKernel`` s, one module of CUDA C with ``{T}``
  for float or double (:func:`row_kernel_source` fills it in);
* :data:`BLOCK_REDUCE`: the block-wide sum or maximum that these and the norms' row
  kernels share.

``scripts/compile_kernels.py`` compiles all of it with NVRTC, without a GPU.
"""
from __future__ import annotations

from mpishard.kernels.reference import GELU_C, GELU_K

__all__ = ["SOURCES", "FLOAT16_SOURCES", "BLOCK_REDUCE", "ROW_KERNELS", "row_kernel_source"]

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
}
#: the kernels of :data:`SOURCES` that also run on float16 (dropout, on a 16-bit model's
#: activations and gradients; the others get float32 or float64)
FLOAT16_SOURCES = ("mpishard_dropout", "mpishard_dropout_add", "mpishard_bias_dropout",
                   "mpishard_bias_dropout_add", "mpishard_bias_add", "mpishard_add_bias",
                   "mpishard_gelu16_forward", "mpishard_bias_gelu16_forward",
                   "mpishard_gelu16_backward", "mpishard_bias_gelu16_backward")
#: a sum (``is_max`` false) or maximum of ``v`` over a thread block: warp shuffles, then
#: the warps' results through ``shared`` (32 of ``T``); every thread gets the result
BLOCK_REDUCE = r"""
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
"""
#: the RawKernels, ``{T}`` float or double. Softmax takes a thread block per row (the
#: row's max and sum as :data:`BLOCK_REDUCE` s, then its passes), the others a block per
#: 32 columns. An absent optional array is passed as a flag 0 and any valid pointer.
ROW_KERNELS = f"""
#define MPISHARD_GELU_C {GELU_C!r}
#define MPISHARD_GELU_K {GELU_K!r}""" + r"""
typedef {T} T;
""" + BLOCK_REDUCE + r"""
/* Softmax of a row of scaled, causally masked scores, in place; with has_drop also
   the dropped weights: kept where du >= dp, times dscale. */
extern "C" __global__ void mpishard_causal_softmax_{T}(T* a, const int n, const T scale,
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
extern "C" __global__ void mpishard_softmax_backward_{T}(T* d, const T* p, const int n,
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
mpishard_bias_gelu_backward_{T}(
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
mpishard_bias_dropout_backward_{T}(
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
   their column sums (the fused q/k/v projection's bias gradient) into sums. Blocks as above: a warp's
   32 columns are 32 neighbouring elements of a head on both sides. */
extern "C" __global__ void __launch_bounds__(1024)  /* 32 x 32 threads */
mpishard_unpack_heads_{T}(
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


def row_kernel_source(T: str) -> str:
    """:data:`ROW_KERNELS` for compute type ``T`` (``"float"`` or ``"double"``), each
    kernel named ``<name>_<T>``."""
    return ROW_KERNELS.replace("{T}", T)

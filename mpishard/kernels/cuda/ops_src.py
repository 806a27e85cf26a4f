"""The CUDA source of the GPU kernel set's elementwise and row kernels (:mod:`.ops`
launches them; the norms' are :mod:`.norms_src`'s).

* :data:`SOURCES`: the bodies of the ``cupy.ElementwiseKernel`` s, per name
  (inputs, outputs, body; ``T`` the array dtype), :data:`FLOAT16_SOURCES` those that
  also take float16, :data:`BFLOAT16_SOURCES` their twins on bfloat16 words (with
  :data:`BF16_WORDS`' conversions);
* :data:`ROW_KERNELS`: the ``cupy.RawKernel`` s, one module of CUDA C with ``{T}``
  for float or double (:func:`row_kernel_source` fills it in);
* :data:`BLOCK_REDUCE`: the block-wide sum or maximum that these and the norms' row
  kernels share, :data:`COLUMN_SUMS` the column sums' end they share.

``scripts/compile_kernels.py`` compiles all of it with NVRTC, without a GPU.
"""
from __future__ import annotations

import numpy as np

from mpishard.kernels.reference import GELU_C, GELU_K

__all__ = ["SOURCES", "FLOAT16_SOURCES", "BFLOAT16_SOURCES", "BF16_WORDS", "BLOCK_REDUCE",
           "COLUMN_SUMS", "ROW_KERNELS", "row_kernel_source", "ROWS16", "rows16_source",
           "STORAGE", "storage_dtypes", "compute_dtype", "storage_name", "storage_source"]

#: the 16-bit row dtypes the RawKernels read and write themselves (computing in float):
#: dtype name -> (the C type of an element, the header declaring it, a kernel-name
#: suffix). A bfloat16 element is the top 16 bits of a float32, converted with
#: round-to-nearest-even (see [Note: bfloat16 on devices] in mpishard/core/dtypes.py).
ROWS16 = {"float16": ("__half", "cuda_fp16.h", "h"),
          "bfloat16": ("__nv_bfloat16", "cuda_bf16.h", "bf")}


#: an array's dtype name -> the C type the storage-typed RawKernels (fused attention,
#: cross-entropy, rotary embeddings) read it as
STORAGE = {"float32": "float", "float64": "double",
           **{name: c for name, (c, _, _) in ROWS16.items()}}


def storage_dtypes(dtype) -> tuple:
    """``(T, S)``: the C types a storage-typed RawKernel computes in (double for double
    data, else float) and reads ``dtype``'s data as (:data:`STORAGE`)."""
    S = STORAGE[np.dtype(dtype).name]
    return ("double" if S == "double" else "float"), S


def compute_dtype(dtype) -> np.dtype:
    """The NumPy dtype of :func:`storage_dtypes`' ``T``: float64 for float64, else
    float32."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def rows16_source(S: str, code: str) -> str:
    """``code`` with the header of row type ``S`` included when it is a 16-bit one."""
    header = next((h for c, h, _ in ROWS16.values() if c == S), None)
    return code if header is None else f"#include <{header}>\n" + code


def storage_name(name: str, S: str) -> str:
    """The name of kernel ``name`` for data stored as ``S``: ``<name>_half``,
    ``<name>_bfloat16``, ``<name>_float`` or ``<name>_double``."""
    return f"{name}_{S.replace('__nv_', '').strip('_')}"


def storage_source(template: str, T: str, S: str, what: str) -> str:
    """``template`` (CUDA C with ``{T}``, ``{S}`` and kernels named ``..._{N}(``) computing
    in ``T`` (``"float"`` or ``"double"``) on ``what`` stored as ``S`` (``T``, or a 16-bit
    type with float), its kernels named by :func:`storage_name`."""
    if S != T and T != "float":
        raise ValueError(f"{S} {what} are computed in float, not {T}")
    code = (template.replace("{T}", T).replace("{S}", S)
            .replace("_{N}(", storage_name("", S) + "("))
    return rows16_source(S, code)


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
    # the sigmoid computed inline each way, not kept between them
    "mpishard_swiglu_forward": (
        "T g, T u", "T y",
        "T s = (T)1 / ((T)1 + exp(-g)); y = g * s * u;"),
    "mpishard_swiglu_backward": (
        "T g, T u, T d", "T dg, T du",
        "T s = (T)1 / ((T)1 + exp(-g)); T gu = d * g * s; du = gu;"
        " dg = u * (gu + s * (d - gu));"),
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
    # T = float (the tanh written in float32; y and gx rounded to float16 once, as a cast
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
    # SwiGLU on 16-bit rows: the float kernels above with T = float, the sigmoid inline,
    # each result rounded once (no float32 copies of gate, up, the gradient or theirs)
    "mpishard_swiglu16_forward": (
        "T g, T u", "T y",
        "const float x = (float)g; const float s = (float)1 / ((float)1 + exp(-x));"
        " y = (T)(x * s * (float)u);"),
    "mpishard_swiglu16_backward": (
        "T g, T u, T d", "T dg, T du",
        "const float x = (float)g, e = (float)d; const float s = (float)1 / ((float)1 +"
        " exp(-x)); const float gu = e * x * s; du = (T)gu;"
        " dg = (T)((float)u * (gu + s * (e - gu)));"),
    # with the float32 gradient too, for the bias's column sums
    "mpishard_bias_gelu16_backward": (
        "T a, T b, float32 t, T g", "T gx, float32 gf",
        f"const float x = (float)a + (float)b; gf = (float)g * ((float)0.5 * ((float)1 + t)"
        f" + (float)0.5 * x * ((float)1 - t * t) * (float){GELU_C!r} * ((float)1 +"
        f" (float)3 * (float){GELU_K!r} * x * x)); gx = (T)gf;"),
}
#: the kernels of :data:`SOURCES` that also run on float16 (dropout, on a 16-bit model's
#: activations and gradients; GELU's and SwiGLU's 16-bit kernels; the others get float32
#: or float64)
FLOAT16_SOURCES = ("mpishard_dropout", "mpishard_dropout_add", "mpishard_bias_dropout",
                   "mpishard_bias_dropout_add", "mpishard_bias_add", "mpishard_add_bias",
                   "mpishard_gelu16_forward", "mpishard_bias_gelu16_forward",
                   "mpishard_gelu16_backward", "mpishard_bias_gelu16_backward",
                   "mpishard_swiglu16_forward", "mpishard_swiglu16_backward")
#: the bfloat16 words' conversions for :data:`BFLOAT16_SOURCES` (an ElementwiseKernel's
#: preamble; no header, so no CuPy type name): ``bf16_load`` a word as a float (the
#: word on top of a float32), ``bf16_store`` a float as the word of its bfloat16 by
#: round-to-nearest-even (``__float2bfloat16_rn``'s rounding; a NaN stays a quiet NaN),
#: ``bf16_round`` both (a value rounded to bfloat16, as NumPy rounds each operation)
BF16_WORDS = r"""
__device__ __forceinline__ float bf16_load(const unsigned short w) {
  return __uint_as_float((unsigned int)w << 16);
}
__device__ __forceinline__ unsigned short bf16_store(const float f) {
  const unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float bf16_round(const float f) { return bf16_load(bf16_store(f)); }
"""
#: name -> (inputs, outputs, CUDA body) of the ElementwiseKernels of :data:`FLOAT16_SOURCES`
#: for bfloat16 data, named ``<name>_bf16``: the bfloat16 arrays passed as their 16-bit
#: words (``uint16``, see [Note: bfloat16 on devices] in mpishard/core/dtypes.py) and
#: converted with :data:`BF16_WORDS`; each operation the float16 kernel does in ``T``
#: rounded to bfloat16 the same way (``bf16_round``), GELU in float32 throughout
BFLOAT16_SOURCES = {
    "mpishard_dropout_bf16": (
        "uint16 y, float32 u, float64 p, float64 scale", "uint16 z",
        "z = u >= (float)p ? bf16_store(bf16_load(y) * bf16_round((float)scale)) : 0;"),
    "mpishard_dropout_add_bf16": (
        "uint16 x, uint16 y, float32 u, float64 p, float64 scale", "uint16 z",
        "z = bf16_store(bf16_load(x) + (u >= (float)p ?"
        " bf16_round(bf16_load(y) * bf16_round((float)scale)) : 0.0f));"),
    "mpishard_bias_dropout_bf16": (
        "uint16 y, uint16 b, float32 u, float64 p, float64 scale", "uint16 z",
        "z = u >= (float)p ? bf16_store(bf16_round(bf16_load(y) + bf16_load(b))"
        " * bf16_round((float)scale)) : 0;"),
    "mpishard_bias_dropout_add_bf16": (
        "uint16 x, uint16 y, uint16 b, float32 u, float64 p, float64 scale", "uint16 z",
        "z = bf16_store(bf16_load(x) + (u >= (float)p ? bf16_round(bf16_round(bf16_load(y)"
        " + bf16_load(b)) * bf16_round((float)scale)) : 0.0f));"),
    "mpishard_bias_add_bf16": (
        "uint16 x, uint16 y, uint16 b", "uint16 z",
        "z = bf16_store(bf16_load(x) + bf16_round(bf16_load(y) + bf16_load(b)));"),
    "mpishard_add_bias_bf16": (
        "uint16 y, uint16 b", "uint16 z", "z = bf16_store(bf16_load(y) + bf16_load(b));"),
    "mpishard_gelu16_forward_bf16": (
        "uint16 a", "uint16 y, float32 t",
        f"const float x = bf16_load(a); t = tanh((float){GELU_C!r} * (x + (float){GELU_K!r}"
        " * x * x * x)); y = bf16_store((float)0.5 * x * ((float)1 + t));"),
    "mpishard_bias_gelu16_forward_bf16": (
        "uint16 a, uint16 b", "uint16 y, float32 t",
        f"const float x = bf16_load(a) + bf16_load(b); t = tanh((float){GELU_C!r} * (x +"
        f" (float){GELU_K!r} * x * x * x)); y = bf16_store((float)0.5 * x * ((float)1 + t));"),
    "mpishard_gelu16_backward_bf16": (
        "uint16 a, float32 t, uint16 g", "uint16 gx",
        f"const float x = bf16_load(a); gx = bf16_store(bf16_load(g) * ((float)0.5 *"
        f" ((float)1 + t) + (float)0.5 * x * ((float)1 - t * t) * (float){GELU_C!r} *"
        f" ((float)1 + (float)3 * (float){GELU_K!r} * x * x)));"),
    "mpishard_swiglu16_forward_bf16": (
        "uint16 g, uint16 u", "uint16 y",
        "const float x = bf16_load(g); const float s = (float)1 / ((float)1 + exp(-x));"
        " y = bf16_store(x * s * bf16_load(u));"),
    "mpishard_swiglu16_backward_bf16": (
        "uint16 g, uint16 u, uint16 d", "uint16 dg, uint16 du",
        "const float x = bf16_load(g), e = bf16_load(d); const float s = (float)1 /"
        " ((float)1 + exp(-x)); const float gu = e * x * s; du = bf16_store(gu);"
        " dg = bf16_store(bf16_load(u) * (gu + s * (e - gu)));"),
    "mpishard_bias_gelu16_backward_bf16": (
        "uint16 a, uint16 b, float32 t, uint16 g", "uint16 gx, float32 gf",
        f"const float x = bf16_load(a) + bf16_load(b); gf = bf16_load(g) * ((float)0.5 *"
        f" ((float)1 + t) + (float)0.5 * x * ((float)1 - t * t) * (float){GELU_C!r} *"
        f" ((float)1 + (float)3 * (float){GELU_K!r} * x * x)); gx = bf16_store(gf);"),
}
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
# [Note: column sums]
# A column sum (a bias's or a norm's parameter gradient: the sum over rows of a
# rows x n array) takes a grid of blocks of 32 columns (x) by groups of group_rows rows
# (y), so that a launch fills the device whatever n (24 column blocks at n = 768, while
# an H200 has 132 multiprocessors; launch.column_launch sizes the groups for about
# 4 x 132 blocks). Block (x, y)'s 32 x 32 threads each sum every 32nd row of the group
# in its column, and the row threads' sums are added in their order. With one group
# the block writes the totals. Otherwise it writes its partial sums to a workspace,
# partial[(k groups + y) n + col] for sum k, then __threadfence() (its writes seen
# device-wide before its ticket) and takes a ticket: atomicAdd on counters[x], an
# integer. The block that draws the last ticket adds the groups' partial sums, row
# thread t taking groups t, t + 32, ... in order and the row threads' results then
# added in their order, writes the totals and sets counters[x] back to 0 for the next
# launch (the counters are allocated zeroed once and kept). Every floating-point sum
# runs in an order fixed by the shape, whichever block arrives last: launches are
# bit-identical (no floating-point atomics), and the launch count is one, as before.
# Launches on one stream share the counters (they run one after another).
COLUMN_SUMS = r"""
/* the end of block (x, y)'s rows: group y of group_rows rows, cut at rows */
__device__ __forceinline__ long long mpishard_group_end(const long long rows,
                                                        const long long group_rows) {
  const long long end = ((long long)blockIdx.y + 1) * group_rows;
  return end < rows ? end : rows;
}

/* Thread (x, y) holds the sums s0 and, with SUMS 2, s1 of its rows of column col; the
   column's totals of s0 (where need0) and s1 (where need1) go to out0[col] and
   out1[col], added in a fixed order (see [Note: column sums] in ops_src.py). */
template <int SUMS>
__device__ void mpishard_column_totals(T s0, T s1, const int need0, const int need1,
                                       const int col, const int n, T* out0, T* out1,
                                       T* partial, unsigned int* counters) {
  __shared__ T part[SUMS][32][32];
  __shared__ int last;
  const int x = threadIdx.x, y = threadIdx.y, groups = gridDim.y;
  const long long first1 = (long long)need0 * groups;   /* s1's slots: after s0's */
  part[0][y][x] = s0;
  if (SUMS == 2) part[SUMS - 1][y][x] = s1;
  __syncthreads();
  if (y == 0) {
    for (int k = 1; k < blockDim.y; ++k) {
      s0 += part[0][k][x];
      if (SUMS == 2) s1 += part[SUMS - 1][k][x];
    }
    if (col < n && groups == 1) {
      if (need0) out0[col] = s0;
      if (SUMS == 2 && need1) out1[col] = s1;
    } else if (col < n) {
      if (need0) partial[(long long)blockIdx.y * n + col] = s0;
      if (SUMS == 2 && need1) partial[(first1 + blockIdx.y) * n + col] = s1;
    }
  }
  if (groups == 1) return;
  __threadfence();                  /* the partial sums seen device-wide, then a ticket */
  __syncthreads();
  if (x == 0 && y == 0) last = atomicAdd(counters + blockIdx.x, 1u) == (unsigned)groups - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();                  /* every other group's partial sums are seen now */
  const volatile T* p = partial;    /* read from memory (written by other blocks) */
  T t0 = 0, t1 = 0;
  if (col < n) {
    for (int g = y; g < groups; g += blockDim.y) {
      if (need0) t0 += p[(long long)g * n + col];
      if (SUMS == 2 && need1) t1 += p[(first1 + g) * n + col];
    }
  }
  part[0][y][x] = t0;
  if (SUMS == 2) part[SUMS - 1][y][x] = t1;
  __syncthreads();
  if (y == 0 && col < n) {
    for (int k = 1; k < blockDim.y; ++k) {
      t0 += part[0][k][x];
      if (SUMS == 2) t1 += part[SUMS - 1][k][x];
    }
    if (need0) out0[col] = t0;
    if (SUMS == 2 && need1) out1[col] = t1;
  }
  if (x == 0 && y == 0) counters[blockIdx.x] = 0;   /* zero again for the next launch */
}
"""
#: the RawKernels, ``{T}`` float or double. Softmax takes a thread block per row (the
#: row's max and sum as :data:`BLOCK_REDUCE` s, then its passes), the others a block per
#: 32 columns and group of rows (:data:`COLUMN_SUMS`). An absent optional array is
#: passed as a flag 0 and any valid pointer.
ROW_KERNELS = f"""
#define MPISHARD_GELU_C {GELU_C!r}
#define MPISHARD_GELU_K {GELU_K!r}""" + r"""
typedef {T} T;
""" + BLOCK_REDUCE + COLUMN_SUMS + r"""
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

/* GELU's backward with its input's bias b (a linear layer's, added in the forward's
   kernel): gx = g gelu'(a + b) per element, and gb, the column sums of gx (b's
   gradient). A block per 32 columns and group of rows (see [Note: column sums]). */
extern "C" __global__ void __launch_bounds__(1024)  /* 32 x 32 threads */
mpishard_bias_gelu_backward_{T}(
    const T* a, const T* b, const T* t, const T* g, T* gx, T* gb, const long long rows,
    const int n, const long long group_rows, T* partial, unsigned int* counters) {
  const int col = blockIdx.x * 32 + threadIdx.x;
  T s = 0;
  if (col < n) {
    const T bc = b[col];
    const long long end = mpishard_group_end(rows, group_rows);
    for (long long i = blockIdx.y * group_rows + threadIdx.y; i < end; i += blockDim.y) {
      const long long k = i * n + col;
      const T x = a[k] + bc, th = t[k];
      const T v = g[k] * ((T)0.5 * ((T)1 + th) + (T)0.5 * x * ((T)1 - th * th)
                          * (T)MPISHARD_GELU_C * ((T)1 + (T)3 * (T)MPISHARD_GELU_K * x * x));
      gx[k] = v;
      s += v;
    }
  }
  mpishard_column_totals<1>(s, 0, 1, 0, col, n, gb, gb, partial, counters);
}

/* The gradient through a dropout with a bias before it: gy = g / (1 - p) where
   du >= dp, else 0 (with has_drop; else gy is g, not written), and gb, the column
   sums of gy (the bias's gradient). Blocks as above. */
extern "C" __global__ void __launch_bounds__(1024)  /* 32 x 32 threads */
mpishard_bias_dropout_backward_{T}(
    const T* g, const int has_drop, const float* du, const float dp, const T dscale,
    T* gy, T* gb, const long long rows, const int n, const long long group_rows,
    T* partial, unsigned int* counters) {
  const int col = blockIdx.x * 32 + threadIdx.x;
  T s = 0;
  if (col < n) {
    const long long end = mpishard_group_end(rows, group_rows);
    for (long long i = blockIdx.y * group_rows + threadIdx.y; i < end; i += blockDim.y) {
      const long long k = i * n + col;
      T v = g[k];
      if (has_drop) {
        v = du[k] >= dp ? v * dscale : (T)0;
        gy[k] = v;
      }
      s += v;
    }
  }
  mpishard_column_totals<1>(s, 0, 1, 0, col, n, gb, gb, partial, counters);
}

/* Attention's q, k and v gradients from the head-major (3, B, nh, Tn, hs) buffer h
   back to packed rows (B Tn, n = 3 nh hs), column (w nh + head) hs + j, with has_sum
   their column sums (the fused q/k/v projection's bias gradient) into sums. Blocks as
   above: a warp's 32 columns are 32 neighbouring elements of a head on both sides. */
extern "C" __global__ void __launch_bounds__(1024)  /* 32 x 32 threads */
mpishard_unpack_heads_{T}(
    const T* h, T* rows, const int has_sum, T* sums, const long long B, const int Tn,
    const int nh, const int hs, const long long group_rows, T* partial,
    unsigned int* counters) {
  const int n = 3 * nh * hs;
  const int col = blockIdx.x * 32 + threadIdx.x;
  T s = 0;
  if (col < n) {
    const int j = col % hs, wh = col / hs;
    const long long base = ((long long)(wh / nh) * B * nh + wh % nh) * Tn * hs + j;
    const long long end = mpishard_group_end(B * Tn, group_rows);
    long long i = blockIdx.y * group_rows + threadIdx.y;
    long long b = Tn ? i / Tn : 0;        /* row i is (b, t): stepped on, not divided */
    int t = Tn ? (int)(i % Tn) : 0;
    for (; i < end; i += blockDim.y) {
      const T v = h[base + (b * nh * Tn + t) * hs];
      rows[i * n + col] = v;
      s += v;
      for (t += blockDim.y; t >= Tn; t -= Tn) ++b;
    }
  }
  if (has_sum) mpishard_column_totals<1>(s, 0, 1, 0, col, n, sums, sums, partial,
                                          counters);
}
"""


def row_kernel_source(T: str) -> str:
    """:data:`ROW_KERNELS` for compute type ``T`` (``"float"`` or ``"double"``), each
    kernel named ``<name>_<T>``."""
    return ROW_KERNELS.replace("{T}", T)

"""The CUDA source of fused causal attention: flash-style kernels that keep no T x T array.

Forward, for each query row ``i`` of each (sequence, head), walks the keys
``j <= i`` a tile at a time with an online softmax (FlashAttention, Dao et al.
2022, arXiv:2205.14135, Algorithm 1): the tile's scores, their maximum, the
running sum rescaled by ``exp(old max - new max)``, and the output accumulated
as ``sum_j p_ij v_j``; it writes the output and one float per row, the
log-sum-exp ``lse_i`` of the row's scaled scores, which is all backward keeps.

Backward (FlashAttention-2, Dao 2023, arXiv:2307.08691, Algorithm 2) recomputes
``p_ij = exp(s_ij - lse_i)`` from q, k and lse:

* ``mpishard_flash_dq``, over query rows: ``D_i = dO_i . O_i`` (written for the
  next kernel), then ``dq_i = scale sum_j p_ij (dO_i . v_j - D_i) k_j``;
* ``mpishard_flash_dkv``, over key rows: ``dv_j = sum_i p_ij dO_i`` and
  ``dk_j = scale sum_i p_ij (dO_i . v_j - D_i) q_i`` over the queries ``i >= j``.

Each gradient is summed in a fixed order (no atomics): deterministic. The arrays
are head-major: ``qkv`` ``(3, B, heads, T, hs)`` (q, k, v), the output and its
gradient ``(B, heads, T, hs)``, the gradients ``(3, B, heads, T, hs)``; the head size
a compile-time ``HS`` (a module per head size and row type). Two sets of kernels, by
the same names and arguments:

* :data:`.attention_tc_src.TC_FLASH_KERNELS`, for ``__half`` and ``__nv_bfloat16``
  rows at a head size that is a multiple of 16: the products on tensor cores
  (see that module);
* :data:`FLASH_KERNELS` for the rest: a thread per row, in ``T`` (float, double for
  double), its rows in arrays of ``HS`` (dkv: 4, so at a head size of 64 some spill),
  ``TILE`` threads a block (grid: the ``B heads`` planes along x, the row tiles
  along y), the other side's ``TILE`` rows (32, 16 in double) in shared memory.

There is no dropout: its draws would be a T x T array, the thing this avoids.
"""
from __future__ import annotations

from mpishard.kernels.cuda.attention_tc_src import flash_suffix, tc_flash_source, tensor_cores
from mpishard.kernels.cuda.ops_src import ROWS16, rows16_source

__all__ = ["FLASH_KERNELS", "flash_source", "flash_tile", "flash_suffix"]

FLASH_KERNELS = r"""
typedef {T} T;
typedef {S} S;
#define HS {HS}
#define TILE {TILE}
#define LOWEST ((T)-1e30)   /* below any score; exp(LOWEST - score) is 0 */
/* the block's (sequence, head) plane bh, this thread's row, q, k and v of the plane */
#define MPISHARD_FLASH_PLANE(row) \
  const long long bh = blockIdx.x; \
  const int row = blockIdx.y * TILE + threadIdx.x; \
  const long long plane = (long long)BH * Tn * HS; \
  const S* q = qkv + bh * Tn * HS; \
  const S* k = q + plane; \
  const S* v = k + plane;

/* rows r0 .. r0 + TILE - 1 of a and of b (each Tn rows of HS, stored as S) into the
   shared tiles as T, zeros past the last row; every thread of the block takes part */
__device__ void mpishard_load_tiles(const S* a, const S* b, const int r0, const int Tn,
                                    T at[TILE][HS], T bt[TILE][HS]) {
  for (int e = threadIdx.x; e < TILE * HS; e += TILE) {
    const int r = e / HS, d = e % HS;
    const bool in = r0 + r < Tn;
    at[r][d] = in ? (T)a[(long long)(r0 + r) * HS + d] : (T)0;
    bt[r][d] = in ? (T)b[(long long)(r0 + r) * HS + d] : (T)0;
  }
}

/* the output and lse of each query row: a thread per row, the keys a tile at a time */
extern "C" __global__ void __launch_bounds__(TILE)
mpishard_flash_forward_{N}(const S* qkv, S* out, T* lse, const int BH, const int Tn,
                           const T scale) {
  __shared__ T ks[TILE][HS], vs[TILE][HS];
  MPISHARD_FLASH_PLANE(i)
  T qi[HS], acc[HS];
  const bool live = i < Tn;
  for (int d = 0; d < HS; ++d) {
    qi[d] = live ? (T)q[(long long)i * HS + d] * scale : (T)0;
    acc[d] = 0;
  }
  T m = LOWEST, l = 0;
  const int last = min(Tn - 1, (int)(blockIdx.y * TILE + TILE - 1));  /* block's last query */
  for (int j0 = 0; j0 <= last; j0 += TILE) {
    mpishard_load_tiles(k, v, j0, Tn, ks, vs);
    __syncthreads();
    if (live && j0 <= i) {
      const int count = min(TILE, i - j0 + 1);              /* keys j0 .. i of the tile */
      T s[TILE];
      T tile_max = LOWEST;
      for (int r = 0; r < count; ++r) {
        T dot = 0;
        for (int d = 0; d < HS; ++d) dot += qi[d] * ks[r][d];
        s[r] = dot;
        tile_max = dot > tile_max ? dot : tile_max;
      }
      const T m_new = tile_max > m ? tile_max : m;
      const T correction = exp(m - m_new);                  /* 0 at the first tile */
      l *= correction;
      for (int d = 0; d < HS; ++d) acc[d] *= correction;
      for (int r = 0; r < count; ++r) {
        const T p = exp(s[r] - m_new);
        l += p;
        for (int d = 0; d < HS; ++d) acc[d] += p * vs[r][d];
      }
      m = m_new;
    }
    __syncthreads();
  }
  if (live) {
    const T inv = (T)1 / l;
    S* o = out + (bh * Tn + i) * HS;
    for (int d = 0; d < HS; ++d) o[d] = (S)(acc[d] * inv);
    lse[bh * Tn + i] = m + log(l);
  }
}

/* dq of each query row (and D_i = dO_i . O_i, into dsum, for mpishard_flash_dkv) */
extern "C" __global__ void __launch_bounds__(TILE)
mpishard_flash_dq_{N}(const S* qkv, const S* out, const S* dout, const T* lse, T* dsum,
                      S* dqkv, const int BH, const int Tn, const T scale) {
  __shared__ T ks[TILE][HS], vs[TILE][HS];
  MPISHARD_FLASH_PLANE(i)
  const bool live = i < Tn;
  T qi[HS], gi[HS], dq[HS];
  T D = 0, L = 0;
  if (live) {
    const long long row = (bh * Tn + i) * HS;
    for (int d = 0; d < HS; ++d) {
      qi[d] = (T)q[(long long)i * HS + d] * scale;
      gi[d] = (T)dout[row + d];
      D += gi[d] * (T)out[row + d];
      dq[d] = 0;
    }
    L = lse[bh * Tn + i];
    dsum[bh * Tn + i] = D;
  }
  const int last = min(Tn - 1, (int)(blockIdx.y * TILE + TILE - 1));
  for (int j0 = 0; j0 <= last; j0 += TILE) {
    mpishard_load_tiles(k, v, j0, Tn, ks, vs);
    __syncthreads();
    if (live && j0 <= i) {
      const int count = min(TILE, i - j0 + 1);
      for (int r = 0; r < count; ++r) {
        T s = 0, dp = 0;
        for (int d = 0; d < HS; ++d) {
          s += qi[d] * ks[r][d];
          dp += gi[d] * vs[r][d];
        }
        const T ds = exp(s - L) * (dp - D);
        for (int d = 0; d < HS; ++d) dq[d] += ds * ks[r][d];
      }
    }
    __syncthreads();
  }
  if (live) {
    S* o = dqkv + (bh * Tn + i) * HS;
    for (int d = 0; d < HS; ++d) o[d] = (S)(dq[d] * scale);
  }
}

/* dk and dv of each key row, over the queries i >= j; D from mpishard_flash_dq */
extern "C" __global__ void __launch_bounds__(TILE)
mpishard_flash_dkv_{N}(const S* qkv, const S* dout, const T* lse, const T* dsum, S* dqkv,
                       const int BH, const int Tn, const T scale) {
  __shared__ T qs[TILE][HS], gs[TILE][HS], ls[TILE], Ds[TILE];
  MPISHARD_FLASH_PLANE(j)
  const bool live = j < Tn;
  T kj[HS], vj[HS], dk[HS], dv[HS];
  for (int d = 0; d < HS; ++d) {
    kj[d] = live ? (T)k[(long long)j * HS + d] * scale : (T)0;
    vj[d] = live ? (T)v[(long long)j * HS + d] : (T)0;
    dk[d] = 0;
    dv[d] = 0;
  }
  const int first = blockIdx.y * TILE;                        /* the block's first key */
  for (int i0 = first; i0 < Tn; i0 += TILE) {
    mpishard_load_tiles(q, dout + bh * Tn * HS, i0, Tn, qs, gs);
    if (threadIdx.x < TILE) {
      const bool in = i0 + (int)threadIdx.x < Tn;
      ls[threadIdx.x] = in ? lse[bh * Tn + i0 + threadIdx.x] : (T)0;
      Ds[threadIdx.x] = in ? dsum[bh * Tn + i0 + threadIdx.x] : (T)0;
    }
    __syncthreads();
    if (live) {
      const int start = max(0, j - i0), stop = min(TILE, Tn - i0);  /* queries i >= j */
      for (int r = start; r < stop; ++r) {
        T s = 0, dp = 0;
        for (int d = 0; d < HS; ++d) {
          s += qs[r][d] * kj[d];
          dp += gs[r][d] * vj[d];
        }
        const T p = exp(s - ls[r]);
        const T ds = p * (dp - Ds[r]);
        for (int d = 0; d < HS; ++d) {
          dv[d] += p * gs[r][d];
          dk[d] += ds * qs[r][d];
        }
      }
    }
    __syncthreads();
  }
  if (live) {
    const long long row = (bh * Tn + j) * HS;
    for (int d = 0; d < HS; ++d) {
      dqkv[plane + row + d] = (S)(dk[d] * scale);           /* k's plane */
      dqkv[2 * plane + row + d] = (S)dv[d];                 /* v's */
    }
  }
}
"""


def flash_tile(T: str) -> int:
    """Rows per block (and per shared-memory tile) for compute type ``T``."""
    return 16 if T == "double" else 32


def flash_source(T: str, S: str, hs: int, tensor_core_kernels: bool = True) -> str:
    """:data:`FLASH_KERNELS` for compute type ``T`` (``"float"`` or ``"double"``), row
    storage ``S`` (``T``, or ``"__half"`` or ``"__nv_bfloat16"`` with float) and head
    size ``hs``; each kernel named ``<name>_<S>_<hs>`` (:func:`flash_suffix`). Rows the
    tensor-core kernels take (:func:`tensor_cores`) get those, by the same names, unless
    ``tensor_core_kernels`` is false (their headers are missing: :mod:`.headers`)."""
    sixteen = {c: name for name, (c, _, _) in ROWS16.items()}
    if S in sixteen and T != "float":
        raise ValueError(f"{sixteen[S]} rows are computed in float")
    if tensor_core_kernels and tensor_cores(S, hs):
        return tc_flash_source(S, hs)
    code = (FLASH_KERNELS.replace("{T}", T).replace("{S}", S).replace("{HS}", str(hs))
            .replace("{TILE}", str(flash_tile(T))).replace("{N}", flash_suffix(S, hs)))
    return rows16_source(S, code)

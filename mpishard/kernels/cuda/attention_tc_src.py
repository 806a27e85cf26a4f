"""The CUDA source of fused causal attention on tensor cores, for 16-bit rows.

The same three kernels as :data:`.attention_src.FLASH_KERNELS` (forward, ``dq``,
``dkv``; FlashAttention-2's split, Dao 2023, arXiv:2307.08691), by the same names and
arguments, for ``__half`` and ``__nv_bfloat16`` rows at a head size that is a
multiple of 16 (:func:`tensor_cores`): the products on tensor cores
(``nvcuda::wmma`` 16 x 16 x 16 fragments, float sums). A block is :data:`TC_ROWS`
query rows (dkv: key rows), 16 to each of :data:`TC_WARPS` warps; the other side's
rows pass through shared memory a tile at a time (:func:`tc_tiles`). A warp's scores
go through its float scratch, where two lanes a row take the softmax, ``p`` and
``dS`` (rounded to ``S`` for the next product, as FlashAttention-2 does); the output
and gradients stay in accumulator fragments, rescaled and written through the
scratch (which lane holds which element of a fragment is the hardware's business).
Tiles wholly after a warp's last query are never computed; the longest rows' blocks
start first. No thread keeps an array of the head size: no spills at head sizes 64
and 128 (``scripts/compile_kernels.py`` holds them to it).
"""
from __future__ import annotations

from mpishard.kernels.cuda.ops_src import rows16_source

__all__ = ["TC_FLASH_KERNELS", "TC_ROWS", "TC_WARPS", "tc_flash_source", "tc_shared_bytes",
           "tc_tiles", "tensor_cores", "flash_suffix"]

#: query rows of a tensor-core kernel's block (dkv: key rows), 16 to each of its warps
TC_ROWS = 64
TC_WARPS = TC_ROWS // 16
TC_SHARED_LIMIT = 48 * 1024     # static shared memory a block may have without opting in

TC_FLASH_KERNELS = r"""
#include <mma.h>
typedef {S} S;
#define HS {HS}
#define NH (HS / 16)           /* 16-wide fragments across a row */
#define ROWS {ROWS}            /* the block's query rows (key rows in dkv), 16 a warp */
#define WARPS (ROWS / 16)
#define BK {BK}                /* forward's key tile */
#define BKQ {BKQ}              /* dq's key tile */
#define BQK {BQK}              /* dkv's query tile */
#define LOWEST (-1e30f)        /* below any score; expf(LOWEST - score) is 0 */
/* lane (r, half)'s t-th of its 8 columns of a 16 x 16 float tile, turned by r / 2 so that
   the warp's 32 lanes read 32 different banks */
#define COL(t) (half * 8 + (((t) + r / 2) & 7))
using namespace nvcuda;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, S, wmma::row_major> RowsA;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, S, wmma::col_major> ColsA;  /* transposed */
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, S, wmma::row_major> RowsB;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, S, wmma::col_major> ColsB;  /* transposed */
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> Acc;
struct alignas(16) mpishard_chunk { unsigned int word[4]; };  /* 8 elements of a row */

#define MPISHARD_TC_PLANE \
  const long long bh = blockIdx.x; \
  const long long plane = (long long)BH * Tn * HS; \
  const S* q = qkv + bh * Tn * HS; \
  const S *k = q + plane, *v = k + plane; \
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32; \
  const int r = lane / 2, half = lane % 2;   /* the lane's row of the warp's 16, half of it */

/* rows r0 .. r0 + n - 1 of src (Tn rows of HS) into dst, zeros past the last row: the
   block's threads together, 16 bytes at a time */
__device__ void mpishard_tc_stage(const S* src, const int r0, const int n, const int Tn,
                                  S* dst) {
  const mpishard_chunk zero = {{0u, 0u, 0u, 0u}};
  const mpishard_chunk* from = reinterpret_cast<const mpishard_chunk*>(src);
  mpishard_chunk* to = reinterpret_cast<mpishard_chunk*>(dst);
  for (int e = threadIdx.x; e < n * (HS / 8); e += WARPS * 32) {
    const int row = r0 + e / (HS / 8);
    to[e] = row < Tn ? from[(long long)row * (HS / 8) + e % (HS / 8)] : zero;
  }
}

/* acc[0 .. NH) (16 rows of HS, a warp's) times factor into rows of dst (Tn rows of HS):
   each fragment through the warp's 16 x 16 scratch, each lane writing 8 elements of row
   r0 + r; rows past the last are not written */
__device__ void mpishard_tc_write(Acc* acc, float* scratch, const int r0, const int Tn,
                                  const float factor, S* dst) {
  const int lane = threadIdx.x % 32, r = lane / 2, half = lane % 2;
#pragma unroll
  for (int d = 0; d < NH; ++d) {
    __syncwarp();
    wmma::store_matrix_sync(scratch, acc[d], 16, wmma::mem_row_major);
    __syncwarp();
    if (r0 + r < Tn)
      for (int t = 0; t < 8; ++t)
        dst[(long long)(r0 + r) * HS + d * 16 + COL(t)] = (S)(scratch[r * 16 + COL(t)] * factor);
  }
}

/* forward: a block's ROWS query rows, a warp's 16 of them against the keys a tile of BK
   at a time (tiles wholly after the warp's last query skipped); the scores and weights
   through the warp's shared scratch, the output in fragments, rescaled through it */
extern "C" __global__ void __launch_bounds__(WARPS * 32)
mpishard_flash_forward_{N}(const S* qkv, S* out, float* lse, const int BH, const int Tn,
                           const float scale) {
  alignas(32) __shared__ unsigned char smem[{FORWARD_BYTES}];
  MPISHARD_TC_PLANE
  S* qs = reinterpret_cast<S*>(smem);                  /* ROWS x HS */
  S* ks = qs + ROWS * HS;                              /* BK x HS */
  S* vs = ks + BK * HS;
  float* sw = reinterpret_cast<float*>(vs + BK * HS) + warp * 16 * BK;   /* 16 x BK */
  S* pw = reinterpret_cast<S*>(reinterpret_cast<float*>(vs + BK * HS) + WARPS * 16 * BK)
          + warp * 16 * BK;                                              /* 16 x BK */
  const int q0 = (gridDim.y - 1 - blockIdx.y) * ROWS;   /* the longest rows first */
  const int w0 = q0 + warp * 16, i = w0 + r;
  const int last = min(Tn - 1, q0 + ROWS - 1);
  const int wlast = w0 < Tn ? min(Tn - 1, w0 + 15) : -1;   /* the warp's last query */
  mpishard_tc_stage(q, q0, ROWS, Tn, qs);
  Acc o[NH];
#pragma unroll
  for (int d = 0; d < NH; ++d) wmma::fill_fragment(o[d], 0.0f);
  float m = LOWEST, l = 0.0f;                          /* row i's, in both its lanes */
  for (int j0 = 0; j0 <= last; j0 += BK) {
    __syncthreads();                                   /* the last tile is read */
    mpishard_tc_stage(k, j0, BK, Tn, ks);
    mpishard_tc_stage(v, j0, BK, Tn, vs);
    __syncthreads();
    if (j0 > wlast) continue;                          /* the whole warp, alike */
    const int subtiles = min(BK / 16, (wlast - j0) / 16 + 1);   /* keys <= the warp's last */
    for (int c = 0; c < subtiles; ++c) {
      Acc s;
      wmma::fill_fragment(s, 0.0f);
#pragma unroll
      for (int d = 0; d < NH; ++d) {
        RowsA a; ColsB b;
        wmma::load_matrix_sync(a, qs + warp * 16 * HS + d * 16, HS);
        wmma::load_matrix_sync(b, ks + c * 16 * HS + d * 16, HS);
        wmma::mma_sync(s, a, b, s);
      }
      wmma::store_matrix_sync(sw + c * 16, s, BK, wmma::mem_row_major);
    }
    __syncwarp();
    /* row i's online softmax over the tile's computed columns, half in each of its lanes,
       each lane from its own column round (the warp's reads fall in different banks) */
    const int width = subtiles * 8, c0 = half * width, start = c0 + lane % width;
    float tile_max = LOWEST;
    for (int u = 0, c = start; u < width; ++u, c = c + 1 < c0 + width ? c + 1 : c0)
      if (j0 + c <= i) tile_max = fmaxf(tile_max, sw[r * BK + c] * scale);
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    const float m_new = fmaxf(m, tile_max);
    const float correction = expf(m - m_new);          /* 0 at the first tile */
    float sum = 0.0f;
    for (int u = 0, c = start; u < width; ++u, c = c + 1 < c0 + width ? c + 1 : c0) {
      const float p = j0 + c <= i && i < Tn ? expf(sw[r * BK + c] * scale - m_new) : 0.0f;
      pw[r * BK + c] = (S)p;                           /* as S for the product, as */
      sum += p;                                        /* FlashAttention-2 has it */
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * correction + sum;
    m = m_new;
    /* o *= correction by rows, through the scratch (a fragment's rows are opaque), when
       a row's maximum moved (the warp agrees by shuffles) */
    int moved = correction != 1.0f;
    for (int other = 16; other > 0; other /= 2)
      moved |= __shfl_xor_sync(0xffffffffu, moved, other);
    if (moved && j0 > 0) {
#pragma unroll
      for (int d = 0; d < NH; ++d) {
        __syncwarp();
        wmma::store_matrix_sync(sw, o[d], 16, wmma::mem_row_major);
        __syncwarp();
        for (int t = 0; t < 8; ++t) sw[r * 16 + COL(t)] *= correction;
        __syncwarp();
        wmma::load_matrix_sync(o[d], sw, 16, wmma::mem_row_major);
      }
    }
    __syncwarp();                                      /* the weights are written */
#pragma unroll
    for (int d = 0; d < NH; ++d)
      for (int c = 0; c < subtiles; ++c) {
        RowsA a; RowsB b;
        wmma::load_matrix_sync(a, pw + c * 16, BK);
        wmma::load_matrix_sync(b, vs + c * 16 * HS + d * 16, HS);
        wmma::mma_sync(o[d], a, b, o[d]);
      }
    __syncwarp();
  }
  if (w0 >= Tn) return;                                /* no barrier follows */
  mpishard_tc_write(o, sw, w0, Tn, 1.0f / l, out + bh * Tn * HS);
  if (i < Tn && half == 0) lse[bh * Tn + i] = m + logf(l);
}

/* the scores q k^T (unscaled) and dP = dO v^T of a warp's 16 rows of qs and gs against
   16 rows of ks and vs, into the warp's two 16 x 16 scratch tiles */
__device__ void mpishard_tc_scores(const S* qs, const S* gs, const S* ks, const S* vs,
                                   float* sa, float* sb) {
  Acc s, dp;
  wmma::fill_fragment(s, 0.0f);
  wmma::fill_fragment(dp, 0.0f);
#pragma unroll
  for (int d = 0; d < NH; ++d) {
    RowsA a; ColsB b;
    wmma::load_matrix_sync(a, qs + d * 16, HS);
    wmma::load_matrix_sync(b, ks + d * 16, HS);
    wmma::mma_sync(s, a, b, s);
    wmma::load_matrix_sync(a, gs + d * 16, HS);
    wmma::load_matrix_sync(b, vs + d * 16, HS);
    wmma::mma_sync(dp, a, b, dp);
  }
  __syncwarp();
  wmma::store_matrix_sync(sa, s, 16, wmma::mem_row_major);
  wmma::store_matrix_sync(sb, dp, 16, wmma::mem_row_major);
  __syncwarp();
}

/* dq of a block's ROWS query rows (and D_i = dO_i . O_i into dsum, for dkv), a warp's 16
   against the keys j <= i, BKQ a tile, 16 at a time: p and dS = p (dP - D) by the lanes
   (row i's 16 by its two), dS as S into the scratch, dq += dS K on tensor cores */
extern "C" __global__ void __launch_bounds__(WARPS * 32)
mpishard_flash_dq_{N}(const S* qkv, const S* out, const S* dout, const float* lse,
                      float* dsum, S* dqkv, const int BH, const int Tn, const float scale) {
  alignas(32) __shared__ unsigned char smem[{DQ_BYTES}];
  MPISHARD_TC_PLANE
  S* qs = reinterpret_cast<S*>(smem);                  /* ROWS x HS */
  S* gs = qs + ROWS * HS;                              /* dO, ROWS x HS */
  S* ks = gs + ROWS * HS;                              /* BKQ x HS */
  S* vs = ks + BKQ * HS;
  float* sa = reinterpret_cast<float*>(vs + BKQ * HS) + warp * 2 * 256;
  float* sb = sa + 256;
  const S* g = dout + bh * Tn * HS;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * ROWS;   /* the longest rows first */
  const int w0 = q0 + warp * 16, i = w0 + r;
  const int last = min(Tn - 1, q0 + ROWS - 1);
  const int wlast = w0 < Tn ? min(Tn - 1, w0 + 15) : -1;   /* the warp's last query */
  float D = 0.0f, L = 0.0f;
  if (i < Tn) {
    const long long row = (bh * Tn + i) * HS;
    for (int d = half * (HS / 2); d < (half + 1) * (HS / 2); ++d)
      D += (float)dout[row + d] * (float)out[row + d];
    L = lse[bh * Tn + i];
  }
  D += __shfl_xor_sync(0xffffffffu, D, 1);
  if (i < Tn && half == 0) dsum[bh * Tn + i] = D;
  mpishard_tc_stage(q, q0, ROWS, Tn, qs);
  mpishard_tc_stage(g, q0, ROWS, Tn, gs);
  Acc dq[NH];
#pragma unroll
  for (int d = 0; d < NH; ++d) wmma::fill_fragment(dq[d], 0.0f);
  for (int j0 = 0; j0 <= last; j0 += BKQ) {
    __syncthreads();
    mpishard_tc_stage(k, j0, BKQ, Tn, ks);
    mpishard_tc_stage(v, j0, BKQ, Tn, vs);
    __syncthreads();
    if (j0 > wlast) continue;
    const int subtiles = min(BKQ / 16, (wlast - j0) / 16 + 1);
    for (int c = 0; c < subtiles; ++c) {
      mpishard_tc_scores(qs + warp * 16 * HS, gs + warp * 16 * HS, ks + c * 16 * HS,
                         vs + c * 16 * HS, sa, sb);
      float ds[8];
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        const int col = COL(t), j = j0 + c * 16 + col;
        const float p = j <= i && i < Tn ? expf(sa[r * 16 + col] * scale - L) : 0.0f;
        ds[t] = p * (sb[r * 16 + col] - D);
      }
      __syncwarp();                                    /* dS over the scores' place */
      S* dsh = reinterpret_cast<S*>(sa);
#pragma unroll
      for (int t = 0; t < 8; ++t) dsh[r * 16 + COL(t)] = (S)ds[t];
      __syncwarp();
      RowsA a;
      wmma::load_matrix_sync(a, dsh, 16);
#pragma unroll
      for (int d = 0; d < NH; ++d) {
        RowsB b;
        wmma::load_matrix_sync(b, ks + c * 16 * HS + d * 16, HS);
        wmma::mma_sync(dq[d], a, b, dq[d]);
      }
    }
  }
  if (w0 >= Tn) return;
  mpishard_tc_write(dq, sa, w0, Tn, scale, dqkv + bh * Tn * HS);
}

/* dk and dv of a block's ROWS key rows, a warp's 16 against the queries i >= j, BQK a
   tile, 16 at a time: the scores of the queries' rows as dq has them, p and dS by the
   lanes into the scratch as S, then dv += p^T dO and dk += dS^T q (the transposes read
   column-major); D from mpishard_flash_dq */
extern "C" __global__ void __launch_bounds__(WARPS * 32)
mpishard_flash_dkv_{N}(const S* qkv, const S* dout, const float* lse, const float* dsum,
                       S* dqkv, const int BH, const int Tn, const float scale) {
  alignas(32) __shared__ unsigned char smem[{DKV_BYTES}];
  MPISHARD_TC_PLANE
  S* ks = reinterpret_cast<S*>(smem);                  /* ROWS x HS */
  S* vs = ks + ROWS * HS;
  S* qs = vs + ROWS * HS;                              /* BQK x HS */
  S* gs = qs + BQK * HS;                               /* dO, BQK x HS */
  float* sa = reinterpret_cast<float*>(gs + BQK * HS) + warp * 2 * 256;
  float* sb = sa + 256;
  const S* g = dout + bh * Tn * HS;
  const int k0 = blockIdx.y * ROWS, w0 = k0 + warp * 16;    /* the block's first key, warp's */
  mpishard_tc_stage(k, k0, ROWS, Tn, ks);
  mpishard_tc_stage(v, k0, ROWS, Tn, vs);
  Acc dk[NH], dv[NH];
#pragma unroll
  for (int d = 0; d < NH; ++d) {
    wmma::fill_fragment(dk[d], 0.0f);
    wmma::fill_fragment(dv[d], 0.0f);
  }
  for (int i0 = k0; i0 < Tn; i0 += BQK) {
    __syncthreads();
    mpishard_tc_stage(q, i0, BQK, Tn, qs);
    mpishard_tc_stage(g, i0, BQK, Tn, gs);
    __syncthreads();
    if (w0 >= Tn) continue;
    for (int c = 0; c < BQK / 16; ++c) {
      const int first = i0 + c * 16, i = first + r;
      if (first + 15 < w0 || first >= Tn) continue;    /* before the warp's keys, or past T */
      mpishard_tc_scores(qs + c * 16 * HS, gs + c * 16 * HS, ks + warp * 16 * HS,
                         vs + warp * 16 * HS, sa, sb);
      const float L = i < Tn ? lse[bh * Tn + i] : 0.0f, D = i < Tn ? dsum[bh * Tn + i] : 0.0f;
      float p[8], ds[8];
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        const int col = COL(t), j = w0 + col;
        p[t] = j <= i && i < Tn ? expf(sa[r * 16 + col] * scale - L) : 0.0f;
        ds[t] = p[t] * (sb[r * 16 + col] - D);
      }
      __syncwarp();                                    /* p and dS over the scores' place */
      S* ph = reinterpret_cast<S*>(sa);
      S* dsh = reinterpret_cast<S*>(sb);
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        ph[r * 16 + COL(t)] = (S)p[t];
        dsh[r * 16 + COL(t)] = (S)ds[t];
      }
      __syncwarp();
      ColsA pt, dst;
      wmma::load_matrix_sync(pt, ph, 16);
      wmma::load_matrix_sync(dst, dsh, 16);
#pragma unroll
      for (int d = 0; d < NH; ++d) {
        RowsB b;
        wmma::load_matrix_sync(b, gs + c * 16 * HS + d * 16, HS);
        wmma::mma_sync(dv[d], pt, b, dv[d]);
        wmma::load_matrix_sync(b, qs + c * 16 * HS + d * 16, HS);
        wmma::mma_sync(dk[d], dst, b, dk[d]);
      }
    }
  }
  if (w0 >= Tn) return;
  mpishard_tc_write(dk, sa, w0, Tn, scale, dqkv + plane + bh * Tn * HS);
  mpishard_tc_write(dv, sa, w0, Tn, 1.0f, dqkv + 2 * plane + bh * Tn * HS);
}
"""


def tc_shared_bytes(kernel: str, hs: int, tile: int) -> int:
    """Static shared memory of tensor-core ``kernel`` (``"forward"``, ``"dq"``, ``"dkv"``)
    at head size ``hs`` with a key (dkv: query) tile of ``tile`` rows."""
    if kernel == "forward":           # q rows, k and v tiles, a warp's scores and weights
        return 2 * TC_ROWS * hs + 4 * tile * hs + TC_WARPS * 16 * tile * (4 + 2)
    # q and dO rows (dkv: k and v), the other two's tile, two 16 x 16 float scratch a warp
    return 4 * TC_ROWS * hs + 4 * tile * hs + TC_WARPS * 2 * 256 * 4


def tc_tiles(hs: int) -> dict:
    """Each tensor-core kernel's tile at head size ``hs``: 64, 32 or 16 rows, the most that fit."""
    return {kernel: next(t for t in (64, 32, 16)
                         if tc_shared_bytes(kernel, hs, t) <= TC_SHARED_LIMIT)
            for kernel in ("forward", "dq", "dkv")}


def tensor_cores(S: str, hs: int) -> bool:
    """Whether rows stored as ``S`` at head size ``hs`` run the tensor-core kernels."""
    return S in ("__half", "__nv_bfloat16") and hs % 16 == 0 and 0 < hs <= 128


def tc_flash_source(S: str, hs: int) -> str:
    """:data:`TC_FLASH_KERNELS` for 16-bit rows ``S`` at head size ``hs``."""
    tiles = tc_tiles(hs)
    values = {"S": S, "HS": hs, "ROWS": TC_ROWS, "BK": tiles["forward"], "BKQ": tiles["dq"],
              "BQK": tiles["dkv"], "N": flash_suffix(S, hs),
              **{f"{k.upper()}_BYTES": tc_shared_bytes(k, hs, t) for k, t in tiles.items()}}
    code = TC_FLASH_KERNELS
    for key, value in values.items():
        code = code.replace("{" + key + "}", str(value))
    return rows16_source(S, code)


def flash_suffix(S: str, hs: int) -> str:
    """The kernels' names end in ``_<this>`` for row storage ``S`` and head size ``hs``."""
    tag = {"__half": "half", "__nv_bfloat16": "bfloat16"}.get(S, S)
    return f"{tag}_{hs}"

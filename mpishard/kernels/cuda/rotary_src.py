"""The CUDA source of the GPU's rotary embeddings packed with grouped key/value heads
(:mod:`.rotary` launches it).

Two RawKernels, a thread per element written (a grid-stride loop), reading the rows
where they lie: stored as ``S`` (``__half``, ``__nv_bfloat16``, float or double), each
element converted to ``T`` (float, or double for double rows) in a register, so no
float32 copy of q, k, v or their gradients is made. The tables ``c`` and ``s`` are
``(seq, hs)`` in ``T``; the rotation's sign (``rotate_half``'s) is taken here: the
first half of ``s`` enters negated.

* ``mpishard_rope_qkv_forward``: the packed rows ``(B, seq, 3, H, hs)``; element ``i``
  of query head ``j`` is ``q_i c_i + q_p s'_i`` (``p`` the element of the other half,
  ``s'`` the signed table), of part 1 the same of key/value head ``first + j / g`` of
  k, of part 2 that head of v as it is;
* ``mpishard_rope_qkv_backward``: from the packed gradient ``d``, per row ``[gq (H
  heads) | gk (n_kv) | gv (n_kv)]``: q's ``d_i c_i - d_p s'_i``; key/value head ``kv``'s
  sums over its group's query heads, ``g`` of them from ``(kv - first) g`` on, added
  in that order (zero for a head outside ``first .. first + H / g - 1``), k's then
  rotated back the same way. ``need`` (bits 1, 2, 4: q, k, v) says which are written.

Each product and sum is rounded in ``T`` as the reference's passes round them, then
once into ``S`` (NVRTC may contract a product and its sum into one FMA, a rounding
the reference does not make). ``{T}``, ``{S}`` and ``{N}`` are filled in by
:func:`rotary_kernel_source`; ``scripts/compile_kernels.py`` compiles them with NVRTC.
"""
from __future__ import annotations

from mpishard.kernels.cuda.ops_src import storage_name, storage_source

__all__ = ["ROTARY_KERNELS", "rotary_kernel_source", "rotary_kernel_name"]

ROTARY_KERNELS = r"""
typedef {T} T;
typedef {S} S;   /* the rows in memory: T, or __half / __nv_bfloat16 (computed in float) */

/* element i's partner in the other half (rotate_half's swap) and its table sign */
__device__ __forceinline__ int mpishard_partner(const int i, const int hs) {
  const int h = hs / 2;
  return i < hs - h ? i + h : i - (hs - h);
}

extern "C" __global__ void mpishard_rope_qkv_forward_{N}(
    const S* q, const S* k, const S* v, const T* c, const T* s, S* out, const long long n,
    const int seq, const int H, const int n_kv, const int hs, const int first, const int g) {
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n;
       e += (long long)gridDim.x * blockDim.x) {
    const int i = (int)(e % hs);
    long long r = e / hs;
    const int j = (int)(r % H);
    r /= H;
    const int part = (int)(r % 3);
    const long long bt = r / 3;                      /* b * seq + t */
    const S* x = part == 0 ? q + (bt * H + j) * hs
                           : (part == 1 ? k : v) + (bt * n_kv + first + j / g) * hs;
    if (part == 2) { out[e] = x[i]; continue; }
    const long long at = (bt % seq) * hs + i;
    const T signed_s = i < hs / 2 ? -s[at] : s[at];
    const T a = (T)x[i] * c[at];
    const T b = (T)x[mpishard_partner(i, hs)] * signed_s;
    out[e] = (S)(a + b);
  }
}

extern "C" __global__ void mpishard_rope_qkv_backward_{N}(
    const S* d, const T* c, const T* s, S* gq, S* gk, S* gv, const long long n,
    const int seq, const int H, const int n_kv, const int hs, const int first, const int g,
    const int need) {
  const int width = H + 2 * n_kv;                  /* heads of a row: gq, gk, gv */
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n;
       e += (long long)gridDim.x * blockDim.x) {
    const int i = (int)(e % hs);
    long long r = e / hs;
    const int w = (int)(r % width);
    const long long bt = r / width;
    const S* row = d + bt * 3LL * H * hs;           /* the row's [q | k | v] gradients */
    const int p = mpishard_partner(i, hs);
    const long long at = (bt % seq) * hs + i;
    const T signed_s = i < hs / 2 ? -s[at] : s[at];
    if (w < H) {
      if (!(need & 1)) continue;
      const S* x = row + (long long)w * hs;
      const T a = (T)x[i] * c[at];
      const T b = (T)x[p] * signed_s;
      gq[(bt * H + w) * hs + i] = (S)(a - b);
      continue;
    }
    const int part = w < H + n_kv ? 1 : 2;
    if (!(need & (part == 1 ? 2 : 4))) continue;
    const int kv = w - H - (part - 1) * n_kv;
    const int lo = (kv - first) * g;
    T sum = 0, other = 0;
    if (kv >= first && lo < H) {
      const S* x = row + ((long long)part * H + lo) * hs;
      sum = (T)x[i];
      if (part == 1) other = (T)x[p];
      for (int m = 1; m < g; ++m) {
        sum += (T)x[(long long)m * hs + i];
        if (part == 1) other += (T)x[(long long)m * hs + p];
      }
    }
    if (part == 2) { gv[(bt * n_kv + kv) * hs + i] = (S)sum; continue; }
    const T a = sum * c[at];
    const T b = other * signed_s;
    gk[(bt * n_kv + kv) * hs + i] = (S)(a - b);
  }
}
"""


def rotary_kernel_name(name: str, S: str) -> str:
    """The name of kernel ``name`` for rows stored as ``S`` (:func:`.ops_src.storage_name`)."""
    return storage_name(name, S)


def rotary_kernel_source(T: str, S: str) -> str:
    """:data:`ROTARY_KERNELS` computing in ``T`` on rows stored as ``S``
    (:func:`.ops_src.storage_source`)."""
    return storage_source(ROTARY_KERNELS, T, S, "rows")

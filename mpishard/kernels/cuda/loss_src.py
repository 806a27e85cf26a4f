"""The CUDA source of the GPU's fused cross-entropy (:mod:`.loss` launches it).

Two RawKernels, a thread block per row of the ``(rows, V)`` logits ``x``, which
are read where they lie: stored as ``S`` (``__half``, float or double), each
element converted to ``T`` (float, or double for double logits) in a register,
so no float32 copy of the logits is ever made.

* ``mpishard_cross_entropy_forward``: the row's maximum ``m`` and
  ``s = sum_j exp(x_j - m)`` (block reductions, :data:`.ops_src.BLOCK_REDUCE`),
  and its loss ``log(s) - (x_t - m)`` for its target ``t`` (0 where ``t`` is
  ``ignore``; nan for a target outside ``[0, V)``, as the embedding does for an
  id out of range: nothing is read back to check it). Then the grid's last block
  to finish (each block takes a ticket after a ``__threadfence``, as the CUDA
  programming guide's reduction across blocks does) adds every row's loss and
  counts the rows counted, in a fixed order (deterministic, no atomics on the
  values), writes their mean and count, and hands the ticket counter back at 0 for
  the next launch. So the whole loss is one launch.
* ``mpishard_cross_entropy_backward``: the softmax again from ``m`` and ``s``,
  ``(exp(x_j - m) / s - [j == t]) * g / max(count, 1)`` written in ``S``, 0 on an
  ignored row: one launch, no float32 array of the gradient either.

The forward's ``stats`` is ``(3, rows)`` in ``T``: the maxima, the sums, the rows'
losses; its ``totals`` two ``T``: the mean loss, the count (the backward takes the
maxima, the sums and the count). ``{T}``, ``{S}`` and ``{N}`` are
filled in by :func:`loss_kernel_source`; a 16-bit storage (``__half``,
``__nv_bfloat16``) brings its header (:data:`.ops_src.ROWS16`), the kernels
converting with ``(T)`` and ``(S)``. ``scripts/compile_kernels.py`` compiles them with NVRTC.
"""
from __future__ import annotations

from mpishard.kernels.cuda.ops_src import BLOCK_REDUCE, storage_name, storage_source

__all__ = ["LOSS_KERNELS", "loss_kernel_source", "loss_kernel_name"]

LOSS_KERNELS = r"""
typedef {T} T;
typedef {S} S;   /* the logits in memory: T, or __half / __nv_bfloat16 (computed in float) */
""" + BLOCK_REDUCE + r"""
extern "C" __global__ void mpishard_cross_entropy_forward_{N}(
    const S* x, const long long* t, const long long rows, const int V, const long long ignore,
    T* stats, T* totals, unsigned int* ticket) {
  __shared__ T shared[32];
  __shared__ bool last;
  const long long row = blockIdx.x;
  const S* xr = x + row * V;
  T m = (T)xr[0];
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    const T v = (T)xr[j];
    m = v > m ? v : m;
  }
  m = mpishard_block_reduce(m, true, shared);
  T s = 0;
  for (int j = threadIdx.x; j < V; j += blockDim.x) s += exp((T)xr[j] - m);
  s = mpishard_block_reduce(s, false, shared);
  if (threadIdx.x == 0) {
    const long long target = t[row];
    T loss = 0;
    if (target != ignore)
      loss = target >= 0 && target < V ? log(s) - ((T)xr[target] - m) : (T)nan("");
    stats[row] = m;
    stats[rows + row] = s;
    stats[2 * rows + row] = loss;
    __threadfence();                   /* this row's loss is visible before the ticket */
    last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  /* the last block: every row's loss is written; add them (and count) in a fixed order */
  const volatile T* losses = stats + 2 * rows;
  T total = 0, count = 0;
  for (long long r = threadIdx.x; r < rows; r += blockDim.x) {
    if (t[r] != ignore) {
      total += losses[r];
      count += (T)1;
    }
  }
  total = mpishard_block_reduce(total, false, shared);
  count = mpishard_block_reduce(count, false, shared);
  if (threadIdx.x == 0) {
    totals[0] = total / count;         /* no row counted: 0 / 0 = nan */
    totals[1] = count;
    *ticket = 0u;                      /* for the next launch */
  }
}

extern "C" __global__ void mpishard_cross_entropy_backward_{N}(
    const S* x, const long long* t, const int V, const long long ignore, const T* row_max,
    const T* row_sum, const T* count, const T* g, S* dx) {
  const long long row = blockIdx.x;
  const long long target = t[row];
  const T m = row_max[row];
  const T inv = (T)1 / row_sum[row];
  const T scale = target != ignore ? g[0] / (count[0] > (T)1 ? count[0] : (T)1) : (T)0;
  const S* xr = x + row * V;
  S* dr = dx + row * V;
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    T p = exp((T)xr[j] - m) * inv;
    if (j == target) p -= (T)1;
    dr[j] = (S)(p * scale);
  }
}
"""


def loss_kernel_name(name: str, S: str) -> str:
    """The name of kernel ``name`` for logits stored as ``S`` (:func:`.ops_src.storage_name`)."""
    return storage_name(name, S)


def loss_kernel_source(T: str, S: str) -> str:
    """:data:`LOSS_KERNELS` computing in ``T`` on logits stored as ``S``
    (:func:`.ops_src.storage_source`)."""
    return storage_source(LOSS_KERNELS, T, S, "logits")

"""The CUDA source of the multi-tensor kernels: one launch for all of a step's targets.

An optimizer step touches every flat target (a parameter, or a ZeRO shard, or a
mixed-precision master) and the gradient norm reads every gradient. One kernel
per target and per operation is hundreds of launches a step for a 124M GPT; here
each is one launch (the norm: two), as apex's and PyTorch's ``multi_tensor_apply``
do. A launch gets a table of the targets' addresses (``ptrs``, 64-bit device
addresses by column: Adam's every target's parameter, then every gradient, every
``m``, every ``v``; the sums of squares' one per array) and a table of *chunks*, four
64-bit integers each: ``(target, start, stop, flag)``, elements ``start .. stop - 1``
of that target (at most :data:`CHUNK` of them, never across a weight-decay boundary),
``flag`` 1 where the chunk gets weight decay. A thread block takes one chunk. The
tables are built on the host once for a set of targets and kept, a gradient that moved
updating its address alone (:mod:`.multi` launches these kernels; see [Note:
multi-tensor tables] there).

* ``mpishard_multi_adam_{T}``: per element, ``g = grad * grad_scale`` (the loss
  scale's and the clipping's factor, where ``scaled``), ``p *= decay`` where the
  chunk decays (decoupled weight decay), then Adam's update of ``m``, ``v`` and
  ``p``, term for term the one-target kernel's (``mpishard_adam_update``). With
  ``on_device`` the step size, the second moment's bias correction and the gradient
  factor are read from 0-d device arrays (double, cast to ``T`` as the host's
  arguments are), and a set ``skip`` flag returns at once: a step decided on the
  device, with no value read back (see [Note: device step decisions] in
  mpishard/parallel/strategy.py);
* ``mpishard_multi_sq_sum_{T}``: each chunk's sum of squares in double (a block
  reduction, deterministic) into ``partial[chunk]``; ``mpishard_multi_sq_total``
  adds each target's chunks' partial sums in order into ``out[target]``.

The one-target kernels, for targets the tables do not take, are :data:`SOURCES`'
``cupy.ElementwiseKernel`` (Adam) and :data:`REDUCTIONS`' ``cupy.ReductionKernel``
(a sum of squares).
"""
from __future__ import annotations

__all__ = ["MULTI_KERNELS", "multi_source", "CHUNK", "SOURCES", "REDUCTIONS"]

#: elements per chunk (a thread block's share): 256 threads, 256 elements each
CHUNK = 1 << 16

MULTI_KERNELS = r"""
typedef {T} T;

extern "C" __global__ void mpishard_multi_adam_{T}(
    const unsigned long long* ptrs, const int n_targets, const long long* chunks,
    const T b1, const T one_b1, const T b2, const T one_b2, const T step, const T ib2,
    const T eps, const int scaled, const T grad_scale, const T decay, const int on_device,
    const double* d_step, const double* d_ib2, const double* d_scale, const bool* d_skip) {
  /* on_device: the step's scalars are read from device memory, and a set skip flag
     (non-finite gradients) leaves everything as it was */
  if (on_device && *d_skip) return;
  const T step_ = on_device ? (T)*d_step : step;
  const T ib2_ = on_device ? (T)*d_ib2 : ib2;
  const T scale_ = on_device ? (T)*d_scale : grad_scale;
  const bool scaled_ = on_device || scaled;
  const long long* c = chunks + 4 * (long long)blockIdx.x;
  const unsigned long long* t = ptrs + c[0];   /* by column: params, grads, m, v */
  T* p = (T*)t[0];
  const T* g = (const T*)t[n_targets];
  T* m = (T*)t[2 * (long long)n_targets];
  T* v = (T*)t[3 * (long long)n_targets];
  const bool decays = c[3] != 0;
  for (long long e = c[1] + threadIdx.x; e < c[2]; e += blockDim.x) {
    const T ge = scaled_ ? (T)(g[e] * scale_) : g[e];
    const T pe = decays ? (T)(p[e] * decay) : p[e];
    const T me = b1 * m[e] + one_b1 * ge;
    const T ve = b2 * v[e] + one_b2 * ge * ge;
    m[e] = me;
    v[e] = ve;
    p[e] = pe - step_ * (me / (sqrt(ve) * ib2_ + eps));
  }
}

extern "C" __global__ void mpishard_multi_sq_sum_{T}(
    const unsigned long long* ptrs, const long long* chunks, double* partial) {
  __shared__ double part[32];
  const long long* c = chunks + 4 * (long long)blockIdx.x;
  const T* x = (const T*)ptrs[c[0]];
  double s = 0;
  for (long long e = c[1] + threadIdx.x; e < c[2]; e += blockDim.x) {
    const double xe = (double)x[e];
    s += xe * xe;
  }
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) part[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += part[w];
    partial[blockIdx.x] = total;
  }
}

extern "C" __global__ void mpishard_multi_sq_total_{T}(
    const double* partial, const long long* first, const int n_targets, double* out) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n_targets) return;
  double s = 0;
  for (long long c = first[t]; c < first[t + 1]; ++c) s += partial[c];
  out[t] = s;
}
"""


def multi_source(T: str) -> str:
    """:data:`MULTI_KERNELS` for ``T`` = ``"float"`` or ``"double"``."""
    return MULTI_KERNELS.replace("{T}", T)


#: name -> (inputs, outputs, CUDA body) of the one-target ElementwiseKernel
SOURCES = {
    "mpishard_adam_update": (
        "T g, float64 b1, float64 b2, float64 step, float64 ib2, float64 eps",
        "T p, T m, T v",
        "m = (T)b1 * m + (T)(1.0 - b1) * g; v = (T)b2 * v + (T)(1.0 - b2) * g * g;"
        " p -= (T)step * (m / (sqrt(v) * (T)ib2 + (T)eps));"),
}
#: name -> (inputs, outputs, map, reduce, post-map) of the one-target ReductionKernel
REDUCTIONS = {
    # a gradient's sum of squares in float64 (the clipping norm), no float64 copy
    "mpishard_sq_sum": ("T x", "float64 y", "(double)x * (double)x", "a + b", "y = a"),
}

"""GPU kernels: the elementwise chains as single CuPy kernels, the rest as the references.

A chain of NumPy-style operations on CuPy is one kernel launch per operation,
each reading and writing the whole array in device memory. The GELU, SwiGLU and
Adam chains here are each one ``cupy.ElementwiseKernel`` (compiled once per
dtype, on first use): one read of the inputs, one write of the outputs. Layer
norm and RMS norm are row reductions (``cupy.ReductionKernel``, one per
statistic) and one elementwise kernel each way: 3 launches for layer norm and 2
for RMS norm, forward and backward alike, where the reference takes about 10.
Attention's softmax is one ``cupy.RawKernel`` each way, a thread block per row
(scale, causal mask, max, exp, sum and normalise forward; the row dot product
and the product backward), where the reference takes 7 and 4 launches and a
mask array; plain row softmax runs as the reference.

On the CuPy-strict test module the same functions run the reference math inside
``strict.syncs.fused(name)``, so a test or ``benchmarks/syncs.py`` counts each
fused kernel as the one launch it is on a GPU. The CUDA bodies below are the
reference formulas, term for term; the GPU check compares them with NumPy.
"""
from __future__ import annotations

import numpy as np

from ..backend import xp_of
from . import reference
from .reference import GELU_C, GELU_K

__all__ = ["NAME", "gelu_forward", "gelu_backward", "layer_norm_forward",
           "layer_norm_backward", "rms_norm_forward", "rms_norm_backward", "swiglu_forward",
           "swiglu_backward", "softmax_rows", "causal_softmax", "softmax_backward",
           "adam_update"]

NAME = "gpu"

softmax_rows = reference.softmax_rows

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
    "mpishard_norm_apply": ("T x, T mu, T rstd, T w, T b", "T y, T h",
                            "h = (x - mu) * rstd; y = h * w + b;"),
    "mpishard_layer_norm_grad": ("T g, T w, T h, T mg, T mgh, T rstd", "T gx",
                                 "gx = rstd * (g * w - mg - h * mgh);"),
    "mpishard_rms_apply": ("T x, T rstd, T w", "T y, T h", "h = x * rstd; y = h * w;"),
    "mpishard_rms_norm_grad": ("T g, T w, T h, T mgh, T rstd", "T gx",
                               "gx = rstd * (g * w - h * mgh);"),
}
#: name -> (inputs, outputs, map, reduce, post-map) of each ReductionKernel (over rows)
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
#: a thread block per row of T: a sum or max over the block (warp shuffles, then the
#: warps' results), then the row's passes; ``{T}`` float or double
ROW_KERNELS = r"""
typedef {T} T;
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

extern "C" __global__ void mpishard_causal_softmax_{T}(T* a, const int n, const T scale) {
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
  for (int j = threadIdx.x; j < n; j += blockDim.x) r[j] = j < limit ? r[j] * inv : (T)0;
}

extern "C" __global__ void mpishard_softmax_backward_{T}(T* d, const T* p, const int n,
                                                        const T scale) {
  __shared__ T shared[32];
  const long long row = blockIdx.x;
  T* dr = d + row * n;
  const T* pr = p + row * n;
  T s = 0;
  for (int j = threadIdx.x; j < n; j += blockDim.x) s += dr[j] * pr[j];
  s = mpishard_block_reduce(s, false, shared);
  for (int j = threadIdx.x; j < n; j += blockDim.x) dr[j] = (dr[j] - s) * pr[j] * scale;
}
"""
ROW_THREADS = 256
_compiled: dict = {}


def _is_strict(xp) -> bool:
    return getattr(xp, "NAME", None) == "strict"


def _kernel(xp, name: str):
    """The compiled kernel ``name`` (CuPy caches the binaries per dtype)."""
    kernel = _compiled.get(name)
    if kernel is None:
        if name in SOURCES:
            inputs, outputs, body = SOURCES[name]
            kernel = xp.ElementwiseKernel(inputs, outputs, body, name)
        else:
            inputs, outputs, mapped, reduce, post = REDUCTIONS[name]
            kernel = xp.ReductionKernel(inputs, outputs, mapped, reduce, post, "0", name)
        _compiled[name] = kernel
    return kernel


def _row_kernel(xp, name: str, dtype):
    """The RawKernel ``name`` of :data:`ROW_KERNELS` for ``dtype`` (float32 or float64)."""
    T = "float" if dtype == "float32" else "double"
    key = f"{name}_{T}"
    kernel = _compiled.get(key)
    if kernel is None:
        kernel = _compiled[key] = xp.RawModule(code=ROW_KERNELS.replace("{T}", T)) \
            .get_function(key)
    return kernel


def causal_softmax(a, T: int, scale: float) -> None:
    xp = xp_of(a)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_causal_softmax"):
            reference.causal_softmax(a, T, scale)
        return
    if a.dtype.name not in ("float32", "float64") or not a.flags.c_contiguous:
        reference.causal_softmax(a, T, scale)
        return
    if a.shape[0] == 0:                   # no rows: no blocks to launch
        return
    _row_kernel(xp, "mpishard_causal_softmax", a.dtype.name)(
        (a.shape[0],), (ROW_THREADS,), (a, np.int32(T), a.dtype.type(scale)))


def softmax_backward(d, p, scale: float) -> None:
    xp = xp_of(d)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_softmax_backward"):
            reference.softmax_backward(d, p, scale)
        return
    if d.dtype != p.dtype or d.dtype.name not in ("float32", "float64") or not (
            d.flags.c_contiguous and p.flags.c_contiguous):
        reference.softmax_backward(d, p, scale)
        return
    if d.shape[0] == 0:
        return
    _row_kernel(xp, "mpishard_softmax_backward", d.dtype.name)(
        (d.shape[0],), (ROW_THREADS,), (d, p, np.int32(d.shape[1]), d.dtype.type(scale)))


def _ones_zeros(x, weight, bias):
    xp, n = xp_of(x), x.shape[1]
    return (weight if weight is not None else xp.ones(n, x.dtype),
            bias if bias is not None else xp.zeros(n, x.dtype))


def layer_norm_forward(x, weight, bias, eps: float):
    xp, inv_n = xp_of(x), 1.0 / max(x.shape[1], 1)
    if _is_strict(xp):              # the three kernels' math, one launch each
        with xp.syncs.fused("mpishard_row_mean"):
            mu = x.mean(axis=1)
        with xp.syncs.fused("mpishard_row_rstd"):
            c = x - mu[:, None]
            rstd = 1.0 / xp.sqrt((c * c).mean(axis=1) + eps)
        with xp.syncs.fused("mpishard_norm_apply"):
            h = c * rstd[:, None]
            y = h * weight if weight is not None else h.copy()
            if bias is not None:
                y = y + bias
        return y, h, rstd
    w, b = _ones_zeros(x, weight, bias)
    mu = _kernel(xp, "mpishard_row_mean")(x, inv_n, axis=1)
    rstd = _kernel(xp, "mpishard_row_rstd")(x, mu[:, None], inv_n, eps, axis=1)
    y, h = _kernel(xp, "mpishard_norm_apply")(x, mu[:, None], rstd[:, None], w, b)
    return y, h, rstd


def _norm_backward(g, xhat, rstd, weight, centred: bool):
    """Layer norm's input gradient (``centred``: 3 launches) or RMS norm's (2)."""
    xp, inv_n = xp_of(g), 1.0 / max(g.shape[1], 1)
    if _is_strict(xp):              # the kernels' math, one launch each
        with xp.syncs.fused("mpishard_row_mean_gwh"):
            gh = g * weight if weight is not None else g
            mgh = (gh * xhat).mean(axis=1)
        mg = 0.0
        if centred:
            with xp.syncs.fused("mpishard_row_mean_gw"):
                mg = gh.mean(axis=1)[:, None]
        with xp.syncs.fused("mpishard_layer_norm_grad" if centred
                            else "mpishard_rms_norm_grad"):
            return rstd[:, None] * (gh - mg - xhat * mgh[:, None])
    w, _ = _ones_zeros(g, weight, None)
    mgh = _kernel(xp, "mpishard_row_mean_gwh")(g, w, xhat, inv_n, axis=1)
    if not centred:
        return _kernel(xp, "mpishard_rms_norm_grad")(g, w, xhat, mgh[:, None], rstd[:, None])
    mg = _kernel(xp, "mpishard_row_mean_gw")(g, w, inv_n, axis=1)
    return _kernel(xp, "mpishard_layer_norm_grad")(g, w, xhat, mg[:, None], mgh[:, None],
                                                   rstd[:, None])


def layer_norm_backward(g, xhat, rstd, weight):
    return _norm_backward(g, xhat, rstd, weight, centred=True)


def rms_norm_forward(x, weight, eps: float):
    xp, inv_n = xp_of(x), 1.0 / max(x.shape[1], 1)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_row_rms_rstd"):
            rstd = 1.0 / xp.sqrt((x * x).mean(axis=1) + eps)
        with xp.syncs.fused("mpishard_rms_apply"):
            h = x * rstd[:, None]
            y = h * weight if weight is not None else h.copy()
        return y, h, rstd
    w, _ = _ones_zeros(x, weight, None)
    rstd = _kernel(xp, "mpishard_row_rms_rstd")(x, inv_n, eps, axis=1)
    y, h = _kernel(xp, "mpishard_rms_apply")(x, rstd[:, None], w)
    return y, h, rstd


def rms_norm_backward(g, xhat, rstd, weight):
    return _norm_backward(g, xhat, rstd, weight, centred=False)


def gelu_forward(a):
    xp = xp_of(a)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_gelu_forward"):
            return reference.gelu_forward(a)
    return _kernel(xp, "mpishard_gelu_forward")(a)


def gelu_backward(a, t, g):
    xp = xp_of(a)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_gelu_backward"):
            return reference.gelu_backward(a, t, g)
    return _kernel(xp, "mpishard_gelu_backward")(a, t, g)


def swiglu_forward(gate, up):
    xp = xp_of(gate)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_swiglu_forward"):
            return reference.swiglu_forward(gate, up)
    return _kernel(xp, "mpishard_swiglu_forward")(gate, up)


def swiglu_backward(gate, up, s, grad, need_gate: bool = True, need_up: bool = True):
    xp = xp_of(gate)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_swiglu_backward"):
            g_gate, g_up = reference.swiglu_backward(gate, up, s, grad)
    else:
        g_gate, g_up = _kernel(xp, "mpishard_swiglu_backward")(gate, up, s, grad)
    return (g_gate if need_gate else None), (g_up if need_up else None)


def adam_update(param, grad, m, v, beta1: float, beta2: float, step_size: float,
                inv_bias2: float, eps: float) -> None:
    xp = xp_of(param)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_adam_update"):
            reference.adam_update(param, grad, m, v, beta1, beta2, step_size, inv_bias2, eps)
        return
    _kernel(xp, "mpishard_adam_update")(grad, beta1, beta2, step_size, inv_bias2, eps,
                                        param, m, v)

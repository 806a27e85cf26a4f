"""GPU kernels: the elementwise chains as single CuPy kernels, the rest as the references.

A chain of NumPy-style operations on CuPy is one kernel launch per operation,
each reading and writing the whole array in device memory. The GELU, SwiGLU and
Adam chains here are each one ``cupy.ElementwiseKernel`` (compiled once per
dtype, on first use): one read of the inputs, one write of the outputs. Layer
norm and RMS norm are row reductions (``cupy.ReductionKernel``, one per
statistic) and one elementwise kernel each way: 3 launches for layer norm and 2
for RMS norm, forward and backward alike, where the reference takes about 10.
Softmax runs as the reference for now.

On the CuPy-strict test module the same functions run the reference math inside
``strict.syncs.fused(name)``, so a test or ``benchmarks/syncs.py`` counts each
fused kernel as the one launch it is on a GPU. The CUDA bodies below are the
reference formulas, term for term; the GPU check compares them with NumPy.
"""
from __future__ import annotations

from ..backend import xp_of
from . import reference
from .reference import GELU_C, GELU_K

__all__ = ["NAME", "gelu_forward", "gelu_backward", "layer_norm_forward",
           "layer_norm_backward", "rms_norm_forward", "rms_norm_backward", "swiglu_forward",
           "swiglu_backward", "softmax_rows", "adam_update"]

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
SOURCES.update({
    "mpishard_norm_apply": ("T x, T mu, T rstd, T w, T b", "T y, T h",
                            "h = (x - mu) * rstd; y = h * w + b;"),
    "mpishard_layer_norm_grad": ("T g, T w, T h, T mg, T mgh, T rstd", "T gx",
                                 "gx = rstd * (g * w - mg - h * mgh);"),
    "mpishard_rms_apply": ("T x, T rstd, T w", "T y, T h", "h = x * rstd; y = h * w;"),
    "mpishard_rms_norm_grad": ("T g, T w, T h, T mgh, T rstd", "T gx",
                               "gx = rstd * (g * w - h * mgh);"),
})
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


def layer_norm_backward(g, xhat, rstd, weight):
    xp, inv_n = xp_of(g), 1.0 / max(g.shape[1], 1)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_row_mean_gw"):
            gh = g * weight if weight is not None else g
            mg = gh.mean(axis=1)
        with xp.syncs.fused("mpishard_row_mean_gwh"):
            mgh = (gh * xhat).mean(axis=1)
        with xp.syncs.fused("mpishard_layer_norm_grad"):
            return rstd[:, None] * (gh - mg[:, None] - xhat * mgh[:, None])
    w, _ = _ones_zeros(g, weight, None)
    mg = _kernel(xp, "mpishard_row_mean_gw")(g, w, inv_n, axis=1)
    mgh = _kernel(xp, "mpishard_row_mean_gwh")(g, w, xhat, inv_n, axis=1)
    return _kernel(xp, "mpishard_layer_norm_grad")(g, w, xhat, mg[:, None], mgh[:, None],
                                                   rstd[:, None])


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
    xp, inv_n = xp_of(g), 1.0 / max(g.shape[1], 1)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_row_mean_gwh"):
            gh = g * weight if weight is not None else g
            mgh = (gh * xhat).mean(axis=1)
        with xp.syncs.fused("mpishard_rms_norm_grad"):
            return rstd[:, None] * (gh - xhat * mgh[:, None])
    w, _ = _ones_zeros(g, weight, None)
    mgh = _kernel(xp, "mpishard_row_mean_gwh")(g, w, xhat, inv_n, axis=1)
    return _kernel(xp, "mpishard_rms_norm_grad")(g, w, xhat, mgh[:, None], rstd[:, None])


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

"""Reference kernels: each fused op's math written plainly, on whole arrays.

These are what the tests compare the fast kernels against, and what
``MPISHARD_KERNELS=reference`` runs everywhere (the fallback when a kernel
misbehaves on a new machine). They work on any array module (NumPy, CuPy, the
strict module): inputs are 2-D row arrays (``(rows, width)``) in the compute
dtype (float32 or float64; the ops cast 16-bit inputs up before calling).
Every function returns fresh arrays except :func:`softmax_rows` and
:func:`adam_update`, which work in place as their callers need.
"""
from __future__ import annotations

import math

from ..backend import xp_of

__all__ = ["NAME", "gelu_forward", "gelu_backward", "layer_norm_forward",
           "layer_norm_backward", "rms_norm_forward", "rms_norm_backward", "swiglu_forward",
           "swiglu_backward", "softmax_rows", "causal_softmax", "softmax_backward",
           "adam_update"]

NAME = "reference"

GELU_C = math.sqrt(2.0 / math.pi)
GELU_K = 0.044715


def gelu_forward(a):
    """GELU, tanh approximation: ``(y, t)`` with ``t = tanh(c (a + k a^3))`` kept for
    backward and ``y = 0.5 a (1 + t)``."""
    xp = xp_of(a)
    t = xp.tanh(GELU_C * (a + GELU_K * a * a * a))
    return 0.5 * a * (1.0 + t), t


def gelu_backward(a, t, g):
    """``g * d gelu / da = g (0.5 (1 + t) + 0.5 a (1 - t^2) c (1 + 3k a^2))``."""
    return g * (0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * GELU_C
                * (1.0 + 3.0 * GELU_K * a * a))


def layer_norm_forward(x, weight, bias, eps: float):
    """``(y, xhat, rstd)``: ``xhat = (x - mean) / sqrt(var + eps)`` per row,
    ``y = xhat * weight + bias`` (either may be None)."""
    xp = xp_of(x)
    centred = x - x.mean(axis=1, keepdims=True)
    rstd = 1.0 / xp.sqrt((centred * centred).mean(axis=1) + eps)
    xhat = centred * rstd[:, None]
    y = xhat * weight if weight is not None else xhat.copy()
    if bias is not None:
        y = y + bias
    return y, xhat, rstd


def layer_norm_backward(g, xhat, rstd, weight):
    """The input's gradient of :func:`layer_norm_forward` for output gradient ``g``."""
    gh = g * weight if weight is not None else g
    return rstd[:, None] * (gh - gh.mean(axis=1, keepdims=True)
                            - xhat * (gh * xhat).mean(axis=1, keepdims=True))


def rms_norm_forward(x, weight, eps: float):
    """``(y, xhat, rstd)``: ``xhat = x / sqrt(mean(x^2) + eps)``, ``y = xhat * weight``."""
    xp = xp_of(x)
    rstd = 1.0 / xp.sqrt((x * x).mean(axis=1) + eps)
    xhat = x * rstd[:, None]
    return (xhat * weight if weight is not None else xhat.copy()), xhat, rstd


def rms_norm_backward(g, xhat, rstd, weight):
    """The input's gradient of :func:`rms_norm_forward` for output gradient ``g``."""
    gh = g * weight if weight is not None else g
    return rstd[:, None] * (gh - xhat * (gh * xhat).mean(axis=1, keepdims=True))


def swiglu_forward(gate, up):
    """``(y, s)``: ``s = sigmoid(gate)`` kept for backward, ``y = gate s up``."""
    xp = xp_of(gate)
    s = 1.0 / (1.0 + xp.exp(-gate))
    return gate * s * up, s


def swiglu_backward(gate, up, s, grad, need_gate: bool = True, need_up: bool = True):
    """``(d gate, d up)`` of :func:`swiglu_forward` (None where not needed)."""
    g_up = grad * gate * s if need_up else None
    g_gate = grad * up * s * (1.0 + gate * (1.0 - s)) if need_gate else None
    return g_gate, g_up


def softmax_rows(a) -> None:
    """Row-wise softmax of a 2-D array, in place (max-subtracted for stability)."""
    xp = xp_of(a)
    a -= a.max(axis=1, keepdims=True)
    xp.exp(a, out=a)
    a /= a.sum(axis=1, keepdims=True)


def causal_bias(T: int, xp, dtype):
    """``(T, T)``: 0 on and below the diagonal, -inf above (a query sees no later key)."""
    return xp.triu(xp.full((T, T), -float("inf"), dtype=dtype), 1)


def scale_and_mask(a, T: int, scale: float) -> None:
    """In place: scores ``a`` (``(n T, T)``, row ``r`` those of query ``r % T``) times
    ``scale``, keys after the query set to -inf."""
    if scale != 1.0:
        a *= scale
    rows = a.reshape(-1, T, T)
    rows += causal_bias(T, xp_of(a), a.dtype)


def causal_softmax(a, T: int, scale: float) -> None:
    """Attention weights in place: :func:`scale_and_mask`, then softmax over each row."""
    scale_and_mask(a, T, scale)
    softmax_rows(a)


def softmax_backward(d, p, scale: float) -> None:
    """In place: ``d`` (the weights' gradient) becomes the scores' gradient,
    ``(d - rowdot(d, p)) p scale`` for softmax weights ``p`` of scaled scores."""
    d -= (d * p).sum(axis=1, keepdims=True)
    d *= p
    if scale != 1.0:
        d *= scale


def adam_update(param, grad, m, v, beta1: float, beta2: float, step_size: float,
                inv_bias2: float, eps: float) -> None:
    """One Adam step in place: ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
    ``param -= step_size m / (sqrt(v) inv_bias2 + eps)`` (``step_size`` is
    ``lr / (1 - b1^t)``, ``inv_bias2`` is ``1 / sqrt(1 - b2^t)``)."""
    xp = xp_of(param)
    m *= beta1
    m += (1.0 - beta1) * grad
    v *= beta2
    v += (1.0 - beta2) * grad * grad
    param -= step_size * (m / (xp.sqrt(v) * inv_bias2 + eps))

"""Reference kernels: each fused op's math written plainly, on whole arrays.

A kernel set (:class:`~mpishard.kernels.protocol.KernelSet`, where each kernel's
contract is written): the one the tests compare the fast kernels against, and
what ``MPISHARD_KERNELS=reference`` runs everywhere (the fallback when a kernel
misbehaves on a new machine). These work on any array module (NumPy, CuPy, the
strict module). Beside the kernels, the pieces the CPU and GPU sets build on:
GELU's constants, :func:`up32`, :func:`apply_dropout`, :func:`causal_bias`,
:func:`scale_and_mask` and :func:`multi_adam`.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from mpishard.core.backend import xp_of
from mpishard.kernels.protocol import KERNEL_NAMES
from mpishard.kernels.rows import col_sum

__all__ = ["NAME", "NATIVE_FLOAT16", *KERNEL_NAMES]

NAME = "reference"
NATIVE_FLOAT16 = False

GELU_C = math.sqrt(2.0 / math.pi)
GELU_K = 0.044715


def gelu_forward(a, bias=None):
    xp = xp_of(a)
    if bias is not None:
        a = a + bias
    t = xp.tanh(GELU_C * (a + GELU_K * a * a * a))
    return 0.5 * a * (1.0 + t), t


def gelu_backward(a, t, g):
    return g * (0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * GELU_C
                * (1.0 + 3.0 * GELU_K * a * a))


def bias_gelu_backward(a, bias, t, g, out_bias=None):
    gx = gelu_backward(a + bias, t, g)
    return gx, col_sum(gx, out_bias)


def gelu16_forward(a, bias=None):
    y, t = gelu_forward(up32(a), up32(bias))
    return y.astype(a.dtype), t


def gelu16_grad32(a, bias, t, g):
    """The float32 gradient of :func:`gelu16_forward`'s ``a`` (and of ``a + bias``)."""
    x = up32(a) if bias is None else up32(a) + up32(bias)
    return gelu_backward(x, t, up32(g))


def gelu16_backward(a, bias, t, g, need_bias: bool, out_bias=None):
    gx = gelu16_grad32(a, bias, t, g)
    return gx.astype(a.dtype), (col_sum(gx, out_bias) if need_bias else None)


def up32(a):
    """``a`` in float32 if it is 16-bit, else ``a`` itself (None stays None)."""
    return a if a is None or a.dtype.itemsize >= 4 else a.astype(np.float32)


def layer_norm_forward(x, weight, bias, eps: float):
    xp = xp_of(x)
    centred = x - x.mean(axis=1, keepdims=True)
    rstd = 1.0 / xp.sqrt((centred * centred).mean(axis=1) + eps)
    xhat = centred * rstd[:, None]
    y = xhat * weight if weight is not None else xhat.copy()
    if bias is not None:
        y = y + bias
    return y, xhat, rstd


def _added(gx, into):
    """``gx``, or ``into`` with ``gx`` added (the input's gradient so far, see the norms)."""
    if into is None:
        return gx
    into += gx
    return into


def layer_norm_backward(g, xhat, rstd, weight, into=None):
    gh = g * weight if weight is not None else g
    return _added(rstd[:, None] * (gh - gh.mean(axis=1, keepdims=True)
                                   - xhat * (gh * xhat).mean(axis=1, keepdims=True)), into)


def rms_norm_forward(x, weight, eps: float):
    xp = xp_of(x)
    rstd = 1.0 / xp.sqrt((x * x).mean(axis=1) + eps)
    xhat = x * rstd[:, None]
    return (xhat * weight if weight is not None else xhat.copy()), xhat, rstd


def rms_norm_backward(g, xhat, rstd, weight, into=None):
    gh = g * weight if weight is not None else g
    return _added(rstd[:, None] * (gh - xhat * (gh * xhat).mean(axis=1, keepdims=True)), into)


def norm_param_grads(g, xhat, need_weight: bool, need_bias: bool, out_weight=None,
                     out_bias=None):
    gw = (g * xhat).sum(axis=0, out=out_weight) if need_weight else None
    gb = g.sum(axis=0, out=out_bias) if need_bias else None
    return gw, gb


def _sigmoid(gate):
    return 1.0 / (1.0 + xp_of(gate).exp(-gate))


def swiglu_forward(gate, up):
    return gate * _sigmoid(gate) * up


def swiglu_backward(gate, up, grad, need_gate: bool = True, need_up: bool = True):
    s = _sigmoid(gate)
    g_up = grad * gate * s if need_up else None
    g_gate = grad * up * s * (1.0 + gate * (1.0 - s)) if need_gate else None
    return g_gate, g_up


def apply_dropout(y, u, p: float, out=None):
    """``where(u >= p, y / (1 - p), 0)`` into ``out`` (default a fresh array; ``y`` itself
    works): ``y`` times the kept mask, then times ``1 / (1 - p)`` rounded to y's dtype,
    the model's ``y * mask`` bit for bit (see dropout in :mod:`.protocol`)."""
    out = xp_of(y).multiply(y, u >= p, out=out)
    out *= y.dtype.type(1.0 / (1.0 - p))
    return out


def dropout_add(x, y, u, p: float, bias=None):
    if bias is not None:
        y = y + bias
    out = apply_dropout(y, u, p) if u is not None else (y if bias is not None else y.copy())
    if x is not None:
        out += x
    return out


def dropout_backward(g, u, p: float):
    return apply_dropout(g, u, p)


def bias_dropout_backward(g, u, p: float, out_bias=None):
    gy = g if u is None else apply_dropout(g, u, p)
    return gy, col_sum(gy, out_bias)


def softmax_rows(a) -> None:
    xp = xp_of(a)
    a -= a.max(axis=1, keepdims=True)
    xp.exp(a, out=a)
    a /= a.sum(axis=1, keepdims=True)


def causal_bias(T: int, xp, dtype):
    """``(T, T)``: 0 on and below the diagonal, -inf above (a query sees no later key).

    NumPy's is made once per ``(T, dtype)`` and handed out read-only: attention adds it
    to every sequence's scores, and building it (a fill and a ``triu``) cost more than
    the add itself. Other array modules build it afresh (a device's memory, and the
    strict module's launch count, stay as they were)."""
    if xp is np:
        return _numpy_causal_bias(T, np.dtype(dtype))
    return xp.triu(xp.full((T, T), -float("inf"), dtype=dtype), 1)


@functools.lru_cache(maxsize=16)
def _numpy_causal_bias(T: int, dtype: np.dtype):
    bias = np.triu(np.full((T, T), -float("inf"), dtype=dtype), 1)
    bias.setflags(write=False)
    return bias


def scale_and_mask(a, T: int, scale: float) -> None:
    """In place: scores ``a`` (``(n T, T)``, row ``r`` those of query ``r % T``) times
    ``scale``, keys after the query set to -inf."""
    if scale != 1.0:
        a *= scale
    rows = a.reshape(-1, T, T)
    rows += causal_bias(T, xp_of(a), a.dtype)


def causal_softmax(a, T: int, scale: float, drop_u=None, drop_p: float = 0.0, dropped=None):
    scale_and_mask(a, T, scale)
    softmax_rows(a)
    if drop_u is None:
        return None
    return apply_dropout(a, drop_u, drop_p, out=dropped)


def softmax_backward(d, p, scale: float, drop_u=None, drop_p: float = 0.0,
                     dropped=None) -> None:
    if drop_u is not None:
        if dropped is not None:
            apply_dropout(p, drop_u, drop_p, out=dropped)
        apply_dropout(d, drop_u, drop_p, out=d)
    d -= (d * p).sum(axis=1, keepdims=True)
    d *= p
    if scale != 1.0:
        d *= scale


def unpack_heads(h, need_sum: bool = False, out_sum=None, dtype=None):
    _, B, nh, T, hs = h.shape
    rows = xp_of(h).empty((B, T, 3, nh, hs), dtype=h.dtype if dtype is None else dtype)
    rows[...] = h.transpose(1, 3, 0, 2, 4)
    rows = rows.reshape(B * T, 3 * nh * hs)
    return rows, (col_sum(rows, out_sum) if need_sum else None)


def adam_update(param, grad, m, v, beta1: float, beta2: float, step_size: float,
                inv_bias2: float, eps: float) -> None:
    xp = xp_of(param)
    m *= beta1
    m += (1.0 - beta1) * grad
    v *= beta2
    v += (1.0 - beta2) * grad * grad
    param -= step_size * (m / (xp.sqrt(v) * inv_bias2 + eps))


def step_scalars(step_size, inv_bias2, grad_scale, skip) -> tuple:
    """A step's scalars as Python numbers: 0-d arrays (a step decided on a device, see
    :meth:`.KernelSet.multi_adam_update`) read (free on the host, a sync each on a
    device), ``skip`` ``None`` as ``False``."""
    def value(x):
        return x.item() if hasattr(x, "shape") else x
    return (value(step_size), value(inv_bias2), value(grad_scale),
            bool(value(skip)) if skip is not None else False)


def multi_adam(adam_update):
    """The multi-tensor Adam step of a one-target ``adam_update`` (a kernel set's),
    target by target (see :meth:`.KernelSet.multi_adam_update`)."""
    def multi_adam_update(targets, beta1: float, beta2: float, step_size, inv_bias2,
                          eps: float, grad_scale=1.0, decay: float = 1.0,
                          skip=None) -> None:
        step_size, inv_bias2, grad_scale, skipped = step_scalars(step_size, inv_bias2,
                                                                 grad_scale, skip)
        if skipped:
            return
        for param, grad, m, v, ranges in targets:
            if grad_scale != 1.0:
                grad = grad * grad_scale
            if decay != 1.0:
                for start, stop in ranges:
                    view = param[start:stop]
                    view *= decay
            adam_update(param, grad, m, v, beta1, beta2, step_size, inv_bias2, eps)
    return multi_adam_update


multi_adam_update = multi_adam(adam_update)


def multi_sq_sum(arrays, out):
    for i, a in enumerate(arrays):
        sq_sum(a, out[i:i + 1])        # a view (an index is a copy on the strict module)
    return out


def sq_sum(x, out):
    flat = x.reshape(-1)
    if flat.dtype != np.float64:
        flat = flat.astype(np.float64)
    out[...] = xp_of(x).dot(flat, flat)
    return out


def flash_attention_forward(hm, scale: float):
    xp = xp_of(hm)
    q, k, v = (up32(hm[i]) for i in range(3))
    T = q.shape[-2]
    if T == 0:
        return xp.empty(hm.shape[1:], dtype=hm.dtype), xp.empty(hm.shape[1:-1], dtype=q.dtype)
    s = xp.matmul(q * q.dtype.type(scale), k.swapaxes(-1, -2))       # (B, heads, T, T)
    s += causal_bias(T, xp, s.dtype)
    m = s.max(axis=-1, keepdims=True)
    s -= m
    xp.exp(s, out=s)
    total = s.sum(axis=-1, keepdims=True)
    y = xp.matmul(s / total, v)
    return y.astype(hm.dtype), (m + xp.log(total))[..., 0]


def flash_attention_backward(hm, y, gy, lse, scale: float):
    xp = xp_of(hm)
    q, k, v = (up32(hm[i]) for i in range(3))
    g, yy = up32(gy), up32(y)
    T, sc = q.shape[-2], q.dtype.type(scale)
    if T == 0:
        return xp.empty(hm.shape, dtype=hm.dtype)
    s = xp.matmul(q * sc, k.swapaxes(-1, -2))
    s += causal_bias(T, xp, s.dtype)
    s -= lse[..., None]
    p = xp.exp(s, out=s)                                              # the weights again
    ds = xp.matmul(g, v.swapaxes(-1, -2))
    ds -= (g * yy).sum(axis=-1, keepdims=True)
    ds *= p
    dh = xp.empty(hm.shape, dtype=hm.dtype)
    dh[0] = xp.matmul(ds, k) * sc
    dh[1] = xp.matmul(ds.swapaxes(-1, -2), q) * sc
    dh[2] = xp.matmul(p.swapaxes(-1, -2), g)
    return dh


def cross_entropy_forward(logits, targets, ignore_index: int):
    xp = xp_of(logits)
    x = up32(logits)
    valid = targets != ignore_index
    safe_t = xp.where(valid, targets, 0)
    row_max = x.max(axis=1)
    shifted = x - row_max[:, None]
    row_sum = xp.exp(shifted).sum(axis=1)
    per_row = xp.log(row_sum) - shifted[xp.arange(x.shape[0]), safe_t]
    count = xp.asarray(valid.sum(dtype=x.dtype))
    with np.errstate(invalid="ignore"):                     # no row counted: 0 / 0 = nan
        loss = (per_row * valid).sum() / count
    return xp.asarray(loss, dtype=x.dtype), row_max, row_sum, count


def cross_entropy_backward(logits, targets, ignore_index: int, row_max, row_sum, count, g):
    xp = xp_of(logits)
    valid = targets != ignore_index
    p = xp.exp(up32(logits) - row_max[:, None]) / row_sum[:, None]          # softmax
    p[xp.arange(p.shape[0]), xp.where(valid, targets, 0)] -= 1.0
    p *= (valid * (g / xp.maximum(count, 1)))[:, None]
    return p.astype(logits.dtype)

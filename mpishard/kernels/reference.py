"""Reference kernels: each fused op's math written plainly, on whole arrays.

These are what the tests compare the fast kernels against, and what
``MPISHARD_KERNELS=reference`` runs everywhere (the fallback when a kernel
misbehaves on a new machine). They work on any array module (NumPy, CuPy, the
strict module): inputs are 2-D row arrays (``(rows, width)``) in the compute
dtype (float32 or float64; the ops cast 16-bit inputs up before calling).
Every function returns fresh arrays except :func:`softmax_rows`,
:func:`causal_softmax`, :func:`softmax_backward` and :func:`adam_update`, which
work in place as their callers need, and :func:`norm_param_grads`, which writes
into the gradient buckets it is given.

Dropout takes its uniform draws ``u`` (float32, in [0, 1), drawn by the caller
from its seeded generator) and keeps the elements with ``u >= p`` (NumPy, and the
GPU kernels, compare a float32 array with a Python float in float32), scaled by
``1 / (1 - p)`` rounded to the data's dtype: bit for bit the ``data * mask`` the
models computed with a mask array. Dropout's data may be of any shape, 16-bit too.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from mpishard.core.backend import xp_of
from mpishard.kernels.rows import col_sum

__all__ = ["NAME", "gelu_forward", "gelu_backward", "layer_norm_forward",
           "layer_norm_backward", "rms_norm_forward", "rms_norm_backward", "norm_param_grads",
           "swiglu_forward", "swiglu_backward", "dropout_add", "dropout_backward",
           "bias_gelu_backward", "bias_dropout_backward",
           "softmax_rows", "causal_softmax", "softmax_backward", "unpack_heads",
           "adam_update", "sq_sum",
           "gelu16_forward", "gelu16_backward",
           "flash_attention_forward", "flash_attention_backward",
           "multi_adam_update", "multi_sq_sum"]

NAME = "reference"

GELU_C = math.sqrt(2.0 / math.pi)
GELU_K = 0.044715


def gelu_forward(a, bias=None):
    """GELU, tanh approximation: ``(y, t)`` with ``t = tanh(c (a + k a^3))`` kept for
    backward and ``y = 0.5 a (1 + t)``; with ``bias`` (a row of ``a``'s width), of
    ``a + bias`` (a linear layer's output and its bias, added here)."""
    xp = xp_of(a)
    if bias is not None:
        a = a + bias
    t = xp.tanh(GELU_C * (a + GELU_K * a * a * a))
    return 0.5 * a * (1.0 + t), t


def gelu_backward(a, t, g):
    """``g * d gelu / da = g (0.5 (1 + t) + 0.5 a (1 - t^2) c (1 + 3k a^2))``."""
    return g * (0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * GELU_C
                * (1.0 + 3.0 * GELU_K * a * a))


def bias_gelu_backward(a, bias, t, g, out_bias=None):
    """``(gx, gb)`` of :func:`gelu_forward` with ``bias``: the gradient of ``a`` (and of
    ``a + bias``) and its column sums, the bias's gradient (into ``out_bias`` if given)."""
    gx = gelu_backward(a + bias, t, g)
    return gx, col_sum(gx, out_bias)


def gelu16_forward(a, bias=None):
    """:func:`gelu_forward` of 16-bit rows ``a`` (and ``bias``), computed in float32:
    ``(y, t)``, ``y`` in a's dtype, ``t`` float32."""
    y, t = gelu_forward(up32(a), up32(bias))
    return y.astype(a.dtype), t


def gelu16_grad32(a, bias, t, g):
    """The float32 gradient of :func:`gelu16_forward`'s ``a`` (and of ``a + bias``)."""
    x = up32(a) if bias is None else up32(a) + up32(bias)
    return gelu_backward(x, t, up32(g))


def gelu16_backward(a, bias, t, g, need_bias: bool, out_bias=None):
    """``(gx, gb)`` of :func:`gelu16_forward`: the 16-bit gradient of ``a`` computed in
    float32 from the float32 ``t``, and with ``need_bias`` the bias's gradient, the
    column sums of the float32 gradient (into ``out_bias`` if given; else None)."""
    gx = gelu16_grad32(a, bias, t, g)
    return gx.astype(a.dtype), (col_sum(gx, out_bias) if need_bias else None)


def up32(a):
    """``a`` in float32 if it is 16-bit, else ``a`` itself (None stays None)."""
    return a if a is None or a.dtype.itemsize >= 4 else a.astype(np.float32)


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


def _added(gx, into):
    """``gx``, or ``into`` with ``gx`` added (the input's gradient so far, see the norms)."""
    if into is None:
        return gx
    into += gx
    return into


def layer_norm_backward(g, xhat, rstd, weight, into=None):
    """The input's gradient of :func:`layer_norm_forward` for output gradient ``g``;
    with ``into`` (the input's gradient so far, ``g``'s shape and dtype) added into
    it, and ``into`` returned."""
    gh = g * weight if weight is not None else g
    return _added(rstd[:, None] * (gh - gh.mean(axis=1, keepdims=True)
                                   - xhat * (gh * xhat).mean(axis=1, keepdims=True)), into)


def rms_norm_forward(x, weight, eps: float):
    """``(y, xhat, rstd)``: ``xhat = x / sqrt(mean(x^2) + eps)``, ``y = xhat * weight``."""
    xp = xp_of(x)
    rstd = 1.0 / xp.sqrt((x * x).mean(axis=1) + eps)
    xhat = x * rstd[:, None]
    return (xhat * weight if weight is not None else xhat.copy()), xhat, rstd


def rms_norm_backward(g, xhat, rstd, weight, into=None):
    """The input's gradient of :func:`rms_norm_forward` for output gradient ``g`` (``into``
    as for :func:`layer_norm_backward`)."""
    gh = g * weight if weight is not None else g
    return _added(rstd[:, None] * (gh - xhat * (gh * xhat).mean(axis=1, keepdims=True)), into)


def norm_param_grads(g, xhat, need_weight: bool, need_bias: bool, out_weight=None,
                     out_bias=None):
    """``(gw, gb)``, the weight's and bias's gradients of either norm: the column sums of
    ``g * xhat`` and of ``g`` (None where not needed), written into ``out_weight`` /
    ``out_bias`` (``(C,)``, g's dtype: gradient buckets' views) when given."""
    gw = (g * xhat).sum(axis=0, out=out_weight) if need_weight else None
    gb = g.sum(axis=0, out=out_bias) if need_bias else None
    return gw, gb


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


def apply_dropout(y, u, p: float, out=None):
    """``where(u >= p, y / (1 - p), 0)`` into ``out`` (default a fresh array; ``y`` itself
    works): ``y`` times the kept mask, then times ``1 / (1 - p)`` rounded to y's dtype,
    the model's ``y * mask`` bit for bit (see the module docstring)."""
    out = xp_of(y).multiply(y, u >= p, out=out)
    out *= y.dtype.type(1.0 / (1.0 - p))
    return out


def dropout_add(x, y, u, p: float, bias=None):
    """``x + dropout(y)`` (a residual add; ``x`` None: the dropout alone), in y's dtype;
    with ``bias``, of ``y + bias`` (a linear layer's output and its bias, added here);
    ``u`` None: no dropout (``x + y + bias``)."""
    if bias is not None:
        y = y + bias
    out = apply_dropout(y, u, p) if u is not None else (y if bias is not None else y.copy())
    if x is not None:
        out += x
    return out


def dropout_backward(g, u, p: float):
    """The gradient through dropout: ``where(u >= p, g / (1 - p), 0)``, same draws ``u``."""
    return apply_dropout(g, u, p)


def bias_dropout_backward(g, u, p: float, out_bias=None):
    """``(gy, gb)`` of :func:`dropout_add` with a bias: the gradient through the dropout
    (``g`` itself when ``u`` is None) and its column sums, the bias's gradient (float32
    at least, into ``out_bias`` if given)."""
    gy = g if u is None else apply_dropout(g, u, p)
    return gy, col_sum(gy, out_bias)


def softmax_rows(a) -> None:
    """Row-wise softmax of a 2-D array, in place (max-subtracted for stability)."""
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
    """Attention weights in place: :func:`scale_and_mask`, then softmax over each row.

    With dropout draws ``drop_u`` (float32, a's shape) also the dropped weights,
    ``where(drop_u >= drop_p, a / (1 - drop_p), 0)``, into ``dropped`` (default a fresh
    array), which is returned (None without ``drop_u``)."""
    scale_and_mask(a, T, scale)
    softmax_rows(a)
    if drop_u is None:
        return None
    return apply_dropout(a, drop_u, drop_p, out=dropped)


def softmax_backward(d, p, scale: float, drop_u=None, drop_p: float = 0.0,
                     dropped=None) -> None:
    """In place: ``d`` (the weights' gradient) becomes the scores' gradient,
    ``(d - rowdot(d, p)) p scale`` for softmax weights ``p`` of scaled scores; with the
    forward's dropout draws ``drop_u``, ``d`` (the dropped weights' gradient) first
    goes back through the dropout, and with ``dropped`` (p's shape and dtype, not p)
    the dropped weights, ``causal_softmax``'s ``dropped`` again, are written there on
    the way (the values' gradient needs them; on a GPU no launch of their own)."""
    if drop_u is not None:
        if dropped is not None:
            apply_dropout(p, drop_u, drop_p, out=dropped)
        apply_dropout(d, drop_u, drop_p, out=d)
    d -= (d * p).sum(axis=1, keepdims=True)
    d *= p
    if scale != 1.0:
        d *= scale


def unpack_heads(h, need_sum: bool = False, out_sum=None, dtype=None):
    """``(rows, sums)``: attention's head-major ``(3, B, nh, T, hs)`` q, k and v gradients
    as packed ``(B*T, 3*nh*hs)`` rows (column ``(w*nh + head)*hs + j``) in ``dtype``
    (default h's), and with ``need_sum`` their column sums, c_attn's bias gradient (as
    :func:`.rows.col_sum`: 16-bit summed in float32, into ``out_sum`` if given), else
    None."""
    _, B, nh, T, hs = h.shape
    rows = xp_of(h).empty((B, T, 3, nh, hs), dtype=h.dtype if dtype is None else dtype)
    rows[...] = h.transpose(1, 3, 0, 2, 4)
    rows = rows.reshape(B * T, 3 * nh * hs)
    return rows, (col_sum(rows, out_sum) if need_sum else None)


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


def multi_adam(adam_update):
    """The multi-tensor Adam step of a one-target ``adam_update`` (a kernel set's),
    target by target (see :func:`multi_adam_update`)."""
    def multi_adam_update(targets, beta1: float, beta2: float, step_size: float,
                          inv_bias2: float, eps: float, grad_scale: float = 1.0,
                          decay: float = 1.0) -> None:
        """One AdamW step over many flat targets ``(param, grad, m, v, decay_ranges)``:
        each gradient times ``grad_scale`` (the loss scale's and the clipping's factor),
        each param's decay ranges times ``decay`` (decoupled weight decay, in place on
        the views), then the Adam update (a GPU does all targets in one launch)."""
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
    """``out[i]`` (float64) = the sum of squares of ``arrays[i]``, for every i (a GPU
    does all arrays in two launches); returns ``out``."""
    for i, a in enumerate(arrays):
        sq_sum(a, out[i:i + 1])        # a view (an index is a copy on the strict module)
    return out


def sq_sum(x, out):
    """``out`` (a float64 array of one element, e.g. a slice of a larger one) = the sum
    of ``x``'s squares, in float64 (the gradient clipping's norm); returns ``out``."""
    flat = x.reshape(-1)
    if flat.dtype != np.float64:
        flat = flat.astype(np.float64)
    out[...] = xp_of(x).dot(flat, flat)
    return out


def flash_attention_forward(hm, scale: float):
    """Causal attention of head-major ``hm`` (``(3, B, heads, T, hs)``: q, k, v) as the
    fused kernels compute it: ``(y, lse)``, the output ``(B, heads, T, hs)`` in hm's
    dtype and each query row's log-sum-exp of its scaled, masked scores (float32 for
    16-bit rows), all that backward keeps. Here the ``T x T`` scores are made whole;
    the GPU's kernels walk them a tile at a time (mpishard/kernels/cuda/attention_src.py)."""
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
    """The gradients of :func:`flash_attention_forward`'s q, k and v, head-major
    ``(3, B, heads, T, hs)`` in hm's dtype, from its output ``y``, the output's gradient
    ``gy`` (``(B, heads, T, hs)``) and ``lse``: the weights recomputed as
    ``exp(s - lse)``, ``D = rowsum(gy y)``, ``ds = p (gy v^T - D)``, ``dq = scale ds k``,
    ``dk = scale ds^T q``, ``dv = p^T gy``."""
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

"""Reference kernels: each fused op's math written plainly, on whole arrays.

A kernel set (:class:`~mpishard.kernels.protocol.KernelSet`, where each kernel's
contract is written): the one the tests compare the fast kernels against, and
what ``MPISHARD_KERNELS=reference`` runs everywhere (the fallback when a kernel
misbehaves on a new machine). These work on any array module (NumPy, CuPy, the
strict module). Beside the kernels, the pieces the CPU and GPU sets build on:
GELU's constants, :func:`up32`, :func:`apply_dropout`, :func:`causal_bias`,
:func:`scale_and_mask`, :func:`multi_adam` and the rotary embeddings' pieces
(:func:`rotary_tables`, :func:`head_tables`, :func:`rotate`, :func:`even_groups`,
:func:`heads_sum`, :func:`pack_heads`, and :func:`rotate_packed` /
:func:`rotate_packed_back`, which the CPU set runs in NumPy's layout).
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


def _as(a, dtype):
    """``a`` in ``dtype`` (itself when it already is)."""
    return a if a.dtype == dtype else a.astype(dtype)


def rotary_tables(cos, sin, dtype) -> tuple:
    """``(c, signed)``: the rotation tables ``(T, hs)`` in ``dtype`` (fresh arrays),
    ``signed`` ``sin`` with its first half negated (the sign of ``rotate_half``)."""
    c, signed = cos.astype(dtype), sin.astype(dtype)
    signed[..., :signed.shape[-1] // 2] *= -1
    return c, signed


def head_tables(c, signed, n_heads: int) -> tuple:
    """:func:`rotary_tables`' pair as ``(T, n_heads, hs)`` contiguous copies: on NumPy
    :func:`rotate`'s passes then run over whole sequences instead of 32-wide half rows
    (2.4x faster on the 64-wide heads measured). A device broadcasts ``(T, 1, hs)``."""
    xp = xp_of(c)
    T, hs = c.shape
    return tuple(xp.broadcast_to(a[:, None, :], (T, n_heads, hs)).copy() for a in (c, signed))


def rotate(x, tables, out, inverse: bool = False):
    """``out = x c + swap(x) signed`` for ``x`` ``(B, T, H, hs)`` and ``tables`` ``(c,
    signed)`` that broadcast over a sequence's heads (``(T, 1 or H, hs)``), into ``out``;
    with ``inverse``, ``x c - swap(x) signed``, the transpose (a rotation by ``-angle``)
    for backward. ``swap`` exchanges the halves: ``rotate_half(x) sin`` is ``swap(x)
    signed``. On NumPy one sequence at a time, to stay in cache (see [Note: cache
    blocking] in mpishard/kernels/cpu/threads.py)."""
    c, signed = tables
    xp = xp_of(x)
    h = x.shape[-1] // 2
    step = 1 if xp is np else x.shape[0]
    for b in range(0, x.shape[0], step):
        xb, ob = x[b:b + step], out[b:b + step]
        xp.multiply(xb, c, out=ob)
        swapped = xp.concatenate([xb[..., h:], xb[..., :h]], axis=-1)
        swapped *= signed
        if inverse:
            ob -= swapped
        else:
            ob += swapped
    return out


def even_groups(heads, n_kv: int):
    """``(first, g)`` where query head ``j`` reads key/value head ``first + j // g`` (the
    usual grouped-query layout, on a tensor-parallel rank too), else None."""
    H, used = len(heads), len(set(heads.tolist()))
    if not H or H % used:
        return None
    g, first = H // used, int(heads[0])
    if first + used > n_kv or heads.tolist() != [first + j // g for j in range(H)]:
        return None
    return first, g


def heads_sum(d, heads, n_kv: int, by_group: bool = True):
    """``(B, T, n_kv, hs)``: key/value head ``i`` the sum of ``d``'s query heads that read
    it (``heads[j] == i``), added in their order; zero for a head none reads. Even groups
    (:func:`even_groups`) add a group member at a time (a launch each on a device), else
    (or without ``by_group``: NumPy's faster way) a query head at a time: the same adds
    in the same order."""
    xp = xp_of(d)
    B, T, H, hs = d.shape
    groups = even_groups(heads, n_kv) if by_group else None
    if groups is not None:
        first, g = groups
        split = d.reshape(B, T, H // g, g, hs)
        out = xp.zeros((B, T, n_kv, hs), dtype=d.dtype) if H // g < n_kv else \
            xp.empty((B, T, n_kv, hs), dtype=d.dtype)
        mine = out[:, :, first:first + H // g]
        mine[...] = split[:, :, :, 0]
        for j in range(1, g):
            mine += split[:, :, :, j]
        return out
    out = xp.empty((B, T, n_kv, hs), dtype=d.dtype)
    used, starts = np.unique(heads, return_index=True)
    for kv in sorted(set(range(n_kv)) - set(used.tolist())):
        out[:, :, kv] = 0
    for kv, lo, hi in zip(used.tolist(), starts.tolist(), [*starts[1:].tolist(), H]):
        o = out[:, :, kv]                            # pairwise adds: 3.7x a strided sum
        o[...] = d[:, :, lo]
        for j in range(lo + 1, hi):
            o += d[:, :, j]
    return out


def pack_heads(packed, k_rot, v, heads, by_group: bool = True) -> None:
    """Key/value head ``heads[j]`` of ``k_rot`` and ``v`` into ``packed[:, :, 1 and 2,
    j]``: with even groups one copy each (a view of ``packed`` by group member), else (or
    without ``by_group``: NumPy's faster way) a copy per query head."""
    B, T, _, H, hs = packed.shape
    groups = even_groups(heads, k_rot.shape[2]) if by_group else None
    if groups is not None:
        first, g = groups
        split = packed.reshape(B, T, 3, H // g, g, hs)          # a view: packed is whole
        for part, src in ((1, k_rot), (2, v)):
            split[:, :, part] = src[:, :, first:first + H // g, None, :]
        return
    for j, kv in enumerate(heads.tolist()):
        packed[:, :, 1, j] = k_rot[:, :, kv]
        packed[:, :, 2, j] = v[:, :, kv]


def _turns_for(pair, n_heads: int, per_head: bool) -> tuple:
    """:func:`rotary_tables`' pair for :func:`rotate` over ``n_heads`` heads: per head
    (:func:`head_tables`, NumPy's layout) or broadcast ``(T, 1, hs)``."""
    return head_tables(*pair, n_heads) if per_head else tuple(a[:, None, :] for a in pair)


def rotate_packed(q, k, v, cos, sin, heads, per_head: bool = False):
    """:meth:`~mpishard.kernels.protocol.KernelSet.rope_qkv_forward`'s math; ``per_head``:
    NumPy's way (the tables per head, a copy per query head), else whole-array passes
    and a copy per group member."""
    xp = xp_of(q)
    B, T, H, hs = q.shape
    qd = up32(q)
    pair = rotary_tables(cos, sin, qd.dtype)
    packed = xp.empty((B, T, 3, H, hs), dtype=qd.dtype)
    rotate(qd, _turns_for(pair, H, per_head), packed[:, :, 0])
    k_rot = rotate(up32(k), _turns_for(pair, k.shape[2], per_head),
                   xp.empty(k.shape, dtype=qd.dtype))
    pack_heads(packed, k_rot, up32(v), heads, by_group=not per_head)
    return _as(packed, q.dtype)


def rotate_packed_back(d, cos, sin, heads, n_kv: int, need_q: bool = True,
                       need_k: bool = True, need_v: bool = True, per_head: bool = False):
    """:meth:`~mpishard.kernels.protocol.KernelSet.rope_qkv_backward`'s math (``per_head``
    as :func:`rotate_packed`'s)."""
    xp = xp_of(d)
    dd = up32(d)
    B, T, _, H, hs = dd.shape
    pair = rotary_tables(cos, sin, dd.dtype)
    gq = rotate(dd[:, :, 0], _turns_for(pair, H, per_head),
                xp.empty((B, T, H, hs), dtype=dd.dtype), inverse=True) if need_q else None
    gk = None
    if need_k:
        summed = heads_sum(dd[:, :, 1], heads, n_kv, by_group=not per_head)
        gk = rotate(summed, _turns_for(pair, n_kv, per_head), xp.empty_like(summed),
                    inverse=True)
    gv = heads_sum(dd[:, :, 2], heads, n_kv, by_group=not per_head) if need_v else None
    return tuple(None if a is None else _as(a, d.dtype) for a in (gq, gk, gv))


def rope_qkv_forward(q, k, v, cos, sin, heads):
    return rotate_packed(q, k, v, cos, sin, heads)


def rope_qkv_backward(d, cos, sin, heads, n_kv: int, need_q: bool = True, need_k: bool = True,
                      need_v: bool = True):
    return rotate_packed_back(d, cos, sin, heads, n_kv, need_q, need_k, need_v)


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

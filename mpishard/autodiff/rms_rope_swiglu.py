"""RMS norm, rotary position embeddings and the SwiGLU gate: the ops of Llama-family
models, forward beside backward (the rotary embeddings alone, and fused with the
repeat of key/value heads for grouped-query attention). Each is in ``OPS`` and
gradient-checked like every other op.

Layouts follow Hugging Face's ``transformers`` Llama, so its weights load as
they are: rotary embeddings rotate the two *halves* of each head
(``rotate_half``), not interleaved pairs; query head ``j`` reads key/value head
``j // (n_head / n_kv_head)``. 16-bit inputs compute in float32 inside (see
[Note: 16-bit inputs] in nn_ops.py).
"""
from __future__ import annotations

import numpy as np

from mpishard.core.backend import xp_of
from mpishard.core.dtypes import is_low_precision
from mpishard.kernels import kernels_for
from mpishard.autodiff.graph import as_tensor, make_result, register_op
from mpishard.autodiff.rows import cast, check_last_dim, keeps_least, native_float16, up
from mpishard.autodiff.tensor import Tensor, grad_buffer, grad_so_far

__all__ = ["rms_norm", "rope", "rope_qkv", "swiglu", "rope_tables"]


@register_op
def rms_norm(x, weight=None, eps: float = 1e-5) -> Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis (Zhang & Sennrich, 2019)."""
    x = as_tensor(x)
    n = x.shape[-1]
    if weight is not None:
        weight = as_tensor(weight)
        check_last_dim("rms_norm", x, weight.shape[0], "the weight's width")
    xp, dtype = xp_of(x.data), x.dtype
    kernels = kernels_for(xp)
    # float16 rows straight into a GPU's kernels (see [Note: float16 rows] in
    # mpishard/kernels/cuda/norms.py), else cast up (float32 for 16-bit)
    native = native_float16(kernels, dtype) and (weight is None or weight.dtype == dtype)
    lift = (lambda a: a) if native else up
    y, _, rstd = kernels.rms_norm_forward(              # rstd kept for backward
        lift(x.data.reshape(-1, n)), lift(weight.data) if weight is not None else None, eps)

    def backward(g):   # xhat again from the input, which the graph keeps: the same bits
        xhat = kernels.rms_norm_forward(     # (see [Note: what ops keep] in rows.py;
            lift(x.data.reshape(-1, n)),        # the weight too, so that the same kernel
            lift(weight.data) if weight is not None else None, eps)[1]   # runs)
        g2 = lift(g.reshape(-1, n))
        need_w = weight is not None and weight.requires_grad
        gw, _ = kernels.norm_param_grads(                  # see [Note: gradient buffers]
            g2, xhat, need_w, False, grad_buffer(weight, xhat.dtype) if need_w else None)
        gx = None
        if x.requires_grad:
            # the weight read again: under ZeRO-3 the forward's array was a gathered copy,
            # released after the forward (holding it would keep its whole unit alive)
            w = lift(weight.data) if weight is not None else None
            into = None if native else grad_so_far(x, xhat.dtype)  # [Note: gradient
            #                        buffers]; float16 rows: added after, as when cast
            gx = kernels.rms_norm_backward(g2, xhat, rstd, w, None if into is None
                                           else into.reshape(-1, n))
            gx = into if into is not None else cast(gx, dtype).reshape(x.shape)
        return gx, gw
    return make_result(cast(y, dtype).reshape(x.shape), (x, weight), backward, "rms_norm")


def rope_tables(seq_len: int, head_size: int, theta: float = 10000.0, scaling=None,
                dtype="float32", xp=np) -> tuple:
    """``(cos, sin)`` of shape ``(seq_len, head_size)`` for positions ``0..seq_len-1``.

    Frequencies ``theta ** (-2i / head_size)``, repeated for both halves (the
    ``rotate_half`` layout). ``scaling`` is ``None`` or Llama 3's frequency
    scaling, a dict with ``factor``, ``low_freq_factor``, ``high_freq_factor``
    and ``original_max_position_embeddings`` (as in a ``transformers`` config).
    Computed in float64 on the host, then cast.
    """
    inv_freq = 1.0 / theta ** (np.arange(0, head_size, 2, dtype=np.float64) / head_size)
    if scaling is not None:
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv_freq = np.where(medium, smoothed, scaled)
    angles = np.outer(np.arange(seq_len, dtype=np.float64), inv_freq)   # (T, hs/2)
    angles = np.concatenate([angles, angles], axis=1)                   # (T, hs)
    return (xp.asarray(np.cos(angles).astype(dtype)), xp.asarray(np.sin(angles).astype(dtype)))


def _rotation(cos, sin, n_heads: int, dtype):
    """The tables for :func:`_rotate` over ``n_heads`` heads: ``cos`` and ``[-sin, sin]``
    (the sign of ``rotate_half``). On NumPy each ``(T, n_heads, hs)`` and contiguous,
    so the passes below run over whole sequences instead of 32-wide half rows (2.4x
    faster on the 64-wide heads measured); on a device ``(T, 1, hs)``, which its
    kernels broadcast over the heads. A backward keeps a device's (one ``(T, hs)``
    pair per op); on NumPy it builds them again from the model's ``(cos, sin)`` (kept,
    they would be ``2 T hs`` elements per head per block; see [Note: what ops keep]
    in rows.py)."""
    xp = xp_of(cos)
    T, hs = cos.shape
    heads = n_heads if xp is np else 1
    c = xp.broadcast_to(cos.astype(dtype)[:, None, :], (T, heads, hs)).copy()
    signed = xp.broadcast_to(sin.astype(dtype)[:, None, :], (T, heads, hs)).copy()
    signed[..., :hs // 2] *= -1
    return c, signed


def _rotate(x, tables, out, inverse: bool = False):
    """``out = x * cos + rotate_half(x) * sin`` for ``x`` ``(B, T, H, hs)``, into ``out``;
    with ``inverse``, the transpose (a rotation by ``-angle``) for backward.
    ``rotate_half(x) * sin`` is the halves swapped times ``[-sin, sin]``. On NumPy one
    sequence at a time, to stay in cache (see [Note: cache blocking] in
    mpishard/kernels/cpu/threads.py)."""
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


def _check_rope(op, x, cos):
    if x.ndim != 4 or tuple(cos.shape) != (x.shape[1], x.shape[3]):
        raise ValueError(f"{op}: x of shape {tuple(x.shape)} needs (B, T, H, hs) and tables "
                         f"of shape (T, hs), got {tuple(cos.shape)}")


@register_op
def rope(x, cos, sin) -> Tensor:
    """Rotary position embedding of ``x`` ``(B, T, H, hs)`` with tables ``(T, hs)``:
    ``x * cos + rotate_half(x) * sin``, ``rotate_half([x1, x2]) = [-x2, x1]``
    (Su et al., 2021, arXiv:2104.09864, in Hugging Face's half-split layout)."""
    x = as_tensor(x)
    _check_rope("rope", x, cos)
    xd = up(x.data)
    xp, rd = xp_of(xd), xd.dtype

    def tables():                      # (reads no array backward must not keep)
        return _rotation(cos, sin, x.shape[2], rd)
    made = tables()
    y = _rotate(xd, made, xp.empty_like(xd))
    kept = None if keeps_least(xp) else made          # see _rotation

    def backward(g):
        gd = up(g)
        return (cast(_rotate(gd, kept or tables(), xp.empty_like(gd), inverse=True),
                     x.dtype),)
    return make_result(cast(y, x.dtype), (x,), backward, "rope")


@register_op
def rope_qkv(q, k, v, cos, sin, heads) -> Tensor:
    """Rotary embeddings on ``q`` and ``k``, then for each query head its key/value head
    beside it: the packed ``[q | k | v]`` rows :func:`causal_self_attention` reads.

    ``q`` is ``(B, T, H, hs)``, ``k`` and ``v`` ``(B, T, H_kv, hs)``; ``heads``
    lists, for each of the ``H`` query heads, the key/value head it reads
    (``j // (n_head / n_kv_head)`` for grouped-query attention; non-decreasing).
    Returns ``(B*T, 3*H*hs)``. One op instead of rope, repeat and concatenate
    writes every element once; backward sums each key/value head's copies.
    """
    q, k, v = as_tensor(q), as_tensor(k), as_tensor(v)
    _check_rope("rope_qkv", q, cos)
    B, T, H, hs = q.shape
    heads = np.asarray(heads, dtype=np.int64)
    H_kv = k.shape[2]
    if (k.shape != v.shape or k.shape[:2] != (B, T) or k.shape[3] != hs or heads.shape != (H,)
            or (H and (heads.min() < 0 or heads.max() >= H_kv or np.any(np.diff(heads) < 0)))):
        raise ValueError(f"rope_qkv: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)} (B, T, heads, hs) cannot give query heads "
                         f"{heads.tolist()} (one non-decreasing key/value head per query head)")
    dtype = q.dtype
    qd = up(q.data)
    xp, rd = xp_of(qd), qd.dtype

    def tables():      # q's and k's (on a device one pair, broadcast over the heads)
        qt = _rotation(cos, sin, H, rd)
        return qt, (_rotation(cos, sin, H_kv, rd) if xp is np else qt)
    q_tables, k_tables = tables()
    packed = xp.empty((B, T, 3, H, hs), dtype=qd.dtype)
    _rotate(qd, q_tables, packed[:, :, 0])
    k_rot = _rotate(up(k.data), k_tables, xp.empty((B, T, H_kv, hs), dtype=qd.dtype))
    kept = None if keeps_least(xp) else (q_tables, k_tables)       # see _rotation
    vd = up(v.data)
    groups = None if xp is np else _even_groups(heads, H_kv)
    if groups:               # a device: each of k and v copied out in one launch
        first, g = groups
        split = packed.reshape(B, T, 3, H // g, g, hs)          # a view: packed is whole
        for part, src in ((1, k_rot), (2, vd)):
            split[:, :, part] = src[:, :, first:first + H // g, None, :]
    else:
        for j, kv in enumerate(heads.tolist()):
            packed[:, :, 1, j] = k_rot[:, :, kv]
            packed[:, :, 2, j] = vd[:, :, kv]
    used, starts = np.unique(heads, return_index=True)
    unused = sorted(set(range(H_kv)) - set(used.tolist()))

    def group_sum(d):                                   # (B, T, H, hs) -> (B, T, H_kv, hs)
        if groups:           # the same adds in the same order, a launch per group member
            return _group_sum(xp, d, H_kv, *groups)
        out = xp.empty((B, T, H_kv, hs), dtype=d.dtype)
        for kv in unused:                               # heads no local query head reads
            out[:, :, kv] = 0
        for kv, lo, hi in zip(used.tolist(), starts.tolist(), [*starts[1:].tolist(), H]):
            o = out[:, :, kv]                            # pairwise adds: 3.7x a strided sum
            o[...] = d[:, :, lo]
            for j in range(lo + 1, hi):
                o += d[:, :, j]
        return out

    def backward(g):
        d = up(g).reshape(B, T, 3, H, hs)
        qt, kt = kept or tables()
        gq = _rotate(d[:, :, 0], qt, xp.empty((B, T, H, hs), dtype=d.dtype),
                     inverse=True) if q.requires_grad else None
        gk = None
        if k.requires_grad:
            summed = group_sum(d[:, :, 1])
            gk = _rotate(summed, kt, xp.empty_like(summed), inverse=True)
        gv = group_sum(d[:, :, 2]) if v.requires_grad else None
        return cast(gq, dtype), cast(gk, dtype), cast(gv, dtype)
    return make_result(cast(packed, dtype).reshape(B * T, 3 * H * hs), (q, k, v), backward,
                       "rope_qkv")


def _even_groups(heads, n_kv: int):
    """``(first, g)`` where query head ``j`` reads key/value head ``first + j // g`` (the
    usual grouped-query layout, on a tp rank too), else None: then :func:`rope_qkv`
    copies a head at a time (2 launches a query head on a device, one way or the
    other), here a launch for each of k and v forward and one per group member
    backward."""
    H, used = len(heads), len(set(heads.tolist()))
    if not H or H % used:
        return None
    g, first = H // used, int(heads[0])
    if first + used > n_kv or heads.tolist() != [first + j // g for j in range(H)]:
        return None
    return first, g


def _group_sum(xp, d, n_kv: int, first: int, g: int):
    """``(B, T, n_kv, hs)``: key/value head ``first + i`` the sum of ``d``'s query heads
    ``i g ... i g + g - 1`` (added in that order), the heads no query head reads zero."""
    B, T, H, hs = d.shape
    groups = d.reshape(B, T, H // g, g, hs)
    out = xp.zeros((B, T, n_kv, hs), dtype=d.dtype) if H // g < n_kv else \
        xp.empty((B, T, n_kv, hs), dtype=d.dtype)
    mine = out[:, :, first:first + H // g]
    mine[...] = groups[:, :, :, 0]
    for j in range(1, g):
        mine += groups[:, :, :, j]
    return out


@register_op
def swiglu(gate, up_proj) -> Tensor:
    """``silu(gate) * up`` (Shazeer, 2020, arXiv:2002.05202), ``silu(g) = g * sigmoid(g)``."""
    gate, up_proj = as_tensor(gate), as_tensor(up_proj)
    if gate.shape != up_proj.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up_proj.shape)} "
                         f"differ; both come from projections of the same width")
    shape, dtype = gate.shape, gate.dtype
    n = shape[-1] if gate.ndim else 1
    g2, u2 = gate.data.reshape(-1, n), up_proj.data.reshape(-1, n)
    xp = xp_of(g2)
    cd = np.float32 if is_low_precision(dtype) else dtype
    kernels = kernels_for(xp)
    y = kernels.swiglu_forward(cast(g2, cd), cast(u2, cd))   # backward: the sigmoid again

    def backward(grad):
        g_gate, g_up = kernels.swiglu_backward(cast(g2, cd), cast(u2, cd),
                                               cast(grad.reshape(-1, n), cd),
                                               gate.requires_grad, up_proj.requires_grad)
        return (None if g_gate is None else cast(g_gate, dtype).reshape(shape),
                None if g_up is None else cast(g_up, up_proj.dtype).reshape(shape))
    return make_result(cast(y, dtype).reshape(shape), (gate, up_proj), backward, "swiglu")

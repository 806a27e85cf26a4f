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
from mpishard.kernels.reference import head_tables, rotary_tables, rotate
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
    native = native_float16(kernels, dtype) and (weight is None or weight.data.dtype == dtype)
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
    """The tables for :func:`~mpishard.kernels.reference.rotate` over ``n_heads`` heads
    (see :func:`~mpishard.kernels.reference.rotary_tables`): on NumPy each ``(T,
    n_heads, hs)`` and contiguous (:func:`~mpishard.kernels.reference.head_tables`), on a
    device ``(T, 1, hs)``, which its kernels broadcast over the heads. A backward keeps a
    device's (one ``(T, hs)`` pair per op); on NumPy it builds them again from the
    model's ``(cos, sin)`` (kept, they would be ``2 T hs`` elements per head per block;
    see [Note: what ops keep] in rows.py)."""
    pair = rotary_tables(cos, sin, dtype)
    if xp_of(cos) is np:
        return head_tables(*pair, n_heads)
    return tuple(a[:, None, :] for a in pair)


def _check_rope(op, x, cos, sin):
    if x.ndim != 4 or tuple(cos.shape) != (x.shape[1], x.shape[3]) or \
            tuple(sin.shape) != tuple(cos.shape):
        raise ValueError(f"{op}: x of shape {tuple(x.shape)} needs (B, T, H, hs) and tables "
                         f"of shape (T, hs), got cos {tuple(cos.shape)} and sin "
                         f"{tuple(sin.shape)}")


@register_op
def rope(x, cos, sin) -> Tensor:
    """Rotary position embedding of ``x`` ``(B, T, H, hs)`` with tables ``(T, hs)``:
    ``x * cos + rotate_half(x) * sin``, ``rotate_half([x1, x2]) = [-x2, x1]``
    (Su et al., 2021, arXiv:2104.09864, in Hugging Face's half-split layout)."""
    x = as_tensor(x)
    _check_rope("rope", x, cos, sin)
    xd = up(x.data)
    xp, rd = xp_of(xd), xd.dtype

    def tables():                      # (reads no array backward must not keep)
        return _rotation(cos, sin, x.shape[2], rd)
    made = tables()
    y = rotate(xd, made, xp.empty_like(xd))
    kept = None if keeps_least(xp) else made          # see _rotation

    def backward(g):
        gd = up(g)
        return (cast(rotate(gd, kept or tables(), xp.empty_like(gd), inverse=True),
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
    writes every element once; backward sums each key/value head's copies. The
    kernel set's ``rope_qkv_forward`` and ``rope_qkv_backward`` do the work (on a GPU
    one launch each way); backward reads the model's tables again, so the op keeps
    none of its own.
    """
    q, k, v = as_tensor(q), as_tensor(k), as_tensor(v)
    _check_rope("rope_qkv", q, cos, sin)
    B, T, H, hs = q.shape
    heads = np.asarray(heads, dtype=np.int64)
    H_kv = k.shape[2]
    if (k.shape != v.shape or k.shape[:2] != (B, T) or k.shape[3] != hs or heads.shape != (H,)
            or (H and (heads.min() < 0 or heads.max() >= H_kv or np.any(np.diff(heads) < 0)))):
        raise ValueError(f"rope_qkv: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)} (B, T, heads, hs) cannot give query heads "
                         f"{heads.tolist()} (one non-decreasing key/value head per query head)")
    dtype = q.dtype
    kernels = kernels_for(xp_of(q.data))
    packed = kernels.rope_qkv_forward(q.data, k.data, v.data, cos, sin, heads)

    def backward(g):
        gq, gk, gv = kernels.rope_qkv_backward(
            cast(g, dtype).reshape(B, T, 3, H, hs), cos, sin, heads, H_kv, q.requires_grad,
            k.requires_grad, v.requires_grad)
        return cast(gq, dtype), cast(gk, k.dtype), cast(gv, v.dtype)
    return make_result(packed.reshape(B * T, 3 * H * hs), (q, k, v), backward, "rope_qkv")


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
    kernels = kernels_for(xp)
    # 16-bit rows straight into a GPU's kernels (float32 inside, each result rounded
    # once: the values of casting up and down), else cast up (float32 for 16-bit)
    native = native_float16(kernels, dtype) and up_proj.data.dtype == dtype
    cd = dtype if native or not is_low_precision(dtype) else np.float32
    y = kernels.swiglu_forward(cast(g2, cd), cast(u2, cd))   # backward: the sigmoid again

    def backward(grad):
        g = grad.reshape(-1, n)         # a 16-bit kernel takes a gradient of the rows' dtype
        bd = cd if g.dtype == cd or not native else np.float32
        g_gate, g_up = kernels.swiglu_backward(cast(g2, bd), cast(u2, bd), cast(g, bd),
                                               gate.requires_grad, up_proj.requires_grad)
        return (None if g_gate is None else cast(g_gate, dtype).reshape(shape),
                None if g_up is None else cast(g_up, up_proj.dtype).reshape(shape))
    return make_result(cast(y, dtype).reshape(shape), (gate, up_proj), backward, "swiglu")

"""The softmax family, cross-entropy and causal attention, forward beside backward.

Split from :mod:`.nn_ops` along the seam of what they share: row-wise softmax over
the last axis, computed in float32 for 16-bit inputs (see [Note: 16-bit inputs] in
nn_ops.py).
"""
from __future__ import annotations

import math

import numpy as np

from mpishard.core.backend import xp_of
from mpishard.core.dtypes import is_low_precision, matmul_dtype
from mpishard.kernels import kernels_for
from mpishard.kernels.rows import col_sum_dtype, row_dot, row_max, row_sum
from mpishard.autodiff.batched_attention import device_attention
from mpishard.autodiff.graph import as_tensor, make_result, register_op
from mpishard.autodiff.rows import bias_grad, cast, draw_uniform, kept_mask, up
from mpishard.autodiff.tensor import Tensor, grad_buffer

__all__ = ["softmax", "log_softmax", "cross_entropy", "causal_self_attention", "valid_count",
           "at_least_one"]


# -- softmax family ----------------------------------------------------------

def _as_rows(a, axis):
    """Move ``axis`` last and view as 2-D (a copy only when axis is not last)."""
    moved = a if axis in (-1, a.ndim - 1) else xp_of(a).moveaxis(a, axis, -1)
    return xp_of(a).ascontiguousarray(moved).reshape(-1, moved.shape[-1]), moved.shape


def _from_rows(r, moved_shape, axis, ndim):
    out = r.reshape(moved_shape)
    if axis in (-1, ndim - 1):
        return out
    return xp_of(r).moveaxis(out, -1, axis)


def _softmax_rows(rows) -> None:
    """Row-wise softmax of a 2-D array, in place (max-subtracted for stability)."""
    kernels_for(xp_of(rows)).softmax_rows(rows)


@register_op
def softmax(x, axis: int = -1) -> Tensor:
    """Softmax along ``axis`` (max-subtracted for stability)."""
    x = as_tensor(x)
    r, moved = _as_rows(x.data, axis)
    p = up(r).copy()                                    # (rows, n), see [Note: 16-bit inputs]
    _softmax_rows(p)

    def backward(g):
        gr, _ = _as_rows(up(g), axis)
        gx = gr - row_dot(gr, p)[:, None]
        gx *= p
        return (_from_rows(cast(gx, x.dtype), moved, axis, x.ndim),)
    return make_result(_from_rows(cast(p, x.dtype), moved, axis, x.ndim), (x,), backward,
                       "softmax")


@register_op
def log_softmax(x, axis: int = -1) -> Tensor:
    """``log(softmax(x))`` along ``axis``, computed stably."""
    x = as_tensor(x)
    xp = xp_of(x.data)
    r, moved = _as_rows(x.data, axis)
    r = up(r)                                           # see [Note: 16-bit inputs]
    z = r - row_max(r)[:, None]
    lse = xp.log(row_sum(xp.exp(z)))
    z -= lse[:, None]                                    # z = log p

    def backward(g):
        gr, _ = _as_rows(up(g), axis)
        gx = xp.exp(z)
        gx *= -row_sum(gr)[:, None]
        gx += gr
        return (_from_rows(cast(gx, x.dtype), moved, axis, x.ndim),)
    return make_result(_from_rows(cast(z, x.dtype), moved, axis, x.ndim), (x,), backward,
                       "log_softmax")


@register_op
def cross_entropy(logits, targets, ignore_index: int = -100) -> Tensor:
    """Mean negative log-likelihood of integer ``targets`` under ``softmax(logits)``.

    Args:
        logits: ``(..., V)`` scores.
        targets: ``(...)`` integer class indices; entries equal to
            ``ignore_index`` are left out of the mean.

    The kernel set's ``cross_entropy_forward`` / ``_backward``
    (:class:`mpishard.kernels.protocol.KernelSet`): forward keeps each row's maximum
    and sum of exponentials, never a float32 copy of the whole ``(N, V)`` logits, and
    backward recomputes the softmax from the logits, writing the gradient straight into
    their dtype. On NumPy over blocks of rows that stay in cache; on a GPU one launch
    each way, a thread block per row (mpishard/kernels/cuda/loss_src.py). A target
    outside ``[0, V)`` raises on NumPy and makes the loss nan on a device (nothing is
    read back to check it).
    """
    logits = as_tensor(logits)
    t = targets.data if isinstance(targets, Tensor) else targets
    n_class = logits.shape[-1]
    if tuple(t.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"cross_entropy: targets of shape {tuple(t.shape)} do not match "
                         f"logits of shape {tuple(logits.shape)} (expected "
                         f"{tuple(logits.shape[:-1])})")
    x2, t1 = logits.data.reshape(-1, n_class), t.reshape(-1)        # (N, V), (N,)
    kernels = kernels_for(xp_of(x2))
    loss, maxima, sums, count = kernels.cross_entropy_forward(x2, t1, ignore_index)

    def backward(g):                                    # the rows' maxima and sums kept
        grad = kernels.cross_entropy_backward(x2, t1, ignore_index, maxima, sums, count, g)
        return (grad.reshape(logits.shape),)
    return make_result(loss, (logits,), backward, "cross_entropy")


def valid_count(valid, dtype) -> tuple:
    """``(count of true entries, whether all are)`` of a boolean array.

    On NumPy a Python int (and the flag, which lets the loss skip the masking).
    On a device the count stays there, a 0-d array of ``dtype`` (exact up to
    2**24 in float32), and the flag is ``False``: reading it back would be a
    host sync per loss; a loss with no valid target is then ``0 / 0 = nan``.
    """
    if isinstance(valid, np.ndarray):
        n = int(valid.sum())
        return n, n == valid.size
    return valid.sum(dtype=dtype), False


def at_least_one(count):
    """``max(count, 1)`` for a :func:`valid_count` count (host int or device array)."""
    return max(count, 1) if isinstance(count, int) else xp_of(count).maximum(count, 1)


# -- attention -------------------------------------------------------------

@register_op
def causal_self_attention(qkv, n_head: int, batch_size: int, dropout_p: float = 0.0,
                          rng=None, training: bool = True, bias=None) -> Tensor:
    """Multi-head causal attention on packed ``[q | k | v]`` rows.

    Args:
        qkv: ``(B*T, 3*C)`` rows, the output of the fused q/k/v projection, with
            ``C = n_head * head_size`` (q, k, v side by side, heads inside each).
        n_head: number of heads in ``qkv`` (local heads under tensor parallelism).
        batch_size: ``B``; ``T`` is ``rows // B``.
        dropout_p, rng, training: dropout on the attention weights.
        bias: that projection's bias ``(3*C,)`` when ``qkv`` is its output without it (see
            :func:`mpishard.nn.unbiased`): added on the way into the heads' layout
            (on a GPU in the same copy), its gradient the column sum of ``qkv``'s.

    Returns:
        ``(B*T, C)``: the heads' outputs side by side, ready for ``c_proj``.

    Written out as ``softmax(q k^T / sqrt(hs) + causal mask) v`` with the
    softmax backward fused in; the T x T weights are kept for backward. On
    NumPy it runs one sequence at a time so each (nh, T, T) block stays in
    cache (see [Note: cache blocking] in mpishard/kernels/cpu/threads.py); on CuPy
    the whole batch at once, each product one strided-batched GEMM
    (mpishard/autodiff/batched_attention.py).
    """
    qkv = as_tensor(qkv)
    xp = xp_of(qkv.data)
    N, width = qkv.shape
    if width % (3 * n_head) or N % batch_size:
        raise ValueError(f"causal_self_attention: qkv of shape {tuple(qkv.shape)} does not "
                         f"split into batch {batch_size} x 3 x {n_head} heads")
    B, T = batch_size, N // batch_size
    C = width // 3
    hs = C // n_head
    scale = 1.0 / math.sqrt(hs)
    cd = matmul_dtype(qkv.data)                           # see [Note: 16-bit inputs]
    sd = np.dtype(np.float32) if is_low_precision(qkv.dtype) else cd  # softmax dtype
    kernels = kernels_for(xp)
    use_dropout = training and dropout_p > 0.0
    if bias is not None:
        bias = as_tensor(bias)
        if tuple(bias.shape) != (width,) or bias.data.dtype != qkv.data.dtype:
            raise ValueError(f"causal_self_attention: bias of shape {tuple(bias.shape)} and "
                             f"dtype {bias.data.dtype} for qkv {tuple(qkv.shape)} "
                             f"{qkv.data.dtype}; pass the q/k/v projection's bias, ({width},)")

    parents = (qkv,) if bias is None else (qkv, bias)
    if xp is not np:                                      # whole-batch products, flags
        out, device_backward = device_attention(qkv.data, n_head, B, scale, cd, sd, kernels,
                                                dropout_p, rng, use_dropout,
                                                None if bias is None else bias.data)

        def backward_device(g):                           # bias gradient: in the same
            need = bias is not None and bias.requires_grad   # kernel as the unpacking
            dqkv, dbias = device_backward(
                g, need, grad_buffer(bias, col_sum_dtype(qkv.dtype)) if need else None)
            return (dqkv, dbias)[:len(parents)]
        return make_result(out, parents, backward_device, "causal_self_attention")

    def packed_rows():                                    # (B, T, 3, nh, hs), biased
        rows = cast(qkv.data, cd)
        if bias is not None:
            rows = rows + cast(bias.data, cd)
        return rows.reshape(B, T, 3, n_head, hs)

    def heads(packed, b, which):                          # (1, nh, T, hs) view
        return packed[b, :, which].transpose(0, 2, 1, 3)

    # NumPy: one sequence at a time; products in float32 for 16-bit inputs, so the
    # softmax's dtype is the products'
    packed = packed_rows()
    att = xp.empty((B, n_head, T, T), dtype=sd)          # softmax weights, kept
    # dropout on the weights: float32 uniforms, one sequence's at a time; kept is which
    # elements stayed (u >= p), a byte each (see [Note: what ops keep] in rows.py)
    kept = xp.empty(att.shape, dtype=bool) if use_dropout else None
    u = xp.empty(att[:1].shape, dtype=np.float32) if use_dropout else None
    out = xp.empty((B, T, n_head, hs), dtype=cd)
    for b0 in range(B):
        b = slice(b0, b0 + 1)
        a = att[b]
        xp.matmul(heads(packed, b, 0), heads(packed, b, 1).swapaxes(-1, -2), out=a)
        if use_dropout:                                  # softmax and dropout: one kernel
            draw_uniform(rng, u.shape, xp, out=u)
            used = xp.empty_like(a)
            kernels.causal_softmax(a.reshape(-1, T), T, scale, drop_u=u.reshape(-1, T),
                                   drop_p=dropout_p, dropped=used.reshape(-1, T))
            kept[b] = kept_mask(u, dropout_p)
            a = used
        else:
            kernels.causal_softmax(a.reshape(-1, T), T, scale)
        out[b] = (a @ heads(packed, b, 2)).transpose(0, 2, 1, 3)

    del packed, u

    def backward(g):
        packed = packed_rows()
        gy = cast(g, cd).reshape(B, T, n_head, hs)
        # q's, k's and v's gradients, each sequence's written into the packed layout as
        # it is done (in cache)
        dqkv = xp.empty((B, T, 3, n_head, hs), dtype=cd)
        for b0 in range(B):
            b = slice(b0, b0 + 1)
            q, k, v = heads(packed, b, 0), heads(packed, b, 1), heads(packed, b, 2)
            gyb = gy[b].transpose(0, 2, 1, 3)            # (1, nh, T, hs)
            a = att[b]
            u = kept[b].reshape(-1, T) if use_dropout else None
            used = kernels.dropout_add(None, a.reshape(-1, T), u, dropout_p).reshape(
                a.shape) if use_dropout else a
            dqkv[b, :, 2] = (used.swapaxes(-1, -2) @ gyb).transpose(0, 2, 1, 3)
            da = gyb @ v.swapaxes(-1, -2)                # (1, nh, T, T)
            kernels.softmax_backward(da.reshape(-1, T), a.reshape(-1, T), scale,  # masked
                                     drop_u=u, drop_p=dropout_p)                    # first
            dqkv[b, :, 0] = (da @ k).transpose(0, 2, 1, 3)
            dqkv[b, :, 1] = (da.swapaxes(-1, -2) @ q).transpose(0, 2, 1, 3)
        dqkv = dqkv.reshape(N, width)
        return (cast(dqkv, qkv.dtype), bias_grad(bias, dqkv))[:len(parents)]
    return make_result(cast(out, qkv.dtype).reshape(N, C), parents, backward,
                       "causal_self_attention")

"""Causal attention on a GPU: whole-batch products over head-major q, k and v.

:func:`mpishard.autodiff.softmax_ops.causal_self_attention` hands its work here
on CuPy (and on the CuPy-strict test module); NumPy keeps its per-sequence loop.

The packed ``[q | k | v]`` rows are copied once into one head-major buffer
``(3, B, n_head, T, hs)``, so that each of q, k and v is a stack of matrices
with a single stride between them, which is what a strided-batched GEMM takes.
Every product then runs as one ``batched_matmul`` (mpishard/kernels/cuda/gemm.py) with
its transposed operand (``k.T``, ``p.T``, ``v.T``, ``q.T``) passed as a flag:
CuPy's own ``matmul`` would copy each strided or transposed operand first (a
whole T x T array for ``p.T``) and run float16 products in float32. The scores
and their gradient come out of the 16-bit product straight in float32 for the
float32 softmax. Backward copies q, k, v into the head-major layout again (as
many launches as keeping the buffer, without its memory between forward and
backward), and the output's gradient once; the softmax's backward kernel writes
the dropped weights again on its way (the values' gradient needs them, and they
are not kept); the three gradients land in one head-major buffer and go back to
the packed layout in one kernel that also sums the q/k/v projection's bias gradient.

With ``MPISHARD_ATTENTION=fused`` and no dropout of the weights
(:func:`mpishard.kernels.fused_attention`), the products and the softmax are instead
the flash-style kernels of mpishard/kernels/cuda/attention.py: forward keeps the
head-major output and one log-sum-exp per query row, never the ``T x T`` weights,
and backward recomputes the weights a tile at a time.
"""
from __future__ import annotations

import numpy as np

from mpishard.core.backend import xp_of
from mpishard.kernels import fused_attention
from mpishard.kernels.cuda.gemm import batched_matmul
from mpishard.autodiff.rows import cast, draw_uniform, kept_mask

__all__ = ["device_attention"]


def _head_major(xp, data, B: int, T: int, n_head: int, hs: int, dtype, bias=None):
    """The packed ``(B*T, 3*C)`` rows as one ``(3, B, n_head, T, hs)`` buffer: one copy,
    cast to ``dtype`` on the way, with ``bias`` (``(3*C,)``) added in the same kernel."""
    hm = xp.empty((3, B, n_head, T, hs), dtype=dtype)
    rows = data.reshape(B, T, 3, n_head, hs).transpose(2, 0, 3, 1, 4)
    if bias is None:
        hm[...] = rows
    else:
        xp.add(rows, bias.reshape(3, 1, n_head, 1, hs), out=hm)
    return hm


def device_attention(qkv_data, n_head: int, B: int, scale: float, cd, sd, kernels,
                     dropout_p: float, rng, use_dropout: bool, bias=None):
    """Forward on the whole batch; returns ``(out, backward)``: the ``(B*T, C)`` output
    in ``qkv_data``'s dtype and the function from its gradient to ``(qkv's, bias's)``
    (``backward(g, need_bias, bias_out)``: the bias's gradient, with ``need_bias``, into
    ``bias_out`` if given; else None).
    ``cd``: the products' dtype; ``sd``: the softmax's (float32 for 16-bit); ``bias``:
    the q/k/v projection's, when ``qkv_data`` is its output without it."""
    xp = xp_of(qkv_data)
    N, width = qkv_data.shape
    T, C = N // B, width // 3
    hs = C // n_head
    if fused_attention(xp, hs, use_dropout):
        return _fused_attention(xp, qkv_data, n_head, B, T, hs, scale, cd, kernels, bias)
    hm = _head_major(xp, qkv_data, B, T, n_head, hs, cd, bias)
    att = batched_matmul(hm[0], hm[1], trans_b=True, out_dtype=sd)   # (B, nh, T, T), kept
    rows = att.reshape(-1, T)
    kept = None                                       # see [Note: what ops keep] in rows.py
    if use_dropout:                                   # softmax and dropout: one kernel
        drop_u = draw_uniform(rng, att.shape, xp, out=xp.empty(att.shape, dtype=np.float32))
        used = xp.empty_like(att)
        kernels.causal_softmax(rows, T, scale, drop_u=drop_u.reshape(-1, T), drop_p=dropout_p,
                               dropped=used.reshape(-1, T))
        kept = kept_mask(drop_u, dropout_p)
        del drop_u
    else:
        kernels.causal_softmax(rows, T, scale)
        used = att
    y = batched_matmul(cast(used, cd), hm[2])         # (B, nh, T, hs)
    del hm, used
    out = xp.empty((B, T, n_head, hs), dtype=qkv_data.dtype)
    out[...] = y.transpose(0, 2, 1, 3)

    def backward(g, need_bias: bool = False, bias_out=None):
        q, k, v = _head_major(xp, qkv_data, B, T, n_head, hs, cd, bias)
        gy = xp.empty((B, n_head, T, hs), dtype=cd)
        gy[...] = g.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)
        dh = xp.empty((3, B, n_head, T, hs), dtype=cd)   # q's, k's and v's gradients
        u = kept.reshape(-1, T) if use_dropout else None
        p = xp.empty_like(att) if use_dropout else att    # the dropped weights, again
        da = batched_matmul(gy, v, trans_b=True, out_dtype=sd)        # (B, nh, T, T)
        kernels.softmax_backward(da.reshape(-1, T), att.reshape(-1, T), scale,  # masked
                                 drop_u=u, drop_p=dropout_p,                     # first
                                 dropped=p.reshape(-1, T) if use_dropout else None)
        batched_matmul(cast(p, cd), gy, trans_a=True, out=dh[2])
        del p
        da = cast(da, cd)
        batched_matmul(da, k, out=dh[0])
        batched_matmul(da, q, trans_a=True, out=dh[1])
        # packed again (cast once), with the q/k/v projection's bias gradient: one kernel
        return kernels.unpack_heads(dh, need_bias, bias_out, qkv_data.dtype)
    return out.reshape(N, C), backward


def _fused_attention(xp, qkv_data, n_head: int, B: int, T: int, hs: int, scale: float, cd,
                     kernels, bias=None):
    """:func:`device_attention` on the fused kernels (no dropout): keeps the head-major
    output ``y`` and the rows' log-sum-exp ``lse``, which backward needs beside q, k and
    v (copied into the head-major layout again)."""
    hm = _head_major(xp, qkv_data, B, T, n_head, hs, cd, bias)
    y, lse = kernels.flash_attention_forward(hm, scale)          # (B, nh, T, hs), (B, nh, T)
    del hm
    out = xp.empty((B, T, n_head, hs), dtype=qkv_data.dtype)
    out[...] = y.transpose(0, 2, 1, 3)

    def backward(g, need_bias: bool = False, bias_out=None):
        hm = _head_major(xp, qkv_data, B, T, n_head, hs, cd, bias)
        gy = xp.empty((B, n_head, T, hs), dtype=cd)
        gy[...] = g.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)
        dh = kernels.flash_attention_backward(hm, y, gy, lse, scale)
        del hm, gy
        return kernels.unpack_heads(dh, need_bias, bias_out, qkv_data.dtype)
    return out.reshape(B * T, n_head * hs), backward

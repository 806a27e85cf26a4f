"""Grouped-query attention with rotary embeddings straight from the input rows, for a
Llama block whose q/k/v projections are plain ``Linear`` layers.

The parameters stay those of ``transformers`` (the query, key and
value projections, each its own ``[out, in]`` weight); only the arithmetic is grouped
in :func:`gqa_attention`:

* one matrix product against the three weights stacked for the step (a copy of
  them, made again in backward from ``tensor.data``, see [Note: parameter
  storage]); the input's gradient is one product too, and the weights'
  gradients are row blocks of one product;
* the rotation as one complex multiplication: the stacked copy puts each query
  and key head's rows in the order ``0, hs/2, 1, hs/2 + 1, ...``, so the two
  halves ``rotate_half`` pairs sit side by side, a complex number, and the
  rotation is a product with ``exp(i angle)`` (4.7x faster than the half-swap
  on the 64-wide heads measured). Attention scores are dot products over whole
  heads, unchanged when the query and key rows share an order; the gradients
  of the query and key projections are put back in their own order;
* the ``group`` query heads that share a key/value head attend as one
  ``(group * T, hs)`` matrix against that head's ``(T, hs)`` keys, so no
  key/value head is copied per query head and their gradients come out summed
  from the products.

Against the per-projection path (three products,
:func:`~.rms_rope_swiglu.rope_qkv` packing a key/value copy per query head, then
:func:`~.softmax_ops.causal_self_attention`) it keeps less for backward. The
tensor- and context-parallel layers replace these modules or the attention
core; :mod:`mpishard.models.llama.model` takes this path only where the plain
modules are there. 16-bit inputs compute as in [Note: 16-bit inputs] in
nn_ops.py.
"""
from __future__ import annotations

import math

import numpy as np

from mpishard.core.backend import xp_of
from mpishard.core.dtypes import is_low_precision, matmul_dtype
from mpishard.kernels import kernels_for
from mpishard.kernels.cuda.gemm import batched_matmul
from mpishard.autodiff.graph import as_tensor, make_result, register_op
from mpishard.autodiff.rows import cast, check_last_dim, keeps_least, up
from mpishard.autodiff.tensor import Tensor

__all__ = ["gqa_attention"]


def _pair_order(n_heads: int, hs: int):
    """Row indices that interleave each head's two halves: ``0, hs/2, 1, hs/2 + 1, ...``."""
    h = hs // 2
    within = np.stack([np.arange(h), np.arange(h) + h], axis=1).reshape(-1)
    return (np.arange(n_heads)[:, None] * hs + within).reshape(-1)


def _stacked(weights, orders, dtype):
    """``[w_q; w_k; w_v]`` with rows in ``orders`` (None: as stored), in ``dtype``."""
    xp = xp_of(weights[0].data)
    parts = [w.data if order is None else w.data[xp.asarray(order)]
             for w, order in zip(weights, orders)]
    return cast(xp.concatenate(parts, axis=0), dtype)


def _complex_of(dtype):
    """The complex dtype made of two ``dtype`` (float32 or float64) numbers."""
    return np.dtype(np.complex64) if np.dtype(dtype) == np.float32 else np.dtype(np.complex128)


def _turns(cos, sin, n_heads: int, scale: float, dtype):
    """``scale * exp(i angle)`` per head, position and pair, ``(n_heads, T, hs/2)``
    contiguous (a product with tables broadcast over heads ran 2x slower), and
    its conjugate for backward; from the first halves of ``cos`` and ``sin``
    (:func:`~.rms_rope_swiglu.rope_tables` repeats them for both)."""
    xp = xp_of(cos)
    T, hs = cos.shape
    pairs = xp.stack([cos[:, :hs // 2], sin[:, :hs // 2]], axis=-1).astype(dtype)
    one = pairs.view(_complex_of(dtype)).reshape(T, hs // 2)
    turn = xp.broadcast_to(one[None], (n_heads, T, hs // 2)) * scale
    return turn, xp.conj(turn)


def _check(x, weights, cos, n_head, n_kv_head, batch_size):
    wq, wk, wv = weights
    n_in = wq.shape[1]
    hs = wq.shape[0] // n_head if n_head else 0
    for w in weights:
        check_last_dim("gqa_attention", x, w.shape[1], f"weight {tuple(w.shape)} in_features")
        if x.data.dtype != w.data.dtype:
            raise ValueError(f"gqa_attention: dtype mismatch {x.data.dtype} (input "
                             f"{tuple(x.shape)}) vs {w.data.dtype} (weight {tuple(w.shape)})")
    N = int(np.prod(x.shape[:-1]))
    if (n_kv_head < 1 or n_head % n_kv_head or hs % 2 or hs * n_head != wq.shape[0]
            or wk.shape != (n_kv_head * hs, n_in) or wv.shape != wk.shape
            or N % batch_size or tuple(cos.shape) != (N // batch_size, hs)):
        raise ValueError(f"gqa_attention: weights {tuple(wq.shape)}, {tuple(wk.shape)}, "
                         f"{tuple(wv.shape)}, input {tuple(x.shape)} and tables "
                         f"{tuple(cos.shape)} do not make batch {batch_size} x {n_head} query "
                         f"and {n_kv_head} key/value heads of one even head size with tables "
                         f"(T, head size)")
    return hs


@register_op
def gqa_attention(x, wq, wk, wv, cos, sin, n_head: int, n_kv_head: int,
                  batch_size: int) -> Tensor:
    """Causal grouped-query attention of rows ``x`` with rotary embeddings.

    Args:
        x: ``(..., C)``, ``B*T`` rows in all.
        wq, wk, wv: the projections' weights, ``[out, in]``: ``(n_head hs, C)``
            and ``(n_kv_head hs, C)`` twice.
        cos, sin: the rotation tables ``(T, hs)`` (:func:`~.rms_rope_swiglu.rope_tables`).
        n_head, n_kv_head: query heads, and key/value heads (each read by
            ``n_head / n_kv_head`` consecutive query heads).
        batch_size: ``B``.

    Returns:
        ``(B*T, n_head hs)``: the heads' outputs side by side, for the output projection.

    The arithmetic of the query, key and value projections, then
    :func:`~.rms_rope_swiglu.rope_qkv` and :func:`~.softmax_ops.causal_self_attention`,
    with the ``1/sqrt(hs)`` scale in the query's rotation. Keeps the rotated,
    scaled queries, the rotated keys, the values and the softmax weights for
    backward (and on a device the rotations' conjugates; NumPy makes them again). On
    NumPy one sequence at a time (see [Note: cache blocking] in
    mpishard/kernels/cpu/threads.py); on CuPy all at once.
    """
    x, weights = as_tensor(x), [as_tensor(w) for w in (wq, wk, wv)]
    hs = _check(x, weights, cos, n_head, n_kv_head, batch_size)
    xp = xp_of(x.data)
    H, Hkv, B, C = n_head, n_kv_head, batch_size, x.shape[-1]
    N = int(np.prod(x.shape[:-1]))
    T, G, h = N // B, H // Hkv, hs // 2
    dtype, cd = x.dtype, matmul_dtype(x.data)           # see [Note: 16-bit inputs]
    sd = np.dtype(np.float32) if is_low_precision(dtype) else cd    # softmax dtype
    rd = np.dtype(np.float32) if is_low_precision(dtype) else np.dtype(dtype)  # rotations
    zd = _complex_of(rd)
    cos, sin = xp.asarray(cos), xp.asarray(sin)         # tables made on the host: copied
    def turns():       # (q's, k's) rotations and their conjugates
        return _turns(cos, sin, H, 1.0 / math.sqrt(hs), rd), _turns(cos, sin, Hkv, 1.0, rd)
    (q_turn, q_back), (k_turn, k_back) = turns()
    # backward's conjugates kept on a device; on NumPy made again (as rope's tables:
    # see [Note: what ops keep] in rows.py)
    backs = None if keeps_least(xp) else (q_back, k_back)
    del q_back, k_back
    orders = (_pair_order(H, hs), _pair_order(Hkv, hs), None)
    kernels = kernels_for(xp)
    step = 1 if xp is np else B

    def heads(rows, b, lo, n, width):
        """Columns ``lo:lo + n*width`` of sequences ``b`` as ``(nb, n, T, width)`` views."""
        r = rows.reshape(B, T, -1)[b, :, lo:lo + n * width]
        return r.reshape(r.shape[0], T, n, width).transpose(0, 2, 1, 3)

    qkv = cast(x.data.reshape(N, C), cd) @ _stacked(weights, orders, cd).T
    z = up(qkv).view(zd)                                 # (N, (H + 2 Hkv) hs / 2)
    q_rot = xp.empty((B, H, T, hs), dtype=cd)            # (B, Hkv, G*T, hs) in memory
    k_rot = xp.empty((B, Hkv, T, hs), dtype=cd)
    v = xp.empty((B, Hkv, T, hs), dtype=cd)
    att = xp.empty((B, Hkv, G * T, T), dtype=sd)         # softmax weights, kept
    out = xp.empty((B, T, H, hs), dtype=cd)
    for b0 in range(0, B, step):
        b = slice(b0, b0 + step)
        _turn_into(heads(z, b, 0, H, h), q_turn, q_rot[b], rd)
        _turn_into(heads(z, b, H * h, Hkv, h), k_turn, k_rot[b], rd)
        v[b] = heads(qkv, b, (H + Hkv) * hs, Hkv, hs)
        nb = v[b].shape[0]
        a = att[b]
        qg = q_rot[b].reshape(nb, Hkv, G * T, hs)
        batched_matmul(qg, k_rot[b], trans_b=True, out=a)  # 16-bit in: float32 scores
        kernels.causal_softmax(a.reshape(-1, T), T, 1.0)   # the scale is in q_turn
        y = batched_matmul(cast(a, cd), v[b])            # (nb, Hkv, G*T, hs)
        out[b] = y.reshape(nb, H, T, hs).transpose(0, 2, 1, 3)

    def backward(g):
        q_back, k_back = backs or tuple(t[1] for t in turns())
        gy = cast(g, cd).reshape(B, T, H, hs)
        dqkv = xp.empty((N, (H + 2 * Hkv) * hs), dtype=rd)
        dz = dqkv.view(zd)
        for b0 in range(0, B, step):
            b = slice(b0, b0 + step)
            nb = v[b].shape[0]
            gyb = xp.ascontiguousarray(gy[b].transpose(0, 2, 1, 3)).reshape(nb, Hkv, G * T, hs)
            a = att[b]
            heads(dqkv, b, (H + Hkv) * hs, Hkv, hs)[...] = batched_matmul(
                cast(a, cd), gyb, trans_a=True, out_dtype=rd)
            da = batched_matmul(gyb, v[b], trans_b=True, out_dtype=sd)  # (nb, Hkv, G*T, T)
            kernels.softmax_backward(da.reshape(-1, T), a.reshape(-1, T), 1.0)
            da = cast(da, cd)
            g_q = batched_matmul(da, k_rot[b], out_dtype=rd).reshape(nb, H, T, hs)
            xp.multiply(g_q.view(zd), q_back, out=heads(dz, b, 0, H, h))
            g_k = batched_matmul(da, q_rot[b].reshape(nb, Hkv, G * T, hs), trans_a=True,
                                 out_dtype=rd)
            xp.multiply(g_k.view(zd), k_back, out=heads(dz, b, H * h, Hkv, h))
        g2 = cast(dqkv, cd)
        gx = cast(g2 @ _stacked(weights, orders, cd), dtype).reshape(x.shape) \
            if x.requires_grad else None
        grads = [None] * 3
        if any(w.requires_grad for w in weights):
            gw = g2.T @ cast(x.data.reshape(N, C), cd)   # stacked, rows in the pair order
            starts = (0, H * hs, (H + Hkv) * hs, (H + 2 * Hkv) * hs)
            for i, (w, order) in enumerate(zip(weights, orders)):
                if w.requires_grad:
                    block = gw[starts[i]:starts[i + 1]]
                    grads[i] = block if order is None else block[xp.asarray(np.argsort(order))]
        return (gx, *grads)
    return make_result(cast(out, dtype).reshape(N, H * hs), (x, *weights), backward,
                       "gqa_attention")


def _turn_into(z, turn, out, dtype):
    """``out = z * turn`` (a rotation of pairs, as complex numbers) written into the real
    array ``out``, straight when it is of the rotation's real ``dtype``."""
    xp = xp_of(z)
    if out.dtype == dtype:
        xp.multiply(z, turn, out=out.view(turn.dtype))
    else:
        out[...] = (z * turn).view(dtype)

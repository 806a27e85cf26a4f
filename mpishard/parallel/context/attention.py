"""Context parallelism: causal attention over a sequence split between ranks.

Each rank of the context-parallel communicator ``cp`` holds ``T / cp`` rows of
every sequence (see [Note: zigzag layout]) and computes their attention output:

- :func:`ring_attention` (Liu et al., "Ring Attention with Blockwise
  Transformers", 2023, arXiv:2310.01889): every rank's key/value block travels
  once around the ring of ranks, overlapped with the attention of the block in
  hand; partial outputs merge by the log-sum-exp rule, so no ``T x T`` weights
  are kept. Backward recomputes the scores block by block (as FlashAttention
  does) and sends the key/value gradients around the ring with their blocks.
- :func:`ulysses_attention` (Jacobs et al., "DeepSpeed Ulysses", 2023,
  arXiv:2309.14509): an all-to-all trades the sequence split for a head split
  (:func:`seq_to_heads`), each rank attends over the whole sequence with
  ``n_head / cp`` heads, and the conjugate all-to-all (:func:`heads_to_seq`)
  trades back.

At ``cp.size == 1`` both are plain :func:`causal_self_attention`. 16-bit inputs
are multiplied as that op does, with softmax, log-sum-exp and accumulators in
float32 and the output in the input dtype. The ring keeps for backward its output
(the rows returned, which the output projection keeps anyway) and the log-sum-exp,
and computes FlashAttention's ``rowsum(dO * O)`` from that output, in its dtype as
FlashAttention-2 does: no float32 copy of the output is kept.

[Note: zigzag layout]
Under a causal mask late rows see more keys than early ones, so ``cp`` contiguous
blocks give the last rank ``2 cp - 1`` times the first one's work. Zigzag cuts
the sequence into ``2 cp`` equal chunks and gives rank ``r`` chunks ``r`` and
``2 cp - 1 - r``, in that order: equal work. ``r``'s rows see only the first
chunk of a rank ``s < r``; of a rank ``s > r`` only ``r``'s second chunk sees
anything (all of it); its own rows, whose positions increase, need the mask.
"""
from __future__ import annotations

import math

import numpy as np

from mpishard.autodiff.graph import as_tensor, make_result, register_op
from mpishard.autodiff.rows import cast
from mpishard.kernels.rows import row_max, row_sum
from mpishard.autodiff.softmax_ops import causal_self_attention
from mpishard.autodiff.tensor import Tensor
from mpishard.core.backend import xp_of
from mpishard.core.dtypes import is_low_precision, matmul_dtype

__all__ = ["zigzag_positions", "zigzag_slice", "ring_attention", "ring_kv_bytes",
           "seq_to_heads", "heads_to_seq", "ulysses_attention", "LAYOUTS"]

#: Sequence layouts: ``zigzag`` (balanced) and ``contiguous`` (unbalanced, for comparison).
LAYOUTS = ("zigzag", "contiguous")
_KV_TAG, _DKV_TAG = 7101, 7102


def _size(cp) -> int:
    return int(getattr(cp, "size", cp))                 # a Communicator or a number


def _check_length(seq_len: int, cp: int, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    if layout == "zigzag" and cp > 1 and seq_len % (2 * cp):
        raise ValueError(
            f"sequence length {seq_len} does not divide by 2 x cp = {2 * cp} (context "
            f"parallel splits it into 2*cp chunks); use a sequence length that is a "
            f"multiple of {2 * cp} or another cp")
    if layout == "contiguous" and seq_len % cp:
        raise ValueError(f"sequence length {seq_len} does not divide by cp = {cp}; use a "
                         f"sequence length that is a multiple of {cp} or another cp")


def zigzag_positions(seq_len: int, cp, rank: int, xp=np, layout: str = "zigzag"):
    """Global positions (int64, increasing) of the ``seq_len // cp`` rows rank ``rank`` holds.

    ``cp`` is the group size (or the Communicator). ``layout="zigzag"``: chunks
    ``rank`` and ``2 cp - 1 - rank`` of ``2 cp`` (see [Note: zigzag layout]);
    ``"contiguous"``: the ``rank``-th block. One rank: every position, any length.
    Raises ValueError for a length that does not split into the layout's
    chunks, a rank outside ``[0, cp)`` or an unknown layout.
    """
    cp = _size(cp)
    _check_length(seq_len, cp, layout)
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is not in a context-parallel group of {cp}")
    n = seq_len // cp
    if layout == "contiguous" or cp == 1:
        return xp.arange(rank * n, (rank + 1) * n, dtype=xp.int64)
    c = n // 2
    late = 2 * cp - 1 - rank
    return xp.concatenate([xp.arange(rank * c, (rank + 1) * c, dtype=xp.int64),
                           xp.arange(late * c, (late + 1) * c, dtype=xp.int64)])


def zigzag_slice(array, cp, rank: int, axis: int = 1, layout: str = "zigzag"):
    """Rank ``rank``'s rows (:func:`zigzag_positions`) of ``(B, T, ...)`` ``array``
    along ``axis``, as a contiguous copy."""
    xp = xp_of(array)
    positions = zigzag_positions(array.shape[axis], cp, rank, xp, layout)
    return xp.ascontiguousarray(xp.take(array, positions, axis=axis))


def _split_shape(op: str, shape, n_head: int, batch_size: int, parts: int):
    n_rows, width = shape
    if width % (parts * n_head) or n_rows % batch_size:
        raise ValueError(f"{op}: input of shape {tuple(shape)} does not split into batch "
                         f"{batch_size} x {parts} x {n_head} heads")
    return n_rows // batch_size, width // (parts * n_head)      # (rows per sequence, hs)


def _count(stats, n: int) -> None:
    if isinstance(stats, dict):                        # see ring_attention
        stats["score_elements"] = stats.get("score_elements", 0) + int(n)


# -- ring attention ------------------------------------------------------------

def _block(layout: str, rank: int, src: int, n: int):
    """``(query rows, key rows, causal)`` that ``rank`` needs from ``src``'s K/V, or None."""
    if src == rank:
        return slice(0, n), slice(0, n), True
    if layout == "contiguous":
        return (slice(0, n), slice(0, n), False) if src < rank else None
    half = n // 2
    if src < rank:
        return slice(0, n), slice(0, half), False      # every query, src's early chunk
    return slice(half, n), slice(0, n), False          # the late queries, all of src


def _ring(comm, first, tag: int):
    """Yield ``(step, block)``: this rank's ``first``, then its left neighbours' in turn.

    While the caller works on a block, its send to ``rank + 1`` and the next
    block's receive from ``rank - 1`` are in flight, waited for when the caller
    asks for the next block. Two buffers take turns (``first`` is overwritten).
    """
    cur, spare = first, xp_of(first).empty_like(first)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for step in range(comm.size):
        handles = (() if step == comm.size - 1 else
                   (comm.irecv(spare, left, tag), comm.isend(cur, right, tag)))
        yield step, cur
        for handle in handles:
            handle.wait()
        cur, spare = spare, cur


def _queries_and_kv(data, B: int, n: int, n_head: int, hs: int, cd):
    """``q`` as ``(B, nh, n, hs)`` in ``cd``; ``[k | v]``: a ``(B, n, 2, nh, hs)`` copy."""
    packed = data.reshape(B, n, 3, n_head, hs)
    return cast(packed[:, :, 0], cd).transpose(0, 2, 1, 3), packed[:, :, 1:].copy()


def _kv_heads(kv, keys: slice, cd):
    """``k`` and ``v`` of rows ``keys`` of a K/V block, as ``(B, nh, nk, hs)`` in ``cd``."""
    return [cast(kv[:, keys, i], cd).transpose(0, 2, 1, 3) for i in (0, 1)]


def _scores(q, k, scale: float, causal: bool, sd):
    """``q k^T * scale`` in ``sd`` (masked above the diagonal when ``causal``)."""
    s = cast(q @ k.swapaxes(-1, -2), sd)
    s *= scale
    if causal:
        xp = xp_of(s)
        s += xp.triu(xp.full(s.shape[-2:], -np.inf, dtype=sd), 1)
    return s


def _forward_block(q, k, v, scale, causal, sd, cd):
    """The block's softmax-normalised output and per-row log-sum-exp, both in ``sd``."""
    xp = xp_of(q)
    s = _scores(q, k, scale, causal, sd)
    rows = s.reshape(-1, s.shape[-1])
    m = row_max(rows)
    rows -= m[:, None]
    xp.exp(rows, out=rows)
    total = row_sum(rows)
    rows *= (1.0 / total)[:, None]
    lse = (m + xp.log(total)).reshape(s.shape[:-1])
    return cast(cast(s, cd) @ v, sd), lse


def _merge(out, lse, queries: slice, o_b, lse_b) -> None:
    """Fold one block's ``(o_b, lse_b)`` into the running ``(out, lse)`` rows ``queries``."""
    xp = xp_of(out)
    old = lse[:, :, queries]
    new = xp.logaddexp(old, lse_b)
    out[:, :, queries] *= xp.exp(old - new)[..., None]
    out[:, :, queries] += o_b * xp.exp(lse_b - new)[..., None]
    lse[:, :, queries] = new


def _backward_block(q, k, v, do, lse, dsum, scale, causal, sd, cd):
    """``(dq, dk, dv)`` of one block in ``sd``, from scores recomputed with the kept LSE."""
    xp = xp_of(q)
    p = _scores(q, k, scale, causal, sd)
    p -= lse[..., None]
    xp.exp(p, out=p)                                    # the block's softmax weights
    dv = cast(p, cd).swapaxes(-1, -2) @ do
    ds = cast(do @ v.swapaxes(-1, -2), sd)
    ds -= dsum[..., None]
    ds *= p
    ds = cast(ds * scale, cd)
    return cast(ds @ k, sd), cast(ds.swapaxes(-1, -2) @ q, sd), cast(dv, sd)


@register_op
def ring_attention(qkv, n_head: int, batch_size: int, cp, layout: str = "zigzag",
                   stats=None) -> Tensor:
    """Causal self-attention over a sequence split between the ranks of ``cp``, by ring.

    Args:
        qkv: this rank's ``(B * T_local, 3 * C)`` packed ``[q | k | v]`` rows (as
            :func:`causal_self_attention` takes them), ``T_local = T / cp`` rows
            of each sequence in ``layout`` (``"zigzag"`` or ``"contiguous"``,
            see :func:`zigzag_slice`); ``cp`` is the Communicator.
        stats: a dict, or None; ``stats["score_elements"]`` grows by the number
            of query-key scores (over batch and heads) computed in forward.

    Returns ``(B * T_local, C)``: causal attention over the whole sequence at
    this rank's positions. Each rank sends ``cp - 1`` K/V blocks in forward,
    ``cp - 1`` K/V and ``cp`` dK/dV blocks (float32 for 16-bit inputs) in
    backward (:func:`ring_kv_bytes`). Raises ValueError when the shape does not
    split into heads or the global length does not fit the layout.
    """
    qkv = as_tensor(qkv)
    n, hs = _split_shape("ring_attention", qkv.shape, n_head, batch_size, 3)
    P, rank, B = cp.size, cp.rank, batch_size
    _check_length(n * P, P, layout)
    if P == 1:
        _count(stats, B * n_head * n * n)
        return causal_self_attention(qkv, n_head, batch_size)
    xp = xp_of(qkv.data)
    N, C = qkv.shape[0], qkv.shape[1] // 3
    scale = 1.0 / math.sqrt(hs)
    cd = matmul_dtype(qkv.data)                          # the products' dtype
    sd = np.dtype(np.float32) if is_low_precision(qkv.dtype) else cd  # softmax, sums
    blocks = [_block(layout, rank, (rank - i) % P, n) for i in range(P)]
    _count(stats, B * n_head * sum((b[0].stop - b[0].start) * (b[1].stop - b[1].start)
                                   for b in blocks if b is not None))
    q, kv = _queries_and_kv(qkv.data, B, n, n_head, hs, cd)
    out = lse = None
    for step, held in _ring(cp, kv, _KV_TAG):
        if blocks[step] is None:
            continue
        queries, keys, causal = blocks[step]
        o_b, lse_b = _forward_block(q[:, :, queries], *_kv_heads(held, keys, cd),
                                    scale, causal, sd, cd)
        if out is None:                                  # step 0 covers every row
            out, lse = o_b, lse_b
        else:
            _merge(out, lse, queries, o_b, lse_b)
    del q, kv
    y = cast(out.transpose(0, 2, 1, 3), qkv.dtype).reshape(N, C)    # (the rows returned)
    del out

    def backward(g):
        q, kv = _queries_and_kv(qkv.data, B, n, n_head, hs, cd)
        do = cast(g, sd).reshape(B, n, n_head, hs).transpose(0, 2, 1, 3)
        o = cast(y.reshape(B, n, n_head, hs).transpose(0, 2, 1, 3), sd)
        dsum = (do * o).sum(axis=-1)                     # FlashAttention's D = rowsum(dO * O)
        del o
        do = cast(do, cd)
        dq = xp.zeros(q.shape, sd)
        acc = [xp.zeros(kv.shape, sd), xp.empty(kv.shape, sd)]   # dK/dV, in turns
        right, left = (rank + 1) % P, (rank - 1) % P
        pending = ()
        for step, held in _ring(cp, kv, _KV_TAG):
            grads = None
            if blocks[step] is not None:
                queries, keys, causal = blocks[step]
                grads = _backward_block(q[:, :, queries], *_kv_heads(held, keys, cd),
                                        do[:, :, queries], lse[:, :, queries],
                                        dsum[:, :, queries], scale, causal, sd, cd)
                dq[:, :, queries] += grads[0]
            for handle in pending:                       # this block's dK/dV so far
                handle.wait()
            mine = acc[step % 2]
            if grads is not None:
                mine[:, keys, 0] += grads[1].transpose(0, 2, 1, 3)
                mine[:, keys, 1] += grads[2].transpose(0, 2, 1, 3)
            pending = (cp.irecv(acc[(step + 1) % 2], left, _DKV_TAG),
                       cp.isend(mine, right, _DKV_TAG))
        for handle in pending:                           # our own block's, back home
            handle.wait()
        dqkv = xp.empty((B, n, 3, n_head, hs), dtype=qkv.dtype)
        dqkv[:, :, 0] = cast(dq.transpose(0, 2, 1, 3), qkv.dtype)
        dqkv[:, :, 1:] = cast(acc[P % 2], qkv.dtype)
        return (dqkv.reshape(N, 3 * C),)
    return make_result(y, (qkv,), backward, "ring_attention")


def ring_kv_bytes(batch_size: int, seq_len: int, n_head: int, head_size: int, cp,
                  itemsize: int, grad_itemsize: int | None = None) -> int:
    """Bytes one rank sends in :func:`ring_attention`'s forward plus backward.

    ``2 (cp - 1)`` K/V blocks (``batch_size * seq_len / cp`` rows of ``2 * n_head
    * head_size`` elements of ``itemsize`` bytes) and ``cp`` dK/dV blocks of
    ``grad_itemsize`` bytes an element (default: 4 for 16-bit inputs, whose
    gradients travel in float32, else ``itemsize``); 0 at ``cp == 1``.
    """
    cp = _size(cp)
    grad_itemsize = grad_itemsize or (4 if itemsize == 2 else itemsize)
    block = batch_size * (seq_len // cp) * 2 * n_head * head_size
    return 0 if cp == 1 else block * (2 * (cp - 1) * itemsize + cp * grad_itemsize)


# -- Ulysses -------------------------------------------------------------------

def _check_heads(op: str, n_head: int, cp: int) -> None:
    if n_head % cp:
        raise ValueError(
            f"{op}: n_head {n_head} does not divide by cp = {cp} (each rank attends with "
            f"n_head / cp whole heads); use a cp that divides {n_head} or a head count "
            f"that is a multiple of {cp} (k/v heads arrive expanded to n_head, so with "
            f"grouped-query attention only the query head count must divide)")


def _gathered_positions(seq_len: int, cp: int, xp):
    """Global positions of the rows an all-to-all gathers, source rank by source rank."""
    return xp.concatenate([zigzag_positions(seq_len, cp, r, xp) for r in range(cp)])


def _to_heads(x, parts: int, n_head: int, B: int, cp):
    """``(B * T_local, parts * C)`` sequence rows -> ``(B * T, parts * C / cp)`` head rows."""
    xp, P = xp_of(x), cp.size
    n, hs = x.shape[0] // B, x.shape[1] // (parts * n_head)
    local = n_head // P
    send = xp.ascontiguousarray(x.reshape(B, n, parts, P, local, hs).transpose(3, 0, 1, 2, 4, 5))
    got = cp.all_to_all(send)                              # (P, B, n, parts, local, hs)
    gathered = got.transpose(1, 0, 2, 3, 4, 5).reshape(B, P * n, parts, local, hs)
    out = xp.empty_like(gathered)
    out[:, _gathered_positions(P * n, P, xp)] = gathered  # natural order
    return out.reshape(B * P * n, parts * local * hs)


def _to_seq(y, parts: int, n_head: int, B: int, cp):
    """The inverse (and adjoint) of :func:`_to_heads`."""
    xp, P = xp_of(y), cp.size
    T, local = y.shape[0] // B, n_head // P
    hs, n = y.shape[1] // (parts * local), T // P
    gathered = y.reshape(B, T, parts, local, hs)[:, _gathered_positions(T, P, xp)]
    send = xp.ascontiguousarray(gathered.reshape(B, P, n, parts, local, hs)
                                .transpose(1, 0, 2, 3, 4, 5))
    got = cp.all_to_all(send)                              # (P, B, n, parts, local, hs)
    return got.transpose(1, 2, 3, 0, 4, 5).reshape(B * n, parts * n_head * hs)


def _exchange(op: str, x, n_head: int, batch_size: int, cp, parts: int, to_heads: bool):
    """:func:`seq_to_heads` (``to_heads``) or :func:`heads_to_seq`: checks, then the op."""
    x = as_tensor(x)
    _check_heads(op, n_head, cp.size)
    rows, _ = _split_shape(op, x.shape, n_head if to_heads else n_head // cp.size,
                           batch_size, parts)
    _check_length(rows * cp.size if to_heads else rows, cp.size, "zigzag")
    if cp.size == 1:
        return x
    there, back = (_to_heads, _to_seq) if to_heads else (_to_seq, _to_heads)

    def backward(g):
        return (back(g, parts, n_head, batch_size, cp),)
    return make_result(there(x.data, parts, n_head, batch_size, cp), (x,), backward, op)


@register_op
def seq_to_heads(qkv, n_head: int, batch_size: int, cp, parts: int = 3) -> Tensor:
    """All-to-all from a sequence split to a head split (zigzag rows in, natural order out).

    ``qkv``: this rank's ``(B * T_local, parts * C)`` zigzag rows, ``parts``
    groups (q, k, v) of ``n_head`` heads (a multiple of ``cp.size``) each.
    Returns ``(B * T, parts * C / cp)``: the whole sequence, in order, for this
    rank's ``n_head / cp`` heads of every group. Backward is
    :func:`heads_to_seq`'s forward; identity at ``cp.size == 1``.
    """
    return _exchange("seq_to_heads", qkv, n_head, batch_size, cp, parts, True)


@register_op
def heads_to_seq(y, n_head: int, batch_size: int, cp, parts: int = 1) -> Tensor:
    """All-to-all from a head split back to a sequence split: the inverse of :func:`seq_to_heads`.

    ``y``: ``(B * T, parts * C / cp)``, the whole sequence in order for this
    rank's ``n_head / cp`` heads (``n_head``: over all ranks) of each group.
    Returns ``(B * T_local, parts * C)``: this rank's zigzag rows, every head.
    Backward is :func:`seq_to_heads`'s forward; identity at ``cp.size == 1``.
    """
    return _exchange("heads_to_seq", y, n_head, batch_size, cp, parts, False)


@register_op
def ulysses_attention(qkv, n_head: int, batch_size: int, cp) -> Tensor:
    """Causal self-attention over a sequence split between the ranks of ``cp``, by all-to-all.

    Same arguments and result as :func:`ring_attention` (zigzag layout only):
    :func:`seq_to_heads`, :func:`causal_self_attention` on ``n_head / cp``
    heads over the whole sequence, :func:`heads_to_seq`. In forward each rank
    sends ``(cp - 1) / cp`` of its q, k, v rows and of its output rows, in
    backward as much of their gradients. Raises ValueError when ``n_head``
    does not divide by ``cp.size`` or the global length by ``2 * cp.size``.
    """
    if cp.size == 1:
        return causal_self_attention(qkv, n_head, batch_size)
    _check_heads("ulysses_attention", n_head, cp.size)
    heads = seq_to_heads(qkv, n_head, batch_size, cp)
    y = causal_self_attention(heads, n_head // cp.size, batch_size)
    return heads_to_seq(y, n_head, batch_size, cp)

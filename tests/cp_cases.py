"""Distributed gradient-check cases of the context-parallel ops (mpishard.parallel.context.attention).

Same form as ``DISTRIBUTED_CASES`` in distributed_gradcheck.py (which merges
these): op name -> ``case(rng, comm) -> (fn, split arrays, replicated arrays)``.
Every rank holds its own rows of a small float64 sequence (the split input);
the checked function is ``F = sum_r <op(x_r), w_r>`` with a fixed projection
``w_r`` per rank, summed over the group by ``reduce_from_tp``. Shapes grow
with the group size so that every size from 1 to 4 runs.
"""
from __future__ import annotations

import numpy as np

from mpishard.parallel.context.attention import heads_to_seq, ring_attention, seq_to_heads, ulysses_attention
from mpishard.parallel.tensor.ops import reduce_from_tp


def _projected(op):
    """``F(comm, x) = sum over ranks of <op(x, comm), w_rank>``."""
    def fn(comm, x):
        y = op(x, comm)
        w = np.random.default_rng(1000 + comm.rank).standard_normal(y.shape)
        return reduce_from_tp((y * w).sum(), comm)
    return fn


def _ring(B, n_head, hs, chunk, layout="zigzag"):
    """ring_attention on ``chunk * cp`` rows per sequence (``T_local = 2 * chunk`` for zigzag)."""
    def case(r, comm):
        local = (2 if layout == "zigzag" else 1) * chunk
        op = _projected(lambda x, c: ring_attention(x, n_head, B, c, layout=layout))
        return op, [r.standard_normal((B * local, 3 * n_head * hs))], []
    return case


def _ulysses(B, heads_per_rank, hs, chunk):
    def case(r, comm):
        n_head = heads_per_rank * comm.size
        op = _projected(lambda x, c: ulysses_attention(x, n_head, B, c))
        return op, [r.standard_normal((B * 2 * chunk, 3 * n_head * hs))], []
    return case


def _to_heads(B, hs, parts):
    def case(r, comm):
        n_head = comm.size
        op = _projected(lambda x, c: seq_to_heads(x, n_head, B, c, parts=parts))
        return op, [r.standard_normal((B * 2, parts * n_head * hs))], []
    return case


def _to_seq(B, hs, parts):
    def case(r, comm):
        n_head = comm.size
        op = _projected(lambda y, c: heads_to_seq(y, n_head, B, c, parts=parts))
        return op, [r.standard_normal((B * 2 * comm.size, parts * hs))], []
    return case


#: op name -> ``case(rng, comm) -> (fn, split arrays, replicated arrays)``
CP_CASES = {
    "ring_attention": [_ring(B=2, n_head=2, hs=2, chunk=1),
                       _ring(B=1, n_head=1, hs=2, chunk=2),
                       _ring(B=1, n_head=2, hs=1, chunk=2, layout="contiguous")],
    "ulysses_attention": [_ulysses(B=2, heads_per_rank=1, hs=2, chunk=1)],
    "seq_to_heads": [_to_heads(B=2, hs=2, parts=3), _to_heads(B=1, hs=1, parts=1)],
    "heads_to_seq": [_to_seq(B=2, hs=2, parts=1), _to_seq(B=1, hs=1, parts=3)],
}

"""Distributed gradient-check cases of expert parallelism's exchange (all_to_all_v).

Each rank sends a different number of rows to each rank (some none; in the
second case every row goes to rank 0), multiplies what it receives by its own
weights ``w`` and ``reduce_from_tp`` sums the ranks' partial losses into the one
value every rank sees, so the backward must send every row's gradient back to
where the row came from.
"""
from __future__ import annotations

import numpy as np

from mpishard.autodiff.ops import tanh
from mpishard.parallel.expert.layers import all_to_all_v
from mpishard.parallel.tensor.ops import reduce_from_tp

COLS = 3


def _counts(rank: int, size: int, one_rank: bool) -> tuple:
    """Rows rank ``rank`` sends to each rank, and receives from each."""
    def sent(r, j):
        return (2 + r if j == 0 else 0) if one_rank else (r + j) % 3
    return [sent(rank, j) for j in range(size)], [sent(j, rank) for j in range(size)]


def _case(one_rank: bool):
    def case(r, comm):
        send, recv = _counts(comm.rank, comm.size, one_rank)

        def fn(c, x, w):
            return reduce_from_tp((tanh(all_to_all_v(x, c, send, recv)) * w).sum(), c)
        return fn, [r.standard_normal((sum(send), COLS)), r.standard_normal((sum(recv), COLS))], []
    return case


#: op name -> ``case(rng, comm) -> (fn, split arrays, replicated arrays)``
EP_CASES = {"all_to_all_v": [_case(False), _case(True)]}

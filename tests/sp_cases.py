"""Distributed gradient-check cases of the sequence-parallel ops (mpishard.parallel.tensor.sequence).

Each function is a sequence-parallel computation that ends the way a
training step does: every rank computes a partial loss from its own weights
``w`` (a split input: a column shard's share, or the loss of this rank's row
block), and ``reduce_from_tp`` sums them into the one value every rank sees.
A second case per op feeds a transposed (non-C-contiguous) view in and gets a
transposed gradient back. Float64 and small: ``distributed_gradcheck``
perturbs every element on every rank.
"""
from __future__ import annotations

import numpy as np

from mpishard.autodiff.ops import tanh
from mpishard.parallel.tensor.sequence import (gather_from_sp, gathered_linear, reduce_scatter_to_sp,
                                      scatter_to_sp)
from mpishard.parallel.tensor.ops import reduce_from_tp

ROWS, COLS = 2, 3   # rows per rank, columns


def _gather(comm, x, w):
    """F = g(sum(tanh(gather(x)) * w_r)): the backward sums every rank's share of each row."""
    return reduce_from_tp((tanh(gather_from_sp(x, comm)) * w).sum(), comm)


def _gather_transposed(comm, x, w):
    """Gather of a transposed block; the gradient arrives transposed too."""
    return reduce_from_tp((gather_from_sp(x.T, comm).T * w).sum(), comm)


def _reduce_scatter(comm, x, w):
    """F = g(sum(tanh(reduce_scatter(x)) * w_r)) from each rank's partial sum ``x``."""
    return reduce_from_tp((tanh(reduce_scatter_to_sp(x, comm)) * w).sum(), comm)


def _reduce_scatter_transposed(comm, x, w):
    return reduce_from_tp((reduce_scatter_to_sp(x.T, comm).T * w).sum(), comm)


def _scatter(comm, w, x):
    """F = g(sum(tanh(scatter(x)) * w_r)) of a replicated ``x``."""
    return reduce_from_tp((tanh(scatter_to_sp(x, comm)) * w).sum(), comm)


def _scatter_then_gather(comm, w, x):
    """gather(scatter(x.T)) is x.T again, and its backward sums every rank's gradient."""
    return reduce_from_tp((gather_from_sp(scatter_to_sp(x.T, comm), comm) * w).sum(), comm)


def _gathered_linear(comm, x, w, b, u):
    """A column shard ``w, b`` of a layer fed this rank's rows ``x``, weighted by ``u``."""
    return reduce_from_tp((tanh(gathered_linear(x, w, b, comm)) * u).sum(), comm)


def _replicated(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape)


#: op name -> ``case(rng, comm) -> (fn, split arrays, replicated arrays)``
SP_CASES = {
    "gather_from_sp": [
        lambda r, comm: (_gather, [r.standard_normal((ROWS, COLS)),
                                   r.standard_normal((ROWS * comm.size, COLS))], []),
        lambda r, comm: (_gather_transposed, [r.standard_normal((COLS, ROWS)),
                                              r.standard_normal((COLS, ROWS * comm.size))], []),
    ],
    "reduce_scatter_to_sp": [
        lambda r, comm: (_reduce_scatter, [r.standard_normal((ROWS * comm.size, COLS)),
                                           r.standard_normal((ROWS, COLS))], []),
        lambda r, comm: (_reduce_scatter_transposed,
                         [r.standard_normal((COLS, ROWS * comm.size)),
                          r.standard_normal((COLS, ROWS))], []),
    ],
    "gathered_linear": [
        lambda r, comm: (_gathered_linear, [r.standard_normal((ROWS, COLS)),
                                            r.standard_normal((2, COLS)), r.standard_normal(2),
                                            r.standard_normal((ROWS * comm.size, 2))], []),
    ],
    "scatter_to_sp": [
        lambda r, comm: (_scatter, [r.standard_normal((ROWS, COLS))],
                         [_replicated(21, ROWS * comm.size, COLS)]),
        lambda r, comm: (_scatter_then_gather, [r.standard_normal((ROWS * comm.size, COLS))],
                         [_replicated(22, COLS, ROWS * comm.size)]),
    ],
}

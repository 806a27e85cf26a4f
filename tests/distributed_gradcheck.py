"""Gradient checks of ops that communicate: the group of ranks as one function.

A tensor-parallel op is only correct as part of a computation spread over the
group: ``copy_to_tp``'s backward sums the gradient contributions every rank
computed. So the check treats the whole group as one function ``F`` of every
rank's inputs, computed (collectively) to the same scalar on every rank:

* a *split* input is a different variable on each rank; the numerical
  derivative perturbs one element on one rank at a time (every rank evaluates
  ``F`` in lockstep, so the collectives inside pair up);
* a *replicated* input is one variable the ranks share; it is perturbed on
  every rank at once, and its analytic gradient is what every rank's backward
  leaves in it.

``DISTRIBUTED_CASES`` maps each communicating op's name to cases; the
every-op test in test_autodiff_gradcheck.py requires one for each.
"""
from __future__ import annotations

import numpy as np

from mpishard.autodiff import Tensor
from mpishard.parallel import copy_to_tp, reduce_from_tp, vocab_parallel_cross_entropy


def distributed_gradcheck(comm, fn, split, replicated=(), eps: float = 1e-6) -> float:
    """Largest relative error (by norm, over all ranks) between backward and differences.

    Args:
        comm: the group (a Communicator).
        fn: ``fn(comm, *split_tensors, *replicated_tensors) -> scalar Tensor``, the
            same value on every rank.
        split: this rank's float64 arrays (a variable per rank; sizes may differ).
        replicated: float64 arrays equal on every rank.
    """
    arrays = [np.array(a, np.float64) for a in (*split, *replicated)]
    tensors = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    fn(comm, *tensors).backward()
    analytic = [t.grad if t.grad is not None else np.zeros_like(a)
                for t, a in zip(tensors, arrays)]

    def value():
        return float(fn(comm, *[Tensor(a) for a in arrays]).data)

    numeric = [np.zeros_like(a) for a in arrays]
    sizes = comm.all_gather_obj([a.size for a in arrays[:len(split)]])
    for i in range(len(arrays)):
        owners = range(comm.size) if i < len(split) else [None]   # None: every rank at once
        for owner in owners:
            count = sizes[owner][i] if owner is not None else arrays[i].size
            for j in range(count):
                mine = owner is None or owner == comm.rank
                flat = arrays[i].reshape(-1)
                saved = flat[j] if mine else None
                if mine:
                    flat[j] = saved + eps
                plus = value()
                if mine:
                    flat[j] = saved - eps
                minus = value()
                if mine:
                    flat[j] = saved
                    numeric[i].reshape(-1)[j] = (plus - minus) / (2 * eps)
    worst = 0.0
    for a, n in zip(analytic, numeric):
        scale = max(np.linalg.norm(a), np.linalg.norm(n), 1e-12)
        worst = max(worst, float(np.linalg.norm(a - n) / scale))
    return comm.all_reduce_obj(worst, op="max")


def _copy_then_reduce(comm, w, x):
    """F = g(sum(f(x) * w_r)): f's backward must sum every rank's share of dF/dx."""
    return reduce_from_tp((copy_to_tp(x, comm) * w).sum(), comm)


def _reduce(comm, x, c):
    """F = sum(g(x_r) * c): the sum over ranks, then a replicated projection."""
    return (reduce_from_tp(x, comm) * c).sum()


def _vocab_loss(comm, logits, vocab, n_rows):
    """Logits ``(n_rows, V_r)`` of vocabulary ``vocab`` split unevenly over the ranks."""
    base, extra = divmod(vocab, comm.size)
    start = comm.rank * base + min(comm.rank, extra)
    targets = np.array([0, vocab - 1, -100, vocab // 2, 1][:n_rows])
    return vocab_parallel_cross_entropy(logits, targets, comm, start)


def _vocab_case(r, comm, vocab=7, n_rows=5):
    base, extra = divmod(vocab, comm.size)
    local = base + (1 if comm.rank < extra else 0)
    return (lambda c, lg: _vocab_loss(c, lg, vocab, n_rows)), [r.standard_normal((n_rows, local))], []


#: op name -> ``case(rng, comm) -> (fn, split arrays, replicated arrays)``
DISTRIBUTED_CASES = {
    "copy_to_tp": [lambda r, comm: (_copy_then_reduce, [r.standard_normal((2, 3))],
                                    [np.random.default_rng(11).standard_normal((2, 3))])],
    "reduce_from_tp": [lambda r, comm: (_reduce, [r.standard_normal((3, 2))],
                                        [np.random.default_rng(12).standard_normal((3, 2))])],
    "vocab_parallel_cross_entropy": [_vocab_case],
}

# Context-, sequence- and expert-parallel ops keep their cases beside their own tests.
from cp_cases import CP_CASES  # noqa: E402
from ep_cases import EP_CASES  # noqa: E402
from sp_cases import SP_CASES  # noqa: E402

DISTRIBUTED_CASES.update(CP_CASES)
DISTRIBUTED_CASES.update(SP_CASES)
DISTRIBUTED_CASES.update(EP_CASES)

"""Collectives as autodiff ops: Megatron-LM's f and g, and the vocabulary-parallel loss.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models
Using Model Parallelism" (2019, arXiv:1909.08053), section 3 and figure 3:

- ``f`` = :func:`copy_to_tp`: identity in forward, all-reduce (sum) of the
  gradient in backward. It sits in front of a column-parallel layer, whose
  input is replicated but whose ranks each produce part of its gradient.
- ``g`` = :func:`reduce_from_tp`: all-reduce (sum) in forward, identity in
  backward. It sits after a row-parallel layer, whose ranks each produce a
  partial sum of the output.
- :func:`vocab_parallel_cross_entropy`: the mean cross-entropy from logits split
  by vocabulary, with three all-reduces of one number per row.

Each is registered in ``OPS`` like every other op and has a gradient check
that runs across ranks (tests/parallel/test_parallel_tp_ops.py): the tp group as one
function, its inputs perturbed rank by rank. ``f`` and ``g`` return their input
unchanged when the communicator has one rank. bfloat16 activations and
gradients are summed in float32 (MPI has no bfloat16 arithmetic) and cast
back; float16 ones are summed as they are.
"""
from __future__ import annotations

import numpy as np

from mpishard.autodiff.graph import as_tensor, make_result, register_op
from mpishard.autodiff.rows import up
from mpishard.autodiff.softmax_ops import at_least_one, valid_count
from mpishard.autodiff.tensor import Tensor
from mpishard.core.backend import xp_of

__all__ = ["copy_to_tp", "reduce_from_tp", "vocab_parallel_cross_entropy"]


def summed_copy(array, comm):
    """A contiguous copy of ``array`` summed over ``comm`` (bfloat16 via float32).

    ``xp.array(..., order="C")`` rather than ``ascontiguousarray``: the latter
    turns a 0-d array (a summed scalar) into shape ``(1,)``.
    """
    xp = xp_of(array)
    if array.dtype.name == "bfloat16":
        wide = xp.array(array, dtype=xp.float32, order="C")
        comm.all_reduce(wide, op="sum")
        return wide.astype(array.dtype)
    out = xp.array(array, order="C")
    comm.all_reduce(out, op="sum")
    return out


@register_op
def copy_to_tp(x, comm) -> Tensor:
    """Megatron's ``f``: identity forward, gradient all-reduced over ``comm`` in backward."""
    x = as_tensor(x)
    if comm.size == 1:
        return x

    def backward(g):
        return (summed_copy(g, comm),)
    return make_result(x.data, (x,), backward, "copy_to_tp")


@register_op
def reduce_from_tp(x, comm) -> Tensor:
    """Megatron's ``g``: forward all-reduce (sum) over ``comm``, identity backward."""
    x = as_tensor(x)
    if comm.size == 1:
        return x
    return make_result(summed_copy(x.data, comm), (x,), lambda g: (g,), "reduce_from_tp")


@register_op
def vocab_parallel_cross_entropy(logits, targets, tp, vocab_start: int,
                                 ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy from logits split by vocabulary, without gathering them.

    Args:
        logits: ``(N, V_local)``, this rank's vocabulary columns
            ``[vocab_start, vocab_start + V_local)``.
        targets: ``(N,)`` global token ids (``ignore_index`` left out).
        tp: the tensor-parallel Communicator.

    Megatron-LM's recipe: all-reduce the row maxima (max), the sums of
    exponentials (sum) and the target logits (sum, from the rank that holds
    each target); the gradient ``softmax - onehot`` needs no communication.
    Forward keeps the row maxima and sums, not the exponentiated logits:
    backward recomputes them (the same operations, so the same values).
    """
    logits = as_tensor(logits)
    t = targets.data if isinstance(targets, Tensor) else targets

    def float_logits():                       # (N, V_local); 16-bit: the softmax in float32
        return up(logits.data.reshape(-1, logits.shape[-1]))
    x = float_logits()
    xp = xp_of(x)
    n_local = x.shape[1]
    t = t.reshape(-1)
    rows = xp.arange(x.shape[0])
    valid = t != ignore_index
    mine = (t >= vocab_start) & (t < vocab_start + n_local) & valid
    local_t = xp.where(mine, t - vocab_start, 0)
    row_max = x.max(axis=1)
    tp.all_reduce(row_max, op="max")
    e = x - row_max[:, None]
    picked = xp.where(mine, e[rows, local_t], 0.0).astype(x.dtype)
    xp.exp(e, out=e)
    sums = e.sum(axis=1)
    tp.all_reduce(sums, op="sum")
    tp.all_reduce(picked, op="sum")
    per_row = xp.log(sums) - picked
    n_valid, _ = valid_count(valid, x.dtype)     # on a device: no host read
    if xp is not np or n_valid:
        loss = (per_row * valid).sum() / n_valid
    else:
        loss = per_row.sum() * float("nan")

    del e

    def backward(g):
        p = float_logits() - row_max[:, None]
        xp.exp(p, out=p)
        p *= (1.0 / sums)[:, None]                                  # local softmax columns
        p[rows, local_t] -= mine.astype(p.dtype)
        p *= valid[:, None]
        p *= g / at_least_one(n_valid)
        return (p.astype(logits.data.dtype, copy=False).reshape(logits.shape),)
    return make_result(xp.asarray(loss, dtype=x.dtype), (logits,), backward,
                       "vocab_parallel_cross_entropy")

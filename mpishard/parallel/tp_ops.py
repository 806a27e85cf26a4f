"""Collectives as autodiff ops: Megatron-LM's f and g for tensor parallelism.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models
Using Model Parallelism" (2019, arXiv:1909.08053), section 3 and figure 3:

- ``f`` = :func:`copy_to_tp`: identity in forward, all-reduce (sum) of the
  gradient in backward. It sits in front of a column-parallel layer, whose
  input is replicated but whose ranks each produce part of its gradient.
- ``g`` = :func:`reduce_from_tp`: all-reduce (sum) in forward, identity in
  backward. It sits after a row-parallel layer, whose ranks each produce a
  partial sum of the output.

Both return their input unchanged when the communicator has one rank.
bfloat16 activations and gradients are summed in float32 (MPI has no
bfloat16 arithmetic) and cast back; float16 ones are summed as they are.
"""
from __future__ import annotations

from ..autodiff.ops import as_tensor, make_result
from ..autodiff.tensor import Tensor

__all__ = ["copy_to_tp", "reduce_from_tp"]


def _summed(array, comm):
    """A contiguous copy of ``array`` summed over ``comm`` (bfloat16 via float32)."""
    from ..backend import xp_of  # noqa: PLC0415

    xp = xp_of(array)
    if array.dtype.name == "bfloat16":
        wide = xp.ascontiguousarray(array, dtype=xp.float32)
        comm.all_reduce(wide, op="sum")
        return wide.astype(array.dtype)
    out = xp.ascontiguousarray(array).copy()
    comm.all_reduce(out, op="sum")
    return out


def copy_to_tp(x, comm) -> Tensor:
    """Megatron's ``f``: identity forward, gradient all-reduced over ``comm`` in backward."""
    x = as_tensor(x)
    if comm.size == 1:
        return x

    def backward(g):
        return (_summed(g, comm),)
    return make_result(x.data, (x,), backward, "copy_to_tp")


def reduce_from_tp(x, comm) -> Tensor:
    """Megatron's ``g``: forward all-reduce (sum) over ``comm``, identity backward."""
    x = as_tensor(x)
    if comm.size == 1:
        return x
    return make_result(_summed(x.data, comm), (x,), lambda g: (g,), "reduce_from_tp")

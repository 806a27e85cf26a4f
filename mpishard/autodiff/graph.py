"""What every op shares: registering, constants as Tensors, results in the graph, unbroadcast.

:mod:`.ops` (elementwise math, matmul, reductions), :mod:`.shape_ops`,
:mod:`.nn_ops` and the others build on these helpers; :func:`register_op` lists each
differentiable op in :data:`.tensor.OPS`, where the test suite gradchecks each one
and Tensor's operators find theirs.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from mpishard.core.backend import xp_of
from mpishard.autodiff.tensor import OPS, Tensor, is_grad_enabled
from mpishard.autodiff import profile as _profile

__all__ = ["register_op", "as_tensor", "as_tensors", "make_result", "unbroadcast"]


def register_op(fn: Callable) -> Callable:
    """Add ``fn`` to :data:`.tensor.OPS` under its name."""
    OPS[fn.__name__] = fn
    return fn


# -- helpers ---------------------------------------------------------------

def as_tensor(value, like=None) -> Tensor:
    """Wrap arrays and scalars as constant Tensors; Tensors pass through.

    A Python constant (a number, a list) that meets the Tensor ``like`` is made
    on ``like``'s array module, with the dtype NumPy gives it: a device op
    cannot take a NumPy array (CuPy refuses it), and a constant must not turn
    into one just because it was written as a Python number.
    """
    if isinstance(value, Tensor):
        return value
    if isinstance(like, Tensor) and _is_constant(value):
        xp = xp_of(like.data)
        if xp is not np:
            return Tensor(xp.asarray(np.asarray(value)))
    return Tensor(value)


def as_tensors(a, b) -> tuple:
    """Both operands of a binary op as Tensors, a constant on the other's array module."""
    a = as_tensor(a, b)
    return a, as_tensor(b, a)


def _is_constant(value) -> bool:
    return not (hasattr(value, "__array_interface__") or hasattr(value, "__cuda_array_interface__"))


def make_result(data, parents: tuple, backward: Callable, op: str) -> Tensor:
    """Create an op's output and, when needed, attach it to the graph."""
    if _profile.active is not None:                # see profile.py
        _profile.active.forward_done(op)
    out = Tensor(data)
    if is_grad_enabled():
        for p in parents:
            if p is not None and p.requires_grad:
                out.requires_grad = True
                out._parents = parents
                out._backward = backward
                out._op = op
                break
    return out


def unbroadcast(grad, shape: tuple):
    """Sum ``grad`` over the axes that broadcasting added or stretched, to ``shape``."""
    shape = tuple(shape)
    if grad.shape == shape:
        return grad
    extra = grad.ndim - len(shape)
    if extra > 0:
        grad = grad.sum(axis=tuple(range(extra)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if stretched:
        grad = grad.sum(axis=stretched, keepdims=True)
    return grad.reshape(shape)

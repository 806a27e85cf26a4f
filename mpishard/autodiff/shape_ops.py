"""Shape ops: reshape, permute, transpose, indexing, concat and split, forward beside backward.

Each backward maps the gradient back to the input's layout (indexing scatters
it, concat splits it, split concatenates it). See :mod:`.ops` for the
conventions every op follows.
"""
from __future__ import annotations

import builtins
from typing import Sequence

import numpy as np

from mpishard.core.backend import xp_of
from mpishard.autodiff.graph import as_tensor, make_result, register_op
from mpishard.autodiff.rows import scatter_add
from mpishard.autodiff.tensor import Tensor

__all__ = ["reshape", "permute", "transpose", "getitem", "concat", "split"]


@register_op
def reshape(a, *shape) -> Tensor:
    """View with a new shape (``-1`` allowed once)."""
    a = as_tensor(a)
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    try:
        out = a.data.reshape(shape)
    except ValueError:
        raise ValueError(f"reshape: cannot reshape {tuple(a.shape)} "
                         f"({a.size} elements) into {shape}") from None
    return make_result(out, (a,), lambda g: (g.reshape(a.shape),), "reshape")


@register_op
def permute(a, *axes) -> Tensor:
    """Reorder dimensions (``numpy.transpose`` with explicit axes)."""
    a = as_tensor(a)
    if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
        axes = tuple(axes[0])
    if sorted(ax % builtins.max(a.ndim, 1) for ax in axes) != list(range(a.ndim)):
        raise ValueError(f"permute: axes {axes} are not a permutation of "
                         f"{a.ndim} dimensions (shape {tuple(a.shape)})")
    axes = tuple(ax % a.ndim for ax in axes)
    inverse = tuple(np.argsort(axes).tolist())
    return make_result(a.data.transpose(axes), (a,),
                       lambda g: (g.transpose(inverse),), "permute")


@register_op
def transpose(a, dim0: int = -2, dim1: int = -1) -> Tensor:
    """Swap two dimensions (the last two by default)."""
    a = as_tensor(a)
    axes = list(range(a.ndim))
    axes[dim0], axes[dim1] = axes[dim1], axes[dim0]
    return permute(a, tuple(axes))


def _unwrap_index(index):
    if isinstance(index, Tensor):
        return index.data
    if isinstance(index, tuple):
        return tuple(i.data if isinstance(i, Tensor) else i for i in index)
    return index


def _is_basic_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(isinstance(i, (int, slice, type(None), type(Ellipsis))) for i in items)


@register_op
def getitem(a, index) -> Tensor:
    """``a[index]``: slices, integers, ``None``, ``...`` and integer/boolean arrays."""
    a = as_tensor(a)
    index = _unwrap_index(index)
    out = a.data[index]
    basic = _is_basic_index(index)

    def backward(g):
        xp = xp_of(g)
        full = xp.zeros(a.shape, dtype=g.dtype)
        if basic:
            full[index] = g
        else:
            scatter_add(full, index, g)
        return (full,)
    return make_result(out, (a,), backward, "getitem")


@register_op
def concat(tensors: Sequence, axis: int = 0) -> Tensor:
    """Join tensors along ``axis``."""
    tensors = tuple(as_tensor(t) for t in tensors)
    if not tensors:
        raise ValueError("concat: needs at least one tensor")
    xp = xp_of(tensors[0].data)
    try:
        out = xp.concatenate([t.data for t in tensors], axis=axis)
    except ValueError:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise ValueError(f"concat: shapes {shapes} do not match outside axis {axis}") from None
    sizes = [t.shape[axis] for t in tensors]
    bounds = np.cumsum(sizes)[:-1].tolist()

    def backward(g):
        return tuple(xp_of(g).split(g, bounds, axis=axis))
    return make_result(out, tensors, backward, "concat")


@register_op
def split(a, sections, axis: int = 0) -> list:
    """Split into pieces: ``sections`` is a count of equal parts or a list of sizes."""
    a = as_tensor(a)
    n = a.shape[axis]
    if isinstance(sections, int):
        if sections <= 0 or n % sections:
            raise ValueError(f"split: dimension {axis} of size {n} does not split into "
                             f"{sections} equal parts; pass a list of sizes")
        sizes = [n // sections] * sections
    else:
        sizes = list(sections)
        if builtins.sum(sizes) != n:
            raise ValueError(f"split: sizes {sizes} add up to {builtins.sum(sizes)}, "
                             f"not the size {n} of dimension {axis}")
    pieces, start = [], 0
    ax = axis % a.ndim
    for size in sizes:
        index = (slice(None),) * ax + (slice(start, start + size),)
        pieces.append(getitem(a, index))
        start += size
    return pieces

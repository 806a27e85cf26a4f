"""Flat buffers: many arrays in one contiguous buffer, the optimizer's view of one, and
a parameter's gradient moved into its slot of one.

One collective on one large buffer beats many on small ones (the per-call
latency is paid once), so data parallelism all-reduces *buckets* of gradients
and ZeRO keeps parameters, gradients and optimizer state as flat buffers
padded to a multiple of the axis size. This module is the one place that
computes such a layout.

    layout = FlatIndex.of([w.shape, b.shape], dtype="float32", pad_to=comm.size)
    flat = layout.flatten([w, b])                 # (layout.padded_numel,), zero padding
    comm.all_reduce(flat, op="avg")
    layout.unflatten_into(flat, [w, b])           # copy the averages back
    shard = comm.reduce_scatter(flat)             # (layout.padded_numel // comm.size,)

[Note: flat index]
Arrays are laid out in the order given, each C-contiguous, without gaps,
followed by zero padding up to ``padded_numel`` (a multiple of ``pad_to``). So
``offsets[i]`` is where array ``i`` starts in the flat buffer, and with
``pad_to = n`` the buffer splits into ``n`` equal shards where shard ``r``
covers elements ``[r * shard, (r + 1) * shard)``. Checkpoint manifests record
these offsets; code that needs them takes them from a FlatIndex.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

from mpishard.core.backend import xp_of

__all__ = ["FlatIndex", "FlatShard", "padded_size", "stage_grad"]


def padded_size(numel: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= numel``."""
    if multiple < 1:
        raise ValueError(f"padded_size: multiple={multiple} must be >= 1")
    return -(-numel // multiple) * multiple


@dataclass(frozen=True)
class FlatIndex:
    """Where each array lives in a flat buffer (see [Note: flat index]).

    Attributes:
        shapes: the arrays' shapes, in order.
        dtype: their common dtype.
        offsets: start of each array in the flat buffer.
        numel: elements of all arrays together.
        padded_numel: ``numel`` rounded up to a multiple of ``pad_to``.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtype: np.dtype
    offsets: tuple[int, ...]
    numel: int
    padded_numel: int

    @classmethod
    def of(cls, shapes, dtype, pad_to: int = 1) -> "FlatIndex":
        """Lay out arrays of ``shapes`` and ``dtype``, padded to ``pad_to``."""
        shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        offsets, total = [], 0
        for shape in shapes:
            offsets.append(total)
            total += prod(shape)
        return cls(shapes, np.dtype(dtype), tuple(offsets), total,
                   padded_size(total, pad_to))

    @classmethod
    def of_arrays(cls, arrays, pad_to: int = 1) -> "FlatIndex":
        """The layout of ``arrays`` (which must share one dtype)."""
        dtypes = {str(a.dtype) for a in arrays}
        if len(dtypes) > 1:
            raise ValueError(f"FlatIndex: arrays have dtypes {sorted(dtypes)}; flatten "
                             f"one dtype per buffer (group them by dtype first)")
        dtype = arrays[0].dtype if arrays else np.float32
        return cls.of([a.shape for a in arrays], dtype, pad_to)

    def sizes(self) -> tuple[int, ...]:
        """Elements of each array."""
        return tuple(prod(s) for s in self.shapes)

    def _check_flat(self, flat, where: str) -> None:
        # Positions only: the same layout serves a float32 master and its 16-bit copy.
        if flat.ndim != 1 or flat.size != self.padded_numel:
            raise ValueError(
                f"{where}: flat buffer has shape {tuple(flat.shape)}; this layout needs "
                f"({self.padded_numel},) elements")

    def empty(self, xp=np):
        """An uninitialised flat buffer with zeroed padding."""
        flat = xp.empty((self.padded_numel,), dtype=self.dtype)
        flat[self.numel:] = 0
        return flat

    def flatten(self, arrays, out=None):
        """Copy ``arrays`` into a flat buffer (``out``, or a new one); return it.

        ``None`` entries are written as zeros.
        """
        if len(arrays) != len(self.shapes):
            raise ValueError(f"flatten: got {len(arrays)} arrays, the layout has "
                             f"{len(self.shapes)}")
        if out is None:
            present = [a for a in arrays if a is not None]
            out = self.empty(xp_of(present[0]) if present else np)
        else:
            self._check_flat(out, "flatten")
            out[self.numel:] = 0
        for view, a, shape in zip(self.views(out), arrays, self.shapes):
            if a is None:          # e.g. a parameter that received no gradient
                view[...] = 0
                continue
            if tuple(a.shape) != shape:
                raise ValueError(f"flatten: array of shape {tuple(a.shape)} where the "
                                 f"layout has {shape}")
            view[...] = a
        return out

    def views(self, flat) -> list:
        """Views into ``flat``, one per array, with the arrays' shapes (no copies)."""
        self._check_flat(flat, "views")
        return [flat[o:o + prod(s)].reshape(s) for o, s in zip(self.offsets, self.shapes)]

    def unflatten_into(self, flat, arrays) -> None:
        """Copy the flat buffer's contents back into ``arrays`` (in place)."""
        for view, a in zip(self.views(flat), arrays):
            a[...] = view


class FlatShard:
    """What the optimizer updates under ZeRO: this rank's slice of one unit.

    Attributes:
        data: 1-D array of ``shard_size`` elements (updated in place).
        grad: gradient of the same size after ``reduce_grads`` (else ``None``).
        decay_ranges: element ranges of ``data`` that get weight decay.
        name: the unit's name, for messages.
    """

    __slots__ = ("data", "grad", "decay_ranges", "name")

    def __init__(self, data, decay_ranges: tuple, name: str):
        self.data, self.grad, self.decay_ranges, self.name = data, None, decay_ranges, name

    def __repr__(self) -> str:
        return f"FlatShard({self.name!r}, {self.data.size} elements)"


def stage_grad(p, view) -> None:
    """``p``'s gradient into ``view`` (its slot in a strategy's gradient buffer), unless
    backward computed it there already (``grad_out``, see [Note: gradient buffers] in
    mpishard/autodiff/tensor.py); zeros when it has none. ``view`` becomes ``p.grad``,
    so a next micro-batch adds into it."""
    if p.grad is None:
        view[...] = 0
    elif p.grad is not view:
        view[...] = p.grad
    p.grad = view

"""Flat units: groups of parameters laid out in one padded buffer, sharded over dp.

[Note: flat unit layout]
A unit's parameters, in ``named_parameters`` order, are flattened one after the
other into a single buffer of ``numel`` elements, padded with zeros to
``padded = shard_size * dp_size`` so the dp ranks can own equal contiguous
slices: dp rank ``r`` owns ``[r * shard_size, (r + 1) * shard_size)``. A rank
may own only padding (a unit smaller than the dp size); padding stays zero in
parameters, gradients and optimizer state. Each parameter's placement is written
to its :class:`~mpishard.nn.ShardSpec` (``spec.flat``) so the checkpoint
manifest and the memory planner read the same layout.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..nn.parameter import FlatPlacement, Parameter

__all__ = ["FlatUnit", "FlatShard"]


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


class FlatUnit:
    """One unit's layout (see [Note: flat unit layout]).

    Args:
        name: unit name (module path, ``""`` for the root remainder).
        named_params: ``(name, Parameter)`` pairs in order.
        dp_size, dp_rank: the data-parallel axis.
        module: the module whose forward this unit wraps (``None`` for the root).
    """

    def __init__(self, name: str, named_params: list, dp_size: int, dp_rank: int,
                 module=None):
        self.name, self.module = name, module
        self.names = [n for n, _ in named_params]
        self.params: list[Parameter] = [p for _, p in named_params]
        dtypes = {str(p.dtype) for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"unit {name or '<root>'!r} mixes parameter dtypes {sorted(dtypes)}; "
                             f"put parameters of different dtypes in different units")
        self.dtype = np.dtype(dtypes.pop()) if dtypes else np.dtype("float32")
        self.sizes = [p.size for p in self.params]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(int).tolist()
        self.numel = self.offsets[-1]
        self.shard_size = max(1, math.ceil(self.numel / dp_size))
        self.padded = self.shard_size * dp_size
        self.shard_start = dp_rank * self.shard_size
        self.shard_stop = self.shard_start + self.shard_size
        # Buffers and state the owning strategy attaches (see zero.py).
        self.full = None          # full flat parameters while unsharded
        self.target = None        # FlatShard handed to the optimizer
        self.grad_shard = None    # this rank's averaged gradient slice
        self.grad_full = None     # full flat gradients (stage 1 only)
        self.gather = None        # (handle, buffer) of a prefetch in flight
        self.ready = 0            # gradients final so far in this backward
        self.reductions = 0       # reduce-scatters launched this step
        for p, offset, size in zip(self.params, self.offsets, self.sizes):
            p.spec = dataclasses.replace(p.spec, flat=FlatPlacement(
                name, offset, size, self.shard_start, self.shard_stop))

    @property
    def label(self) -> str:
        return self.name or "<root>"

    def decay_ranges(self) -> tuple:
        """Ranges in shard coordinates that belong to parameters with weight decay."""
        ranges = []
        for p, offset, size in zip(self.params, self.offsets, self.sizes):
            if not p.decay:
                continue
            start = max(offset, self.shard_start) - self.shard_start
            stop = min(offset + size, self.shard_stop) - self.shard_start
            if stop > start:
                ranges.append((start, stop))
        return tuple(ranges)

    def views(self, flat) -> list:
        """Parameter-shaped views into a full flat buffer (``padded`` elements)."""
        return [flat[o:o + n].reshape(p.shape)
                for p, o, n in zip(self.params, self.offsets, self.sizes)]

    def flatten(self, arrays, out) -> None:
        """Copy parameter-shaped ``arrays`` into ``out`` (``None`` entries become zeros)."""
        for a, o, n in zip(arrays, self.offsets, self.sizes):
            if a is None:
                out[o:o + n] = 0
            else:
                out[o:o + n] = a.reshape(-1)
        out[self.numel:] = 0

    def shard_range_of(self, index: int) -> tuple:
        """``(lo, hi)`` of parameter ``index``'s owned elements in this rank's shard."""
        start, stop = self.params[index].spec.flat.owned
        lo = self.offsets[index] + start - self.shard_start
        return lo, lo + stop - start

    def owned_piece(self, index: int, full_param) -> tuple:
        """``(shard_offset, values)``: the part of parameter ``index`` this rank owns."""
        start, stop = self.params[index].spec.flat.owned
        offset = self.offsets[index] + start - self.shard_start
        return offset, np.asarray(full_param).reshape(-1)[start:stop]

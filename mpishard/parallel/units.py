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

from ..nn.parameter import FlatPlacement, Parameter
from .flat import FlatLayout

__all__ = ["FlatUnit"]


class FlatUnit:
    """One unit's layout (see [Note: flat unit layout]), a :class:`FlatLayout` padded to dp.

    Args:
        name: unit name (module path, ``""`` for the root remainder).
        named_params: ``(name, Parameter)`` pairs in order (at least one).
        dp_size, dp_rank: the data-parallel axis.
        module: the module whose forward this unit wraps (``None`` for the root).
    """

    def __init__(self, name: str, named_params: list, dp_size: int, dp_rank: int,
                 module=None):
        self.name, self.module = name, module
        self.names = [n for n, _ in named_params]
        self.params: list[Parameter] = [p for _, p in named_params]
        if not self.params:
            raise ValueError(f"unit {self.label!r} has no parameters; leave it out of the plan")
        dtypes = {str(p.dtype) for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"unit {self.label!r} mixes parameter dtypes {sorted(dtypes)}; "
                             f"put parameters of different dtypes in different units")
        self.layout = FlatLayout.of([p.shape for p in self.params], dtypes.pop(), pad_to=dp_size)
        self.dtype = self.layout.dtype
        self.offsets = self.layout.offsets
        self.numel = self.layout.numel
        self.padded = self.layout.padded_numel
        self.shard_size = self.padded // dp_size
        self.shard_start = dp_rank * self.shard_size
        self.shard_stop = self.shard_start + self.shard_size
        # Buffers and state the owning strategy attaches (see zero.py).
        self.full = None          # full flat parameters while unsharded
        self.target = None        # FlatShard handed to the optimizer
        self.grad_shard = None    # this rank's averaged gradient slice
        self.grad_full = None     # full flat gradients (stage 1 only)
        self.compute_shard = None  # 16-bit copy of the shard (stage 3, mixed precision)
        self.gather = None        # (handle, buffer) of a prefetch in flight
        self.ready = 0            # gradients final so far in this backward
        self.reductions = 0       # reduce-scatters launched this step
        for p, offset in zip(self.params, self.offsets):
            p.spec = dataclasses.replace(p.spec, flat=FlatPlacement(
                name, offset, p.size, self.shard_start, self.shard_stop))

    @property
    def label(self) -> str:
        return self.name or "<root>"

    def decay_ranges(self) -> tuple:
        """Ranges in shard coordinates that belong to parameters with weight decay."""
        ranges = [self.shard_range_of(i) for i, p in enumerate(self.params) if p.decay]
        return tuple((lo, hi) for lo, hi in ranges if hi > lo)

    def views(self, flat) -> list:
        """Parameter-shaped views into a full flat buffer (``padded`` elements)."""
        return self.layout.views(flat)

    def flatten(self, arrays, out) -> None:
        """Copy parameter-shaped ``arrays`` into ``out`` (``None`` entries become zeros)."""
        self.layout.flatten(arrays, out)

    def shard_range_of(self, index: int) -> tuple:
        """``(lo, hi)`` of parameter ``index``'s owned elements in this rank's shard."""
        start, stop = self.params[index].spec.flat.owned
        lo = self.offsets[index] + start - self.shard_start
        return lo, lo + stop - start

    def owned_piece(self, index: int, full_param) -> tuple:
        """``(shard_offset, values)``: the part of parameter ``index`` this rank owns."""
        start, stop = self.params[index].spec.flat.owned
        return self.shard_range_of(index)[0], full_param.reshape(-1)[start:stop]

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

from mpishard.nn.parameter import FlatPlacement, Parameter
from mpishard.parallel.flat import FlatIndex
from mpishard.parallel.replicas import is_expert_param

__all__ = ["FlatUnit", "build_units", "expert_units"]


class FlatUnit:
    """One unit's layout (see [Note: flat unit layout]), a :class:`FlatIndex` padded to dp.

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
        self.layout = FlatIndex.of([p.shape for p in self.params], dtypes.pop(), pad_to=dp_size)
        self.dtype = self.layout.dtype
        self.offsets = self.layout.offsets
        self.numel = self.layout.numel
        self.padded = self.layout.padded_numel
        self.shard_size = self.padded // dp_size
        self.shard_start = dp_rank * self.shard_size
        self.shard_stop = self.shard_start + self.shard_size
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


def build_units(module, unit_names, dp_size: int, dp_rank: int, root_unit: bool = True,
               groups=None):
    """Build the :class:`FlatUnit` list: named units in order, then the root remainder.

    A unit may sit inside another (a block's experts inside the block): the outer
    one leaves out what the inner holds, in either order. ``groups`` maps unit names to
    the ``(size, rank)`` they shard over instead of ``(dp_size, dp_rank)`` (expert
    units over the ranks holding the same experts).

    Raises ``ValueError`` (identically on every rank) for an unknown unit, a
    parameter in two units, or one in none (with ``root_unit=False``).
    """
    modules = dict(module.named_modules())
    canonical = {id(p): name for name, p in module.named_parameters()}
    groups = groups or {}
    for unit_name in unit_names:
        if unit_name not in modules or unit_name == "":
            raise ValueError(f"unit {unit_name!r} is not a sub-module of "
                             f"{type(module).__name__}; name modules as in named_modules(), "
                             f"e.g. 'transformer.h.0'")
    inner = {}      # parameter -> the innermost listed unit holding it
    for unit_name in sorted(set(unit_names), key=len):
        for _, p in modules[unit_name].named_parameters():
            inner[id(p)] = unit_name
    owner: dict[int, str] = {}
    units = []
    for unit_name in unit_names:
        named = []
        for _, p in modules[unit_name].named_parameters():
            if inner[id(p)] != unit_name and inner[id(p)].startswith(unit_name + "."):
                continue                  # a unit inside this one holds it
            if id(p) in owner:
                raise ValueError(f"parameter {canonical[id(p)]} is in two units, "
                                 f"{owner[id(p)]!r} and {unit_name!r}; list each module once "
                                 f"(a module inside another is its own unit)")
            owner[id(p)] = unit_name
            named.append((canonical[id(p)], p))
        size, rank = groups.get(unit_name, (dp_size, dp_rank))
        units.append(FlatUnit(unit_name, named, size, rank, modules[unit_name]))
    rest = [(n, p) for n, p in module.named_parameters() if id(p) not in owner]
    # A parameter shared with a module outside its unit would be needed while
    # that unit is released (e.g. a tied embedding): refuse.
    for mod_name, mod in modules.items():
        for p in mod._parameters.values():
            unit = owner.get(id(p))
            if unit is not None and not (mod_name == unit or mod_name.startswith(unit + ".")):
                raise ValueError(f"parameter {canonical[id(p)]} of unit {unit!r} is also used by "
                                 f"module {mod_name!r} outside it; keep tied parameters in one "
                                 f"unit (e.g. leave both in the root)")
    if rest:
        if not root_unit:
            raise ValueError(f"parameters in no unit: {', '.join(n for n, _ in rest)}; add units "
                             f"that cover them or pass root_unit=True")
        units.append(FlatUnit("", rest, dp_size, dp_rank, None))
    return units


def expert_units(module, unit_names) -> tuple:
    """``(unit names, expert unit names)``: ZeRO's units with every module that holds
    experts split over ep made a unit of its own, listed after the unit it sits in
    (the order forward calls them; its state shards over the ranks holding the same
    experts)."""
    experts = [name for name, m in module.named_modules()
               if any(p is not None and is_expert_param(p) for p in m._parameters.values())]
    out = []
    for name in unit_names:
        out.append(name)
        out += [e for e in experts if e.startswith(name + ".") and e not in out]
    out += [e for e in experts if e not in out]
    return out, experts

"""ZeRO's memory plan: per-rank bytes of stages 1-3 from the units the strategy builds.

Read by :meth:`ZeroStrategy.estimate_memory
<mpishard.parallel.zero.base.ZeroStrategy.estimate_memory>` (see [Note: flat unit
layout] in units.py and the planner in planner.py).
"""
from __future__ import annotations

from mpishard.nn.sharding import plan_of
from mpishard.planning.memory import MemoryEstimate, window_peak
from mpishard.parallel.zero.units import build_units, expert_units

__all__ = ["zero_memory_estimate"]


def zero_memory_estimate(model, sizes, stage: int, max_inflight: int) -> MemoryEstimate:
    """Per-rank bytes of stage ``stage`` (see [Note: flat unit layout]); the same
    units the strategy builds, read from the model's shapes, sharded over
    ``sizes.shard_size`` ranks (``dp_shard x cp``; experts split over ep over
    ``edp_shard``, ``ep`` times fewer) and, under hybrid sharding, each reduced
    shard averaged over ``dp_replicate``."""
    s, shard = sizes, sizes.shard_size
    names, experts = expert_units(model, list(plan_of(model).units))
    expert_shard = shard // s.ep
    units = _units(model, names, shard, expert_shard, experts)
    padded_n = sum(u.padded for u in units)
    shards_n = sum(u.shard_size for u in units)
    b, cb, rb = s.itemsize, s.compute_itemsize, s.reduce_itemsize
    # A reduction in flight holds its flat buffer, plus a receive buffer when the
    # reduce dtype is not the shard's (mixed precision). Stage 1 reduces from its
    # full gradient buffer (counted as grads), in backward's order.
    order = [u for u in units if u.module is not None][::-1] + [
        u for u in units if u.module is None]
    in_flight = [(0 if stage == 1 else u.padded * rb) + (u.shard_size * rb if rb != b else 0)
                 for u in order]
    plan = s.new_plan()
    copy = padded_n * cb if stage < 3 else (shards_n * cb if s.mixed else 0)

    def aliased(u):   # see ZeroUnit.allocate_grads (expert units are never aliased)
        return stage == 1 and shard == 1 and s.dp_replicate == 1 and rb == b and \
            u.name not in experts
    plan.steady = {"params": (shards_n * b if stage == 3 or s.mixed else 0) + copy,
                   "grads": sum(0 if aliased(u) else u.shard_size * b for u in units)
                   + (padded_n * rb if stage == 1 else 0),
                   "optim": s.n_states * shards_n * b}
    root = sum(u.padded * cb for u in units if u.module is None)
    gathered = root + _gathered_peak(units, experts, cb) if stage == 3 else 0
    plan.peak = {"gathered": gathered,
                 "comm": window_peak(in_flight, max_inflight + 1)}
    by_group = {"dp_shard_cp": 0, "edp_shard": 0}
    for u in units:
        group, n = ("edp_shard", expert_shard) if u.name in experts else ("dp_shard_cp",
                                                                          shard)
        if stage < 3:  # reduce-scatter the gradients, all-gather the compute copy
            moved = u.padded * (rb + cb)
        else:  # gather every block twice (forward, backward) per micro-batch, the
            # root once, reduce-scatter all once
            moved = (2 * s.micro_batches if u.module is not None else 1) * u.padded * cb \
                + u.padded * rb
        by_group[group] += (n - 1) / n * moved
    R = s.dp_replicate   # each unit's reduced shard, averaged over the replicas
    replicas = sum(int(round(2 * (R - 1) / R * u.shard_size * rb)) for u in units)
    plan.bus_bytes_by_group = {k: int(round(v)) for k, v in by_group.items()}
    plan.bus_bytes_by_group["dp_replicate"] = replicas
    plan.bus_bytes_per_step = sum(plan.bus_bytes_by_group.values())
    return plan


def _units(model, names, shard: int, expert_shard: int, experts) -> list:
    """The units, kept on a frozen model (a layout search plans the same stage for many
    strategies and batches; only the units' sizes are read from these)."""
    key = (tuple(names), shard, expert_shard)
    mine = model.structure_cache("zero_units")
    if key not in mine:
        mine[key] = build_units(model, names, shard, 0,
                               groups={n: (expert_shard, 0) for n in experts})
    return mine[key]


def _gathered_peak(units, experts, itemsize: int) -> int:
    """Stage 3's most gathered bytes at once over the block units (root aside), in the
    order forward calls them (see [Note: prefetch order] in parallel/zero/stage3.py): a unit with
    the one prefetched after it, and a unit inside another (a block's experts) also
    with that one, forward; in backward, with the one prefetched before its outer unit."""
    calls = [u for u in units if u.module is not None]
    size = [u.padded * itemsize for u in calls]
    index = {u.name: i for i, u in enumerate(calls)}

    def outer(i):
        name = calls[i].name
        return next((index[o.name] for o in calls if name != o.name
                     and name.startswith(o.name + ".")), None)
    peak = 0
    for i in range(len(calls)):
        after = size[i + 1] if i + 1 < len(calls) else 0
        before = size[i - 1] if i > 0 else 0
        o = outer(i) if calls[i].name in experts else None
        if o is None:
            peak = max(peak, size[i] + max(after, before))
        else:
            ahead = size[o - 1] if o > 0 else 0
            peak = max(peak, size[o] + size[i] + after, size[o] + size[i] + ahead)
    return peak

"""Per-rank model-state bytes and data-parallel traffic, by what a strategy keeps sharded.

:func:`~mpishard.planning.memory.estimate_memory` reads the registered strategy's
:class:`~mpishard.parallel.strategy.Sharded` level (see [Note: strategy
contract]) and applies one of these to the :class:`EstimateSizes` it computed:
:func:`replicated_state` when nothing is sharded (DDP), :func:`sharded_state`
for ZeRO's stages, from the same units the strategy builds (see [Note: flat unit
layout] in units.py). Each returns ``sizes.new_plan()`` filled in: a
:class:`~mpishard.planning.memory.MemoryEstimate`, with what offload keeps in host
memory moved there (:func:`~mpishard.planning.offload.place_offload`).
"""
from __future__ import annotations

from mpishard.nn.sharding import plan_of
from mpishard.parallel.strategy import Sharded
from mpishard.parallel.zero.units import build_units, expert_units
from mpishard.planning.offload import place_offload

__all__ = ["replicated_state", "sharded_state", "window_peak"]


def window_peak(sizes: list, window: int) -> int:
    """Largest sum of ``window`` consecutive entries (buffers alive together)."""
    if not sizes:
        return 0
    window = min(window, len(sizes))
    return max(sum(sizes[i:i + window]) for i in range(len(sizes) - window + 1))


def replicated_state(model, sizes):
    """Nothing sharded: whole parameters, gradient buckets (the gradients themselves,
    also at dp 1) and optimizer state on every rank; the buckets all-reduced over
    ``dp_cp``, those of experts split over ep over ``edp``."""
    s, n = sizes, sizes.n_params
    plan = s.new_plan()
    plan.steady = {"params": n * s.itemsize + (n * s.compute_itemsize if s.mixed else 0),
                   "grads": n * s.reduce_itemsize,
                   "optim": s.n_states * n * s.itemsize}
    plan.peak = {"gathered": 0, "comm": 0}
    dense, experts = s.expert_split(model)
    edp = s.dp_size // s.ep
    plan.bus_bytes_by_group = {
        "dp_cp": int(round(2 * s.factor * dense * s.reduce_itemsize)),
        "edp": int(round(2 * (edp - 1) / edp * experts * s.reduce_itemsize))}
    plan.bus_bytes_per_step = sum(plan.bus_bytes_by_group.values())
    buckets = max(1, -(-n * s.reduce_itemsize // (4 << 20)))    # 4 MiB buckets
    return place_offload(plan, s, n, s.reduce_itemsize, buckets, 1)


def sharded_state(model, sizes, sharded: Sharded, max_inflight: int | None):
    """ZeRO's stage ``sharded`` (see [Note: flat unit layout]); the same units the
    strategy builds, read from the model's shapes, sharded over ``sizes.shard_size``
    ranks (``dp_shard x cp``; experts split over ep over ``edp_shard``, ``ep`` times
    fewer) and, under hybrid sharding, each reduced shard averaged over
    ``dp_replicate``; at most ``max_inflight`` reductions (``None``: any number) in
    flight besides the one being launched."""
    s, shard = sizes, sizes.shard_size
    whole_params = sharded < Sharded.PARAMETERS
    names, experts = expert_units(model, list(plan_of(model).units))
    expert_shard = shard // s.ep
    units = _units(model, names, shard, expert_shard, experts)
    padded_n = sum(u.padded for u in units)
    shards_n = sum(u.shard_size for u in units)
    b, cb, rb = s.itemsize, s.compute_itemsize, s.reduce_itemsize
    # A reduction in flight holds its flat buffer, plus a receive buffer when the
    # reduce dtype is not the shard's (mixed precision). Stage 1 reduces from its
    # full gradient buffer (counted as grads), in backward's order.
    whole_grads = sharded is Sharded.OPTIMIZER_STATE
    offloaded = s.offload not in (None, "none")

    def aliased(u):   # see ZeroUnit.allocate_grads (expert units are never aliased)
        return whole_grads and shard == 1 and s.dp_replicate == 1 and rb == b and \
            u.name not in experts
    order = [u for u in units if u.module is not None][::-1] + [
        u for u in units if u.module is None]
    # offloaded, a reduction lands in a device buffer of its own, then in the host shard;
    # stage 1's lands in one and goes back into the full buffer, and its shard is made at
    # the step (see [Note: stage 1's gradient shard] in parallel/zero/base.py)
    at_step = whole_grads and not offloaded
    in_flight = [(0 if whole_grads else u.padded * rb) + (u.shard_size * rb if rb != b or (
        (offloaded or at_step) and not aliased(u)) else 0) for u in order]
    plan = s.new_plan()
    copy = padded_n * cb if whole_params else (shards_n * cb if s.mixed else 0)
    shard_grads = sum(0 if aliased(u) else u.shard_size * b for u in units)
    plan.steady = {"params": (shards_n * b if not whole_params or s.mixed else 0) + copy,
                   "grads": (0 if at_step else shard_grads)
                   + (padded_n * rb if whole_grads else 0),
                   "optim": s.n_states * shards_n * b}
    if at_step and rb != b:   # the masters' dtype: a cast copy, from the step to zero_grad
        plan.at_step = {"grads": shard_grads}
    # clipping's norm sums the shards (ZeroStrategy.local_grad_sq), never stage 1's whole
    # buffer (at one rank, the same bytes)
    plan.norm_grad_bytes = shards_n * b
    root = sum(u.padded * cb for u in units if u.module is None)
    gathered = 0 if whole_params else root + _gathered_peak(units, experts, cb)
    window = len(in_flight) if max_inflight is None else max_inflight + 1
    plan.peak = {"gathered": gathered, "comm": window_peak(in_flight, window)}
    by_group = {"dp_shard_cp": 0, "edp_shard": 0}
    for u in units:
        group, n = ("edp_shard", expert_shard) if u.name in experts else ("dp_shard_cp",
                                                                          shard)
        if whole_params:  # reduce-scatter the gradients, all-gather the compute copy
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
    if offloaded:      # each unit's gradient shard is its master's host gradient buffer
        plan.steady["grads"] -= sum(u.shard_size * b for u in units if not aliased(u))
    gathers = tuple((u.shard_size, 2 * s.micro_batches if u.module is not None else 1)
                    for u in units) if s.offload == "params" else ()
    return place_offload(plan, s, shards_n, rb, len(units), len(units), gathers)


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

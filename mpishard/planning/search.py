"""Enumerate the layouts of a model on some ranks, keep those that fit, rank them by step time.

    ranked = rank_layouts(make_model, ranks=64, ranks_per_node=8, machine=h100,
                          seq_len=8192, global_batch=1024, n_layer=32, n_head=32)
    print(format_table(ranked[:5]))

A candidate is a :class:`~mpishard.planning.layout.Layout`: ``tp`` (dividing the heads,
at most a node), ``pp`` (at most the blocks), ``cp`` (the sequence split into
``2 cp`` chunks), the rest ``dp``, without or with hybrid sharding (``dp_shard``
the largest that keeps ``tp x cp x dp_shard`` inside a node, ``dp_replicate``
across); each strategy; micro-batches of 1, 2, 4 or 8 sequences that divide a dp
rank's share of the global batch (at least ``pp`` micro-batches under a
pipeline); with ``virtual_stages`` beyond 1, also each interleaved pipeline of
that many chunks per rank that the blocks, micro-batches and strategy allow;
activation checkpointing off and on; sequence parallelism whenever ``tp > 1``. Each is planned exactly for memory first (the layout planner) and
dropped when its busiest rank exceeds the device memory (a checkpointed one
when its plain twin fits: recomputing only costs time; a checkpointed one that fits
is also tried recomputed by op, ``ckpt`` ``op`` in the table, which keeps every
second product's output and repeats the rest), unless it fits with
one of the offloads asked for (``offloads``: optimizer offload first, then
ZeRO-3's parameter offload; see [Note: offload plan] in offload.py): then that
offloaded layout takes its place, its step paying the copies and the host
update. The rest are costed (:func:`~mpishard.planning.cost.predict_step`) and
sorted by step time.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mpishard.parallel.compose import build_stage
from mpishard.parallel.pipeline.schedule import bubble_fraction
from mpishard.parallel.strategy import STRATEGIES, Sharded
from mpishard.planning.cost import StepCost, predict_step
from mpishard.planning.layout import Layout, estimate_layout, mesh_shape

__all__ = ["Ranked", "candidate_layouts", "rank_layouts", "format_table", "offload_share"]


@dataclass
class Ranked:
    """One costed layout: the layout, its busiest rank's bytes, and the prediction."""

    layout: Layout
    peak_bytes: int
    cost: StepCost
    host_bytes: int = 0      # offloaded: the busiest rank's bytes in host memory

    def as_dict(self) -> dict:
        lay = self.layout
        return {"dp": lay.dp, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard,
                "cp": lay.cp, "tp": lay.tp, "pp": lay.pp, "strategy": lay.strategy,
                "micro_batch": lay.batch_size, "micro_batches": lay.micro_batches,
                "activation_checkpointing": lay.activation_checkpointing,
                "keep_products": lay.keep_products,
                "sequence_parallel": lay.sequence_parallel, "peak_bytes": self.peak_bytes,
                "step_s": self.cost.seconds, "tokens_per_s": self.cost.tokens_per_s,
                "mfu": self.cost.mfu, "exposed_comm_s": self.cost.exposed_comm,
                "virtual_stages": lay.virtual_stages, "offload": lay.offload,
                "host_bytes": self.host_bytes,
                "bubble": bubble_fraction(lay.pp, lay.micro_batches, lay.virtual_stages),
                "breakdown": self.cost.breakdown}


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(ranks: int, ranks_per_node: int, seq_len: int, global_batch: int,
                      n_layer: int, n_head: int, precision=None, strategies=None,
                      checkpointing=(False, True), virtual_stages=(1,),
                      reduce_dtype: str = "float32") -> list:
    """Every layout of the module docstring (unplanned); ``virtual_stages``: the model
    chunks per pipeline rank to try (beyond 1: the interleaved schedule); ``precision``
    and ``reduce_dtype``: every layout's (see :class:`~mpishard.planning.layout.Layout`).

    Raises:
        ValueError: a ``reduce_dtype`` that ``precision`` does not admit.
    """
    Layout(precision=precision, reduce_dtype=reduce_dtype)   # a bad pair raises, once
    out = []
    for tp in [d for d in _divisors(ranks) if d <= min(ranks_per_node, n_head)
               and n_head % d == 0]:
        for pp in [d for d in _divisors(ranks // tp) if d <= n_layer]:
            for cp in [d for d in _divisors(ranks // (tp * pp)) if seq_len % (2 * d) == 0
                       or d == 1]:
                dp = ranks // (tp * pp * cp)
                if global_batch % dp:
                    continue
                inside = max(1, ranks_per_node // (tp * cp))
                shard = max(d for d in _divisors(dp) if d <= inside)
                for replicate in sorted({1, dp // shard}):
                    for strategy in strategies or list(STRATEGIES):
                        if replicate > 1 and \
                                STRATEGIES[strategy].keeps_sharded is Sharded.NOTHING:
                            continue       # hybrid sharding replicates shards: none here
                        per_dp = global_batch // dp
                        for mbs in [b for b in (1, 2, 4, 8) if per_dp % b == 0]:
                            m = per_dp // mbs
                            if pp > 1 and m < pp:
                                continue
                            for ac, v in [(ac, v) for ac in checkpointing
                                          for v in virtual_stages
                                          if v == 1 or (pp > 1 and n_layer % (pp * v) == 0)]:
                                try:
                                    out.append(Layout(
                                        dp, tp, pp, strategy, precision, batch_size=mbs,
                                        seq_len=seq_len, micro_batches=m,
                                        activation_checkpointing=ac, cp=cp,
                                        dp_replicate=replicate, sequence_parallel=tp > 1,
                                        schedule="interleaved" if v > 1 else "1f1b",
                                        virtual_stages=v, reduce_dtype=reduce_dtype))
                                except ValueError:
                                    continue
    return out


class StageCache:
    """Built pipeline stages by split (``tp, pp, cp, mode, sequence parallel, ep``), so
    that layouts differing only in data-parallel sizes, strategy or batch share them."""

    def __init__(self, make_model, whole):
        self.make_model, self.whole, self.stages = make_model, whole, {}

    def of(self, layout):
        def stage(s):
            key = (layout.tp, layout.pp, layout.cp, layout.cp_mode, layout.sequence_parallel,
                   layout.ep, layout.virtual_stages, s)
            if key not in self.stages:
                mesh = mesh_shape(layout, s)
                # a pipeline stage is built anew from the (only read) whole model
                source = self.whole if layout.pp > 1 else self.make_model()
                self.stages[key] = build_stage(source, mesh, None, layout.cp_mode,
                                               layout.sequence_parallel,
                                               layout.virtual_stages).freeze_structure()
            return self.stages[key]
        return stage


def rank_layouts(make_model, layouts, machine, ranks_per_node: int | None = None,
                 memory_bytes: float | None = None, progress=None,
                 offloads: tuple = ()) -> tuple:
    """``(ranked fits by step time, number over the memory limit)`` for ``layouts``.

    A checkpointed layout whose plain twin fits is skipped: recomputing only adds
    time. A layout fits when its busiest rank's planned bytes are at most
    ``memory_bytes``, by default the machine's memory less its reserve
    (:attr:`~mpishard.planning.machine.Machine.usable_memory_bytes`); one that does
    not is tried with each of ``offloads`` in turn (``"optimizer"``, ``"params"``)
    that its strategy can do, and the first that fits is ranked in its place."""
    limit = memory_bytes or machine.usable_memory_bytes      # the reserve kept back
    whole = make_model().freeze_structure()      # only read: plans, sizes, pipeline stages
    cache, memo = StageCache(make_model, whole), {}
    fits, over, plain_fits = [], 0, set()
    for i, layout in enumerate(layouts):
        if progress:
            progress(i, len(layouts))
        if layout.activation_checkpointing and \
                dataclasses.replace(layout, activation_checkpointing=False) in plain_fits:
            continue
        try:
            plan = estimate_layout(whole, layout, stage_of=cache.of(layout), memo=memo,
                               representative=True)
        except ValueError:
            continue
        if plan.total_peak_bytes > limit:
            layout, plan = _offloaded(whole, layout, cache, memo, limit, offloads)
            if plan is None:
                over += 1
                continue
        if not layout.activation_checkpointing and layout.offload == "none":
            plain_fits.add(layout)
        tried = [(layout, plan)]
        if layout.activation_checkpointing and layout.offload == "none":
            tried += _by_op(whole, layout, cache, memo, limit)
        for layout, plan in tried:
            fits.append(Ranked(layout, plan.total_peak_bytes, predict_step(
                make_model, layout, machine, ranks_per_node, plan, cache.of(layout), memo,
                whole), sum(plan.busiest.memory.host.values())))
    fits.sort(key=lambda r: r.cost.seconds)
    return fits, over


def _by_op(whole, layout, cache, memo, limit: float) -> list:
    """``[(layout recomputed by op, its plan)]`` where that fits too (it repeats half the
    products fewer than whole blocks), else ``[]`` (or a model that refuses it)."""
    if layout.keep_products:
        return []
    by_op = dataclasses.replace(layout, keep_products=True)
    try:
        plan = estimate_layout(whole, by_op, stage_of=cache.of(by_op), memo=memo,
                               representative=True)
    except ValueError:
        return []
    return [(by_op, plan)] if plan.total_peak_bytes <= limit else []


def _offloaded(whole, layout, cache, memo, limit: float, offloads: tuple) -> tuple:
    """``(layout with the first of offloads that fits, its plan)``, or ``(layout, None)``."""
    for offload in offloads:
        try:
            moved = dataclasses.replace(layout, offload=offload)
        except ValueError:              # a strategy that cannot offload this
            continue
        plan = estimate_layout(whole, moved, stage_of=cache.of(moved), memo=memo,
                               representative=True)
        if plan.total_peak_bytes <= limit:
            return moved, plan
    return layout, None


def offload_share(cost) -> tuple:
    """``(copies, host update)``: the shares of ``cost``'s step that offload adds."""
    b = cost.breakdown
    return b.get("offload copies", 0.0) / cost.seconds, b.get("host optimizer", 0.0) / cost.seconds


def format_table(ranked: list) -> str:
    """The table ``mpishard plan`` prints, one row per layout (``pp x V``: pipeline
    stages, and the chunks per rank of an interleaved schedule; ``offload``: what a
    layout that fits only with offload keeps in host memory, with the shares of its
    step the copies and the host update take)."""
    head = (f"{'#':>3} {'dp (R x S)':>11} {'cp':>3} {'tp':>3} {'pp x V':>6} {'strategy':<8} "
            f"{'mb x m':>7} {'ckpt':>4} {'GiB/rank':>9} {'step s':>9} {'tokens/s':>10} "
            f"{'MFU':>6} {'comm s':>8} {'bubble':>6} {'offload (copies, host)':<24}")
    rows = [head, "-" * len(head)]
    for i, r in enumerate(ranked, 1):
        lay, c = r.layout, r.cost
        dp = f"{lay.dp} ({lay.dp_replicate}x{lay.dp_shard})" if lay.dp_replicate > 1 \
            else str(lay.dp)
        pp = f"{lay.pp}x{lay.virtual_stages}" if lay.virtual_stages > 1 else str(lay.pp)
        rows.append(f"{i:>3} {dp:>11} {lay.cp:>3} {lay.tp:>3} {pp:>6} {lay.strategy:<8} "
                    f"{f'{lay.batch_size}x{lay.micro_batches}':>7} "
                    f"{'op' if lay.keep_products else 'yes' if lay.activation_checkpointing else 'sel' if lay.selective else 'no':>4} "
                    f"{r.peak_bytes / 2**30:>9.2f} {c.seconds:>9.4f} {c.tokens_per_s:>10.0f} "
                    f"{c.mfu:>6.1%} {c.exposed_comm:>8.4f} "
                    f"{bubble_fraction(lay.pp, lay.micro_batches, lay.virtual_stages):>6.1%} "
                    f"{_offload_text(r):<24}".rstrip())
    return "\n".join(rows)


def _offload_text(ranked) -> str:
    if ranked.layout.offload == "none":
        return "-"
    copies, host = offload_share(ranked.cost)
    return f"{ranked.layout.offload} ({copies:.1%}, {host:.1%})"

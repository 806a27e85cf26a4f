"""Plan a whole layout before building it: per-rank memory with activations, traffic per axis.

    plan = estimate_layout(GPT(GPTConfig(...), materialize_now=False),
                       Layout(dp=8, tp=8, strategy="zero3", batch_size=4, seq_len=1024))
    plan = estimate_layout(Llama(cfg, materialize_now=False),
                       Layout(dp=4, tp=2, cp=2, dp_replicate=2, strategy="zero2",
                              batch_size=1, seq_len=8192, sequence_parallel=True))
    print(plan.format())

[Note: layout plan]
For every pipeline stage, this builds the stage a rank of that stage builds
(``build_stage`` over a :class:`~mpishard.core.mesh_axes.MeshShape`: sizes,
coordinates and the names the mesh gives its communicators, of the stage's first
rank: tensor-parallel rank 0, which holds the larger share of an uneven split; cp
ranks all hold as many rows) and adds up, per rank
and step:

* model state and transient buffers: the strategy's :func:`estimate_memory` of
  that stage over ``dp x cp`` (DDP: whole parameters; ZeRO: shards over
  ``dp_shard x cp``, replicated over ``dp_replicate``);
* activations: ``model.activation_bytes`` of one micro-batch of ``seq_len / cp``
  rows per sequence (the model counts what its ops keep, context and sequence
  parallelism included, see [Note: activation bytes] for the GPT; under ZeRO-3
  with sequence parallelism also each block's gathered unit, which the graph's
  tp-summed uses of its replicated parameters keep alive until backward) times
  the micro-batches the schedule keeps alive at once on that stage: 1 without a
  pipeline, ``m`` under GPipe, ``min(p - s, m)`` under 1F1B; under interleaved 1F1B
  each of the rank's ``V`` chunks keeps its own bytes, and the peak is the most its
  order (:func:`~mpishard.parallel.pipeline.order.schedule_order`, the one the
  pipeline runs) keeps at once, ``2 (p - s - 1) + (V - 1) p + 1`` chunk forwards
  in steady state;
* bus bytes ([Note: bus bytes]) per communicator, under the name the mesh gives
  it (groups of the same ranks share one, see :meth:`Mesh.active_axes`): the
  strategy's per mesh group (DDP's all-reduce over ``dp_cp``, ZeRO's over
  ``dp_shard_cp`` and ``dp_replicate``), the loss's count of targets (one number
  all-reduced over ``dp_cp``); tp from the plan's styles, per micro-batch:
  without sequence parallelism the forward all-reduce after every row-parallel
  layer and vocabulary-parallel embedding (twice inside checkpointed blocks: the
  recompute repeats it), the backward all-reduce in front of every
  column-parallel layer (after a layer the plan keeps whole); with it, in front
  of every column-parallel layer an all-gather forward (recomputed too) and
  again backward, and a reduce-scatter backward (a whole layer: no second
  gather), the reverse after every row-parallel one, the all-gather of the
  gradient of the embeddings' cut rows and the gradient sums of the
  tp-replicated parameters the split rows reach; the loss's three all-reduces of
  one number per row; cp per attention and micro-batch: the ring's K/V blocks
  and their gradients sent and received (:func:`ring_kv_bytes`; the forward's
  again under checkpointing) or Ulysses' all-to-alls of q, k, v and the output,
  each way; pp: the activations and gradients each stage sends and receives per
  micro-batch (at every chunk's boundaries under interleaving: ``V`` times as many
  messages), and the step's loss broadcast; the tied parameter's gradient
  summed between the first and the last stage.

The busiest stage (the most bytes) is what ``mpishard estimate`` and the plan
of ``mpishard train`` print. The model given is consumed: its layers may be
swapped for tensor-parallel ones.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from mpishard.core.mesh_axes import MeshShape
from mpishard.nn.sharding import plan_of
from mpishard.parallel.compose import build_stage, check_interleaving, stage_blocks
from mpishard.parallel.context.apply import CP_MODES
from mpishard.parallel.offload import check_offload
from mpishard.parallel.precision import Precision
from mpishard.parallel.strategy import strategy_entry
from mpishard.parallel.pipeline.order import peak_in_flight, schedule_order
from mpishard.planning.memory import (MemoryEstimate, at_step_rows, layout_itemsizes,
                                     estimate_memory, host_rows, stage_traffic)
from mpishard.parallel.plans import split_range

__all__ = ["Layout", "StageEstimate", "LayoutEstimate", "estimate_layout", "mesh_shape"]


@dataclass(frozen=True)
class Layout:
    """A layout to plan: mesh sizes, strategy, precision and the batch of one rank.

    ``batch_size`` is sequences per dp rank per micro-batch, ``micro_batches``
    per step (the pipeline's ``m``), ``seq_len`` tokens per sequence (each of
    the ``cp`` context-parallel ranks holds ``seq_len / cp`` of them). ``dp`` is
    the whole data-parallel size, ``dp_replicate x dp_shard`` (hybrid sharding:
    ``dp_replicate`` copies of the ZeRO shards). ``cp_mode`` is ``"ring"`` or
    ``"all-to-all"``; ``sequence_parallel`` splits the rows between tensor-parallel
    layers over tp; ``ep`` splits each mixture of experts' experts over that many
    ranks of ``dp_shard x cp``. ``activation_checkpointing`` recomputes whole blocks,
    ``selective`` only attention's core (the activation plan then keeps no ``T x T``
    weights; the step-time model adds the core's products once more);
    ``keep_products`` (with ``activation_checkpointing``) keeps the outputs of every
    block's 1st, 3rd, ... product and repeats the rest of the block (see [Note:
    recomputation by op] in mpishard/models/checkpointing.py).
    ``schedule`` is ``"1f1b"``, ``"gpipe"`` or ``"interleaved"`` with
    ``virtual_stages`` model chunks per pipeline rank. ``offload`` is ``"none"``,
    ``"optimizer"`` (DDP, ZeRO) or ``"params"`` (ZeRO-3): what the run keeps in host
    memory is planned there (see [Note: offload plan] in offload.py). ``precision``
    is a name (``"float16"``, ``"bfloat16"``; ``None`` or ``"float32"``: no mixed
    precision); under a 16-bit one ``reduce_dtype`` is the dtype gradients are added
    and reduced in (``"float32"``, or the 16-bit one: half the gradient bytes and dp
    traffic; see :class:`~mpishard.parallel.Precision`), :attr:`policy` the two
    together.

    Raises:
        ValueError: sizes that do not fit together, naming the fix.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    strategy: str = "zero3"
    precision: str | None = None
    optimizer: str = "adamw"
    batch_size: int = 1
    seq_len: int = 1
    micro_batches: int = 1
    schedule: str = "1f1b"
    activation_checkpointing: bool = False
    cp: int = 1
    dp_replicate: int = 1
    cp_mode: str = "ring"
    sequence_parallel: bool = False
    ep: int = 1
    selective: bool = False
    keep_products: bool = False
    virtual_stages: int = 1
    offload: str = "none"
    reduce_dtype: str = "float32"

    def __post_init__(self):
        if self.selective and self.activation_checkpointing:
            raise ValueError("Layout: selective=True recomputes attention's core and "
                             "activation_checkpointing=True whole blocks; pass one of them")
        if self.keep_products and not self.activation_checkpointing:
            raise ValueError("Layout: keep_products=True (recomputation by op) keeps products "
                             "of recomputed blocks; pass activation_checkpointing=True too")
        for name in ("dp", "tp", "pp", "cp", "dp_replicate", "batch_size", "seq_len",
                     "micro_batches", "ep", "virtual_stages"):
            n = getattr(self, name)
            if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
                raise ValueError(f"Layout.{name}={n!r} must be a positive integer")
        check_offload(self.offload, strategy_entry(self.strategy).cls)
        if self.reduce_dtype != "float32" and not self.policy.mixed:
            raise ValueError(f"Layout reduce_dtype={self.reduce_dtype!r} needs a 16-bit "
                             f"precision (got precision={self.precision!r}); pass "
                             f"precision='float16' or 'bfloat16', or reduce_dtype='float32'")
        check_interleaving(self.schedule, int(self.virtual_stages), int(self.pp),
                           int(self.micro_batches))
        if self.dp % self.dp_replicate:
            raise ValueError(f"Layout dp_replicate={self.dp_replicate} does not divide "
                             f"dp={self.dp}; pass a dp_replicate that divides {self.dp} "
                             f"(dp_shard = dp / dp_replicate)")
        if (self.dp_shard * self.cp) % self.ep:
            raise ValueError(f"Layout ep={self.ep} does not divide dp_shard x cp = "
                             f"{self.dp_shard} x {self.cp}; pass an ep that divides "
                             f"{self.dp_shard * self.cp} (experts split over ranks reading "
                             f"different tokens)")
        if self.cp_mode not in CP_MODES:
            raise ValueError(f"unknown context-parallel mode {self.cp_mode!r}; use 'ring' or "
                             f"'all-to-all'")
        if self.cp > 1 and self.seq_len % (2 * self.cp):
            raise ValueError(f"sequence length {self.seq_len} does not divide by 2 x cp = "
                             f"{2 * self.cp} (context parallelism gives each rank two of "
                             f"2*cp chunks); use a seq_len that is a multiple of "
                             f"{2 * self.cp} or another cp")
        rows = self.batch_size * self.local_seq_len
        if self.sequence_parallel and self.tp > 1 and rows % self.tp:
            raise ValueError(f"sequence parallelism splits the {rows} rows of each "
                             f"micro-batch (batch_size x seq_len / cp) over tp = {self.tp}; "
                             f"use a batch_size or seq_len that makes them divisible by "
                             f"{self.tp}, or sequence_parallel=False")

    @property
    def policy(self) -> Precision:
        """The :class:`~mpishard.parallel.Precision` planned: ``precision``'s, its
        gradients in ``reduce_dtype`` when it computes in 16 bits."""
        return Precision.of(self.precision).reducing_in(self.reduce_dtype)

    @property
    def dp_shard(self) -> int:
        """Ranks one copy of the ZeRO shards is spread over (with cp: ``x cp`` more)."""
        return self.dp // self.dp_replicate

    @property
    def local_seq_len(self) -> int:
        """Rows of each sequence on one rank, ``seq_len / cp``."""
        return self.seq_len // self.cp


@dataclass
class StageEstimate:
    """One pipeline stage's per-rank figures: memory, activations, bus bytes per axis."""

    stage: int
    memory: MemoryEstimate
    activation_bytes: int = 0
    micro_batches_alive: int = 1
    bus_bytes: dict = field(default_factory=dict)    # axis -> bytes per step

    @property
    def total_peak_bytes(self) -> int:
        return self.memory.peak_over(self.activation_bytes)


@dataclass
class LayoutEstimate:
    """Every stage's :class:`StageEstimate`; ``busiest`` is the one with the most bytes."""

    layout: Layout
    n_params: int
    stages: list
    activations_known: bool = True

    @property
    def busiest(self) -> StageEstimate:
        return max(self.stages, key=lambda s: s.total_peak_bytes)

    @property
    def total_peak_bytes(self) -> int:
        return self.busiest.total_peak_bytes

    def _mesh_text(self) -> str:
        lay = self.layout
        dp = f"dp={lay.dp}" + (f" (dp_replicate={lay.dp_replicate} x dp_shard="
                               f"{lay.dp_shard})" if lay.dp_replicate > 1 else "")
        cp = f" x cp={lay.cp} ({lay.cp_mode})" if lay.cp > 1 else ""
        sp = " (sequence parallel)" if lay.sequence_parallel and lay.tp > 1 else ""
        ep = f", experts over ep={lay.ep}" if lay.ep > 1 else ""
        vp = f" ({lay.virtual_stages} chunks each, interleaved)" if lay.virtual_stages > 1 \
            else ""
        return f"{dp}{cp} x tp={lay.tp}{sp} x pp={lay.pp}{vp}{ep}"

    def format(self) -> str:
        lay, stage = self.layout, self.busiest
        m = stage.memory

        def mib(n):
            return f"{n / 2**20:10.2f} MiB"
        mixed = f", {m.precision}" if m.precision else ""
        rows = [f"{lay.strategy} on {self._mesh_text()}: "
                f"{self.n_params:,} parameters, {m.itemsize}-byte masters{mixed}; per rank:"]
        if lay.pp > 1:
            rows.append(f"  (the busiest ranks: pipeline stage {stage.stage} of {lay.pp}, "
                        f"stages 0..{lay.pp - 1})")
        rows += [f"  {k:<12}{mib(v)}" for k, v in m.steady.items()]
        labels = {"gathered": "gathered", "comm": "comm buffers"}
        rows += [f"  {labels.get(k, k):<12}{mib(v)}  (peak, transient)" for k, v in m.peak.items()]
        rows += at_step_rows(m.at_step, 12)
        if self.activations_known:
            seq = f"{lay.seq_len}" if lay.cp == 1 else f"{lay.local_seq_len} (of {lay.seq_len})"
            kept = f"{stage.micro_batches_alive} micro-batch(es)" if lay.virtual_stages == 1 \
                else f"{stage.micro_batches_alive} chunk forwards of micro-batches"
            rows.append(f"  {'activations':<12}{mib(stage.activation_bytes)}  (peak: "
                        f"{kept} of {lay.batch_size} x {seq} kept for backward"
                        + (", checkpointed" if lay.activation_checkpointing else "")
                        + (" keeping every second product" if lay.keep_products else "")
                        + (", attention recomputed" if lay.selective else "") + ")")
        else:
            rows.append(f"  {'activations':<12}{'(not estimated for this model)':>14}")
        rows.append(f"  {'total':<12}{mib(stage.total_peak_bytes)}  (model state "
                    f"{m.model_state_bytes / 2**20:.2f} MiB)")
        if lay.offload != "none":
            rows.append(f"  offload {lay.offload}: in host memory per rank")
            rows += host_rows(m.host, 12)
        per_axis = ", ".join(f"{axis} {n / 2**20:.2f}" for axis, n in stage.bus_bytes.items())
        rows.append(f"  {'traffic':<12}{mib(sum(stage.bus_bytes.values()))}  bus bytes per step "
                    f"({per_axis} MiB)")
        return "\n".join(rows)


def _in_flight(layout: Layout, stage: int, chunk_bytes: list) -> tuple:
    """``(activation bytes, chunk forwards)`` pipeline stage ``stage`` keeps at once: the
    peak of its schedule's order (one micro-batch without a pipeline), each chunk's
    forward keeping ``chunk_bytes[c]`` until its backward starts."""
    if layout.pp == 1:
        return chunk_bytes[0], 1
    order = schedule_order(layout.schedule, layout.pp, stage, layout.micro_batches,
                           layout.virtual_stages)
    return peak_in_flight(order, chunk_bytes), peak_in_flight(order, [1] * len(chunk_bytes))


def _check_heads(model, layout: Layout) -> None:
    """All-to-all needs every tp rank's heads to split over cp (ValueError naming the fix)."""
    heads = getattr(getattr(model, "config", None), "n_head", None)
    if layout.cp == 1 or layout.cp_mode != "all-to-all" or heads is None:
        return
    local = {b - a for a, b in (split_range(heads, layout.tp, r) for r in range(layout.tp))}
    if any(h % layout.cp for h in local):
        raise ValueError(f"cp_mode 'all-to-all' splits each tensor-parallel rank's heads "
                         f"({' or '.join(map(str, sorted(local)))} of n_head={heads}) over "
                         f"cp={layout.cp}; use cp_mode 'ring', or a cp and tp whose product "
                         f"divides {heads}")


def _bus(mesh: MeshShape, by_group: dict) -> dict:
    """Bytes per mesh group -> bytes per communicator name (``dp``, ``tp``, ``pp`` always)."""
    out = {"dp": 0, "tp": 0, "pp": 0}
    out.update({name: 0 for name in mesh.active_names()})
    for attr, n in by_group.items():
        group = mesh.groups[attr]
        if group.size > 1 or attr in ("dp", "tp", "pp"):
            out[group.name] = out.get(group.name, 0) + n
    return out


def _stages_to_plan(model, layout: Layout, stage_of, representative: bool) -> list:
    if not representative or stage_of is None or layout.pp == 1 or layout.virtual_stages > 1:
        return list(range(layout.pp))
    ranges, _ = stage_blocks(model, layout.pp)
    out, kinds = [], set()
    for s, blocks in enumerate(ranges):
        kind = (s == 0, s == layout.pp - 1, len(blocks))
        if kind not in kinds:
            kinds.add(kind)
            out.append(s)
    return out


@functools.lru_cache(maxsize=4096)
def mesh_shape(layout: Layout, stage: int) -> MeshShape:
    """The :class:`~mpishard.core.mesh_axes.MeshShape` of the first rank of ``layout``'s
    pipeline stage ``stage`` (cached: a search asks for the same ones many times)."""
    sizes = {axis: int(getattr(layout, axis))          # a Layout may hold NumPy integers
             for axis in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")}
    return MeshShape(**sizes, world_rank=stage * int(layout.dp * layout.cp * layout.tp))


def memo_for(memo, stage):
    """``get(key, compute)`` through ``memo`` for this stage (no memo: compute)."""
    if memo is None:
        return lambda key, compute: compute()
    mine = memo.setdefault(id(stage), (stage, {}))[1]   # the stage is kept with its entries

    def get(key, compute):
        if key not in mine:
            mine[key] = compute()
        return mine[key]
    return get


def estimate_layout(model, layout: Layout, stage_estimate=None, stage_of=None,
                memo: dict | None = None, representative: bool = False) -> LayoutEstimate:
    """Per-rank memory (with activations) and traffic of ``layout`` for ``model``.

    ``model`` is whole and unmaterialised; see [Note: layout plan]. ``stage_of``, a
    function from a stage index to that stage already built for this layout's
    ``tp x pp x cp`` split (a planner's cache), replaces building them from
    ``model``, which is then only read; ``memo``, a dict kept across such calls,
    then caches each stage's memory plan, activation bytes and traffic by what
    they depend on; ``representative`` (with ``stage_of``) plans only the first
    stage of each kind (first, last, or in between with so many blocks): the
    stages a kind's later ones repeat with no more micro-batches alive, so the
    busiest stage is among them.
    """
    _check_heads(model, layout)
    plan = plan_of(model)
    whole = memo_for(memo, model)
    policy = layout.policy
    act, wire, grad = whole(("itemsizes", policy), lambda: layout_itemsizes(model, layout))
    n_params = whole(("parameters",), model.num_parameters)
    stages = []
    for s in _stages_to_plan(model, layout, stage_of, representative):
        mesh = mesh_shape(layout, s)
        stage = stage_of(s) if stage_of is not None else \
            build_stage(model, mesh, stage_estimate, layout.cp_mode, layout.sequence_parallel,
                        layout.virtual_stages)
        mode = "op" if layout.keep_products else "full" if layout.activation_checkpointing \
            else "selective" if layout.selective else "none"
        if hasattr(stage, "set_activation_checkpointing") and \
                (mode != "none" or stage_of is not None):
            stage.set_activation_checkpointing(mode)
        cached = memo_for(memo, stage)
        memory = cached(("memory", layout.strategy, mesh.dp_cp.size, layout.optimizer,
                         policy, layout.micro_batches, layout.dp_replicate, layout.ep,
                         layout.offload),
                        lambda: estimate_memory(stage, layout.strategy, mesh.dp_cp.size,
                                            layout.optimizer, precision=policy,
                                            micro_batches=layout.micro_batches,
                                            dp_replicate=layout.dp_replicate, ep=layout.ep,
                                            offload=layout.offload))
        chunks = getattr(stage, "chunks", [stage])       # V model chunks when interleaved
        per_chunk = cached(("activations", layout.batch_size, layout.local_seq_len, act.name,
                            mode),
                           lambda: [c.activation_bytes(layout.batch_size, layout.local_seq_len,
                                                       act) for c in chunks]) \
            if hasattr(stage, "activation_bytes") else [0] * len(chunks)
        activation_bytes, alive = _in_flight(layout, s, per_chunk)
        groups = dict(memory.bus_bytes_by_group or {"dp_cp": memory.bus_bytes_per_step})
        if getattr(stage, "last_stage", True) and mesh.dp_cp.size > 1:   # count of targets
            n = mesh.dp_cp.size      # an all-reduce's bus bytes: 2 (n - 1) / n of 8
            groups["dp_cp"] = groups.get("dp_cp", 0) + int(round(2 * (n - 1) / n * 8))
        traffic = dict(cached(("traffic", layout.batch_size, layout.seq_len, layout.micro_batches,
                               mode, act.name, wire, grad),
                              lambda: stage_traffic(stage, layout, plan, act, wire, grad)))
        tie = traffic.pop("tied")
        bus = _bus(mesh, {**groups, **traffic})
        if tie:
            bus["tied"] = tie
        stages.append(StageEstimate(s, memory, activation_bytes, alive, bus))
    return LayoutEstimate(layout, n_params, stages,
                      activations_known=hasattr(model, "activation_bytes"))

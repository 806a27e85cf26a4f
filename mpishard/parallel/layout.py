"""Plan a whole layout before building it: per-rank memory with activations, traffic per axis.

    plan = plan_layout(GPT(GPTConfig(...), materialize_now=False),
                       Layout(dp=8, tp=8, strategy="zero3", batch_size=4, seq_len=1024))
    print(plan.format())

[Note: layout plan]
For every pipeline stage, this builds the stage a rank of that stage builds
(``build_stage`` over a :class:`LayoutMesh`: sizes and coordinates, no
communicator; tensor-parallel rank 0, which holds the larger share of an uneven
split) and adds up, per rank and step:

* model state and transient buffers: the strategy's :func:`plan_memory` of
  that stage over ``dp`` (ZeRO's units, DDP's buckets, 16-bit copies);
* activations: ``model.activation_bytes`` of one micro-batch (the model counts
  what its ops keep, see [Note: activation bytes] for the GPT) times the
  micro-batches the schedule keeps alive at once on that stage: 1 without a
  pipeline (micro-batches run forward and backward one at a time), ``m`` under
  GPipe, ``min(p - s, m)`` under 1F1B;
* bus bytes ([Note: bus bytes]) per axis: dp from the strategy; tp from the
  plan's styles, per micro-batch: the forward all-reduce after every
  row-parallel layer and vocabulary-parallel embedding (twice for layers inside
  checkpointed blocks: the recompute repeats it), the backward all-reduce in
  front of every column-parallel layer (after a layer the plan keeps whole, such
  as key/value projections tp does not divide), the loss's three all-reduces of one
  number per row; pp: the activations and gradients each stage sends and
  receives per micro-batch, and the step's loss broadcast; the tied parameter's
  gradient summed between the first and the last stage.

The busiest stage (the most bytes) is what ``mpishard estimate`` and the plan
of ``mpishard train`` print. The model given is consumed: its layers may be
swapped for tensor-parallel ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..dtypes import resolve_dtype
from ..nn.plan import ColumnParallel, RowParallel, VocabParallel, VocabParallelLoss, plan_of
from .compose import build_stage
from .planner import MemoryPlan, plan_memory
from .precision import Precision
from .tensor_parallel import ColumnParallelLinear, _matching

__all__ = ["Layout", "LayoutMesh", "StagePlan", "LayoutPlan", "plan_layout"]


@dataclass(frozen=True)
class Layout:
    """A layout to plan: mesh sizes, strategy, precision and the batch of one rank.

    ``batch_size`` is sequences per dp rank per micro-batch, ``micro_batches``
    per step (the pipeline's ``m``), ``seq_len`` tokens per sequence.
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


class _Axis:
    """A mesh axis as far as building a stage needs it: a size and this rank's index."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank


class LayoutMesh:
    """The sizes and coordinates of a mesh, without communicators (for planning)."""

    def __init__(self, dp: int, tp: int, pp: int, pp_rank: int = 0, tp_rank: int = 0):
        self.dp, self.tp, self.pp = _Axis(dp, 0), _Axis(tp, tp_rank), _Axis(pp, pp_rank)
        self.shape = {"pp": pp, "dp": dp, "tp": tp}


@dataclass
class StagePlan:
    """One pipeline stage's per-rank figures: memory, activations, bus bytes per axis."""

    stage: int
    memory: MemoryPlan
    activation_bytes: int = 0
    micro_batches_alive: int = 1
    bus_bytes: dict = field(default_factory=dict)    # axis -> bytes per step

    @property
    def total_peak_bytes(self) -> int:
        return self.memory.total_peak_bytes + self.activation_bytes


@dataclass
class LayoutPlan:
    """Every stage's :class:`StagePlan`; ``busiest`` is the one with the most bytes."""

    layout: Layout
    n_params: int
    stages: list
    activations_known: bool = True

    @property
    def busiest(self) -> StagePlan:
        return max(self.stages, key=lambda s: s.total_peak_bytes)

    @property
    def total_peak_bytes(self) -> int:
        return self.busiest.total_peak_bytes

    def format(self) -> str:
        lay, stage = self.layout, self.busiest
        m = stage.memory

        def mib(n):
            return f"{n / 2**20:10.2f} MiB"
        mixed = f", {m.precision}" if m.precision else ""
        rows = [f"{lay.strategy} on dp={lay.dp} x tp={lay.tp} x pp={lay.pp}: "
                f"{self.n_params:,} parameters, {m.itemsize}-byte masters{mixed}; per rank:"]
        if lay.pp > 1:
            rows.append(f"  (the busiest ranks: pipeline stage {stage.stage} of {lay.pp}, "
                        f"stages 0..{lay.pp - 1})")
        rows += [f"  {k:<12}{mib(v)}" for k, v in m.steady.items()]
        labels = {"gathered": "gathered", "comm": "comm buffers"}
        rows += [f"  {labels.get(k, k):<12}{mib(v)}  (peak, transient)" for k, v in m.peak.items()]
        if self.activations_known:
            rows.append(f"  {'activations':<12}{mib(stage.activation_bytes)}  (peak: "
                        f"{stage.micro_batches_alive} micro-batch(es) of {lay.batch_size} x "
                        f"{lay.seq_len} kept for backward"
                        + (", checkpointed" if lay.activation_checkpointing else "") + ")")
        else:
            rows.append(f"  {'activations':<12}{'(not estimated for this model)':>14}")
        rows.append(f"  {'total':<12}{mib(stage.total_peak_bytes)}  (model state "
                    f"{m.model_state_bytes / 2**20:.2f} MiB)")
        per_axis = ", ".join(f"{axis} {n / 2**20:.2f}" for axis, n in stage.bus_bytes.items())
        rows.append(f"  {'traffic':<12}{mib(sum(stage.bus_bytes.values()))}  bus bytes per step "
                    f"({per_axis} MiB)")
        return "\n".join(rows)


def _alive(layout: Layout, stage: int) -> int:
    m, p = layout.micro_batches, layout.pp
    if p == 1:
        return 1
    return m if layout.schedule == "gpipe" else min(p - stage, m)


def _itemsizes(model, layout: Layout) -> tuple:
    """(activation itemsize, all-reduce itemsize, gradient itemsize) of the layout."""
    params = model.parameters()
    master = np.dtype(params[0].spec.dtype) if params else np.dtype("float32")
    policy = Precision.of(layout.precision)
    act = resolve_dtype(policy.param_dtype) if policy.mixed else master
    wire = 4 if act.name == "bfloat16" else act.itemsize    # bfloat16 is summed in float32
    grad = resolve_dtype(policy.reduce_dtype).itemsize if policy.mixed else master.itemsize
    return act, wire, grad


def _tp_bytes(stage, layout: Layout, plan, wire: int, act) -> int:
    """Bus bytes of one step's tensor-parallel all-reduces on this stage (see the note)."""
    tp = layout.tp
    if tp == 1:
        return 0
    rows = layout.batch_size * layout.seq_len
    blocks = plan.pipeline.blocks + "." if plan.pipeline is not None else None
    loss_item = 4 if act.itemsize == 2 else act.itemsize   # 16-bit logits: float32 rows
    held_only = set(plan.pipeline.first) if plan.pipeline and not stage.first_stage else set()
    nbytes = 0
    for pattern, style in plan.tensor:
        for path, module in _matching(stage, pattern):
            if path in held_only:    # e.g. the token table on the last stage: only tied
                continue
            again = 2 if (layout.activation_checkpointing and blocks
                          and path.startswith(blocks)) else 1
            if isinstance(style, RowParallel):          # forward sum of the outputs
                nbytes += again * rows * module.out_features * wire
            elif isinstance(style, VocabParallel):      # forward sum of the looked-up rows
                nbytes += rows * module.embedding_dim * wire
            elif isinstance(style, ColumnParallel) and isinstance(module, ColumnParallelLinear):
                nbytes += rows * module.in_features * wire      # backward: the input's gradient
            elif isinstance(style, ColumnParallel):     # kept whole: its output's gradient
                nbytes += rows * module.out_features * wire
            elif isinstance(style, VocabParallelLoss):  # row maxima, sums, target logits
                nbytes += 3 * rows * loss_item
    return int(round(2 * (tp - 1) / tp * nbytes * layout.micro_batches))


def _pp_bytes(stage, layout: Layout, act) -> int:
    if layout.pp == 1:
        return 0
    shape = stage.activation_shape(layout.batch_size, layout.seq_len)
    one = int(np.prod(shape)) * act.itemsize
    sides = int(not stage.first_stage) + int(not stage.last_stage)
    return 2 * sides * one * layout.micro_batches + 8      # sends + receives, loss broadcast


def _tie_bytes(stage, layout: Layout, plan, grad: int) -> int:
    if layout.pp == 1 or not (stage.first_stage or stage.last_stage):
        return 0
    names = dict(stage.named_parameters(remove_duplicate=False))
    return sum(names[source].size * grad for _, source in plan.tied if source in names)


def plan_layout(model, layout: Layout, stage_plan=None) -> LayoutPlan:
    """Per-rank memory (with activations) and traffic of ``layout`` for ``model``.

    ``model`` is whole and unmaterialised; see [Note: layout plan].
    """
    plan = plan_of(model)
    act, wire, grad = _itemsizes(model, layout)
    n_params = model.num_parameters()
    stages = []
    for s in range(layout.pp):
        stage = build_stage(model, LayoutMesh(layout.dp, layout.tp, layout.pp, s), stage_plan)
        if layout.activation_checkpointing and hasattr(stage, "set_activation_checkpointing"):
            stage.set_activation_checkpointing(True)
        memory = plan_memory(stage, layout.strategy, layout.dp, layout.optimizer,
                             precision=layout.precision, micro_batches=layout.micro_batches)
        activation = getattr(stage, "activation_bytes", None)
        alive = _alive(layout, s)
        per_micro = activation(layout.batch_size, layout.seq_len, act) if activation else 0
        bus = {"dp": memory.bus_bytes_per_step, "tp": _tp_bytes(stage, layout, plan, wire, act),
               "pp": _pp_bytes(stage, layout, act)}
        tie = _tie_bytes(stage, layout, plan, grad)
        if tie:
            bus["tied"] = tie
        stages.append(StagePlan(s, memory, per_micro * alive, alive, bus))
    return LayoutPlan(layout, n_params, stages,
                      activations_known=hasattr(model, "activation_bytes"))

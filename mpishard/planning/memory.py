"""Memory planner: per-rank bytes by category before spending any compute.

``estimate_memory`` reads what the registered strategy keeps sharded between
steps (its :class:`~mpishard.parallel.strategy.Sharded` level, see [Note:
strategy contract]) and applies that level's formula (model_state.py), which
reads the same layout the strategy builds (ZeRO: the units of [Note: flat unit
layout]) from an unmaterialised model, so the figures are the ledger's figures:
steady-state bytes for parameters, gradients and optimizer state, and peaks for
the transient categories (gathered units, communication buffers). It also predicts the bus bytes each rank moves per step, in all and
per mesh group (``bus_bytes_by_group``: ``"dp_cp"`` for DDP's all-reduce,
``"dp_shard_cp"`` and ``"dp_replicate"`` for ZeRO's shard group and replicas).
:func:`stage_traffic` adds what a pipeline stage moves over ``tp``, ``cp`` and
``pp`` (see [Note: layout plan] in layout.py, which puts the two together).

    >>> plan = estimate_memory(GPT(cfg, materialize_now=False), "zero3", dp_size=4)
    >>> print(plan.format())
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from mpishard.core.dtypes import resolve_dtype
from mpishard.models import spec_of
from mpishard.nn.sharding import ColumnParallel, RowParallel, VocabParallel, VocabParallelLoss
from mpishard.parallel.context.attention import ring_kv_bytes
from mpishard.parallel.offload import check_offload
from mpishard.parallel.precision import Precision
from mpishard.parallel.plans import matching_modules
from mpishard.parallel.strategy import Sharded, strategy_entry
from mpishard.parallel.tensor.layers import ColumnParallelLinear
from mpishard.planning.model_state import replicated_state, sharded_state
from mpishard.planning.offload import HostTraffic

__all__ = ["MemoryEstimate", "EstimateSizes", "estimate_memory", "OPTIMIZER_STATES",
           "layout_itemsizes", "stage_traffic", "host_rows"]

#: flat state arrays per parameter element
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1}


@dataclass
class MemoryEstimate:
    """Predicted per-rank bytes (dp rank 0; every dp rank holds the same sizes).

    ``bus_bytes_by_group`` splits ``bus_bytes_per_step`` by the mesh group that
    moves it (a :class:`~mpishard.comm.Mesh` attribute name); empty: all of it
    over ``dp_cp``, every rank holding the same parameters.
    """

    strategy: str
    dp_size: int
    n_params: int
    itemsize: int
    steady: dict = field(default_factory=dict)   # params, grads, optim
    peak: dict = field(default_factory=dict)     # gathered, comm
    bus_bytes_per_step: int = 0
    precision: str | None = None                 # e.g. "float16 compute, float32 gradients"
    bus_bytes_by_group: dict = field(default_factory=dict)   # mesh group -> bytes per step
    host: dict = field(default_factory=dict)     # offloaded: params, grads, optim, comm in host memory
    host_traffic: HostTraffic | None = None      # offloaded: what a step copies and updates there
    at_step: dict = field(default_factory=dict)  # made at the optimizer step, gone by the next
    # forward (ZeRO-1's float32 gradient shard): alive with no activations or ``peak``
    norm_grad_bytes: int | None = None   # the gradients clipping's norm reads (the optimizer's:
    # ZeRO's shards, not stage 1's whole buffer); ``None``: ``steady["grads"]``

    @property
    def clipped_grad_bytes(self) -> int:
        """The gradient bytes a step's global norm reads on this rank."""
        if self.norm_grad_bytes is not None:
            return self.norm_grad_bytes
        return self.steady.get("grads", 0)

    def peak_over(self, activation_bytes: int = 0) -> int:
        """The most bytes held at once: model state plus the larger of what forward and
        backward add (``peak`` and ``activation_bytes``) and what the step adds."""
        return self.model_state_bytes + max(sum(self.peak.values()) + activation_bytes,
                                            sum(self.at_step.values()))

    @property
    def model_state_bytes(self) -> int:
        """Parameters + gradients + optimizer state held between steps."""
        return sum(self.steady.values())

    @property
    def total_peak_bytes(self) -> int:
        return self.peak_over()

    def format(self) -> str:
        def mib(n):
            return f"{n / 2**20:10.2f} MiB"
        mixed = f" ({self.precision})" if self.precision else ""
        rows = [f"{self.strategy} on dp={self.dp_size}: {self.n_params:,} parameters, "
                f"{self.itemsize}-byte masters{mixed}; per rank:"]
        for k, v in self.steady.items():
            rows.append(f"  {k:<10}{mib(v)}")
        for k, v in self.peak.items():
            rows.append(f"  {k:<10}{mib(v)}  (peak, transient)")
        rows += at_step_rows(self.at_step, 10)
        rows += host_rows(self.host, 10)
        rows.append(f"  {'total':<10}{mib(self.total_peak_bytes)}  (model state "
                    f"{self.model_state_bytes / 2**20:.2f} MiB)")
        rows.append(f"  comm      {self.bus_bytes_per_step / 2**20:10.2f} MiB bus bytes per step")
        return "\n".join(rows)


@dataclass(frozen=True)
class EstimateSizes:
    """What the model-state formulas of model_state.py read.

    Attributes:
        strategy: the registered name being planned.
        dp_size: the data-parallel size ``N``: every rank holding the same
            parameters (``dp x cp`` on a mesh with context parallelism).
        n_params: parameter elements on this rank before sharding.
        itemsize: bytes of a master element (and of optimizer state).
        compute_itemsize: bytes of a compute-copy element (``itemsize`` unless mixed).
        reduce_itemsize: bytes of a gradient element in reduction.
        mixed: whether a 16-bit compute copy exists.
        n_states: optimizer state arrays per element.
        precision: a description for the plan's header, or ``None``.
        micro_batches: forward/backward passes per step (ZeRO-3 gathers in each).
        dp_replicate: replicas of a sharded state among the ``dp_size`` ranks
            (hybrid sharding: ZeRO shards over ``dp_size / dp_replicate``).
        ep: expert-parallel size: experts split over ep are replicated over
            ``dp_size / ep`` ranks (``edp``) and ZeRO shards them over
            ``shard_size / ep`` (``edp_shard``).
        offload: ``"none"``, ``"optimizer"`` or ``"params"`` (see [Note: offload plan]
            in offload.py).
    """

    strategy: str
    dp_size: int
    n_params: int
    itemsize: int
    compute_itemsize: int
    reduce_itemsize: int
    mixed: bool
    n_states: int
    precision: str | None = None
    micro_batches: int = 1
    dp_replicate: int = 1
    ep: int = 1
    offload: str = "none"

    @property
    def factor(self) -> float:
        """``(N - 1) / N``: the share of a buffer a reduce-scatter or all-gather moves."""
        return (self.dp_size - 1) / self.dp_size

    @property
    def shard_size(self) -> int:
        """The ranks one sharded copy is spread over, ``dp_size / dp_replicate``."""
        return self.dp_size // self.dp_replicate

    def expert_split(self, model) -> tuple:
        """``(dense elements, expert elements)`` of ``model`` on this rank (experts split
        over ep counted by their local shape)."""
        experts = sum(p.size for p in model.parameters() if p.spec.ep_range is not None)
        return self.n_params - experts, experts

    def new_plan(self) -> MemoryEstimate:
        """An empty :class:`MemoryEstimate` with this header, for a formula to fill."""
        return MemoryEstimate(self.strategy, self.dp_size, self.n_params, self.itemsize,
                          precision=self.precision)


def estimate_memory(model, strategy: str, dp_size: int, optimizer: str = "adamw",
                dtype: str | None = None, precision=None, micro_batches: int = 1,
                dp_replicate: int = 1, ep: int = 1, offload: str = "none") -> MemoryEstimate:
    """Predict per-rank bytes by ledger category for ``model`` under ``strategy``.

    Args:
        model: a model (materialised or not; only shapes are read). Its
            parameters' ``spec.flat`` is overwritten by ZeRO's unit layout.
        strategy: a name registered in :data:`~mpishard.parallel.STRATEGIES`.
        dp_size: data-parallel size.
        optimizer: key of :data:`OPTIMIZER_STATES`.
        dtype: element dtype (default: the parameters').
        precision: mixed precision as the strategy gets it (``"float16"``, a
            :class:`Precision`): masters and optimizer state in ``dtype``, a
            compute copy in ``param_dtype``, gradient buffers in ``reduce_dtype``.
        micro_batches: forward and backward passes per step (gradients are
            still reduced once).
        dp_replicate: replicas of sharded state (hybrid sharding); divides ``dp_size``.
        ep: expert-parallel size (the model's experts already split over it).
        offload: ``"optimizer"`` or ``"params"``: the categories that run keeps in host
            memory move to :attr:`MemoryEstimate.host` (see [Note: offload plan]).
    """
    entry = strategy_entry(strategy)
    offload = check_offload(offload, entry.cls) or "none"   # what the strategy would refuse
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {list(OPTIMIZER_STATES)}")
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if dp_replicate < 1 or dp_size % dp_replicate:
        raise ValueError(f"dp_replicate={dp_replicate} must divide dp_size={dp_size}; "
                         f"pass a dp_replicate that divides it (1: no hybrid sharding)")
    params = model.parameters()
    b = np.dtype(dtype or params[0].dtype).itemsize
    policy = Precision.of(precision)
    mixed = policy.mixed
    sizes = EstimateSizes(
        strategy, dp_size, sum(p.size for p in params), b,
        compute_itemsize=resolve_dtype(policy.param_dtype).itemsize if mixed else b,
        reduce_itemsize=resolve_dtype(policy.reduce_dtype).itemsize if mixed else b,
        mixed=mixed, n_states=OPTIMIZER_STATES[optimizer],
        precision=(f"{policy.param_dtype} compute, {policy.reduce_dtype} gradients"
                   if mixed else None), micro_batches=micro_batches, dp_replicate=dp_replicate,
        ep=ep, offload=offload or "none")
    if entry.keeps_sharded is Sharded.NOTHING:
        return replicated_state(model, sizes)
    return sharded_state(model, sizes, entry.keeps_sharded,
                         entry.cls.max_inflight_reductions)


def at_step_rows(at_step: dict, width: int) -> list:
    """The plan's lines for what exists at the optimizer step alone (see
    ``MemoryEstimate.at_step``)."""
    return [f"  {'step ' + k:<{width}}{v / 2**20:10.2f} MiB  (at the optimizer step only, "
            f"with no activations)" for k, v in at_step.items() if v]


def host_rows(host: dict, width: int) -> list:
    """The plan's lines for its host bytes (none without offload)."""
    if not host:
        return []
    notes = {"comm": "host memory: CuPy's page-locked staging copies"}
    return [f"  {'host ' + k:<{width}}{v / 2**20:10.2f} MiB  ({notes.get(k, 'host memory')})"
            for k, v in host.items() if v] + \
        [f"  {'host total':<{width}}{sum(host.values()) / 2**20:10.2f} MiB  (host memory)"]


# -- a pipeline stage's traffic (see [Note: layout plan] in layout.py) -----------------
# ``layout`` is a :class:`~mpishard.planning.layout.Layout`; ``stage`` the stage built for it.

def layout_itemsizes(model, layout) -> tuple:
    """(activation dtype, all-reduce itemsize, gradient itemsize) of ``layout`` (its
    :attr:`~mpishard.planning.layout.Layout.policy`: gradients in its ``reduce_dtype``)."""
    params = model.parameters()
    master = np.dtype(params[0].spec.dtype) if params else np.dtype("float32")
    policy = layout.policy
    act = resolve_dtype(policy.param_dtype) if policy.mixed else master
    wire = 4 if act.name == "bfloat16" else act.itemsize    # bfloat16 is summed in float32
    grad = resolve_dtype(policy.reduce_dtype).itemsize if policy.mixed else master.itemsize
    return act, wire, grad


def _again(layout, plan, path: str) -> int:
    """2 for a module inside a checkpointed block (its forward runs again), else 1."""
    blocks = plan.pipeline.blocks + "." if plan.pipeline is not None else None
    return 2 if layout.activation_checkpointing and blocks and path.startswith(blocks) else 1


def kept_products(stage, plan) -> set:
    """Paths of the products recomputation by op keeps: each block's 1st, 3rd, ...
    linear layer in the order they run (see [Note: recomputation by op])."""
    blocks = plan.pipeline.blocks + "." if plan.pipeline is not None else None
    seen: dict = {}
    kept = set()
    for path, m in stage.named_modules():
        w = m._parameters.get("weight")
        if blocks and path.startswith(blocks) and w is not None and len(w.shape) == 2 \
                and type(m).__name__.endswith("Linear"):
            block = path[len(blocks):].split(".", 1)[0]
            seen[block] = seen.get(block, 0) + 1
            if seen[block] % 2:
                kept.add(path)
    return kept


def _tp_bytes(stage, layout, plan, wire: int, act) -> int:
    """Bus bytes of one step's tensor-parallel collectives on this stage."""
    tp = layout.tp
    if tp == 1:
        return 0
    # a kept product's output is not made again, nor (sequence parallel) its input gathered
    kept = kept_products(stage, plan) if layout.keep_products else set()
    sp, c = layout.sequence_parallel, act.itemsize
    rows = layout.batch_size * layout.local_seq_len
    loss_item = 4 if c == 2 else c                         # 16-bit logits: float32 rows
    held_only = set(plan.pipeline.first) if plan.pipeline and not stage.first_stage else set()
    ring = 0      # all-reduces count 2 (tp - 1) / tp, gathers and scatters (tp - 1) / tp
    for pattern, style in plan.tensor:
        for path, module in matching_modules(stage, pattern):
            if path in held_only:    # e.g. the token table on the last stage: only tied
                continue
            again = _again(layout, plan, path)
            if isinstance(style, RowParallel):          # forward sum of the outputs
                out = rows * module.out_features
                ring += again * out * wire + out * c if sp else 2 * again * out * wire
            elif isinstance(style, VocabParallel):      # forward sum of the looked-up rows
                ring += 2 * rows * module.embedding_dim * wire
            elif isinstance(style, ColumnParallel) and isinstance(module, ColumnParallelLinear):
                inp = rows * module.in_features         # the input's gradient; under sp the
                # input gathered (again in backward) and its gradient reduce-scattered
                gathers = 1 if path in kept else again
                ring += (gathers + 1) * inp * c + inp * wire if sp else 2 * inp * wire
            elif isinstance(style, ColumnParallel) and sp:  # kept whole, from gathered rows
                inp = rows * module.in_features
                ring += again * inp * c + inp * wire
            elif isinstance(style, ColumnParallel):     # kept whole: its output's gradient
                ring += 2 * rows * module.out_features * wire
            elif isinstance(style, VocabParallelLoss):  # row maxima, sums, target logits
                ring += 2 * 3 * rows * loss_item
    if sp:
        ring += _sp_extra(stage, layout, plan, rows, wire, act)
    return int(round((tp - 1) / tp * ring * layout.micro_batches))


def _sp_extra(stage, layout, plan, rows: int, wire: int, act) -> int:
    """Sequence parallelism's other collectives (in all-gather units): the backward
    all-gather of the embeddings' cut rows, and the gradient sums (all-reduces) of the
    tp-replicated parameters the split rows reach, once a micro-batch."""
    total = 0
    if plan.sequence_entry and getattr(stage, "first_stage", True):
        total += rows * stage.activation_shape(1, 1)[1] * act.itemsize
    first = tuple(plan.pipeline.first) if plan.pipeline is not None else ()
    for path, owner in stage.named_modules():
        if any(path == f or path.startswith(f + ".") for f in first):
            continue
        total += sum(2 * p.size * wire for p in owner._parameters.values()
                     if p is not None and p.spec.tp_dim is None)
    return total


def _local_heads(stage, module) -> tuple:
    """``(heads, head_size)`` of an attention module of ``stage`` on this tp rank (its
    query heads), as the model's spec reads them."""
    return spec_of(stage).attention_heads(module)


def cp_attention_bytes(stage, layout, plan, act, kv_share: float = 1.0,
                       grad_itemsize: int | None = None) -> int:
    """Bus bytes of one step's context-parallel attention on this stage: mpishard's,
    whose K/V blocks travel expanded to the query heads and their gradients in float32
    under 16-bit compute; ``kv_share`` (the key/value heads over the query heads) and
    ``grad_itemsize`` cost a framework that sends them grouped and in another dtype
    (``KernelSet.cp_grouped_kv``)."""
    cp = layout.cp
    if cp == 1:
        return 0
    c = act.itemsize
    g = grad_itemsize or (4 if c == 2 else c)
    B, n = layout.batch_size, layout.local_seq_len
    total = 0.0
    for pattern in plan.attention:
        for path, module in matching_modules(stage, pattern):
            h, hs = _local_heads(stage, module)
            kv = h * kv_share
            # the exchange is inside attention's core: selective recomputation repeats it
            again = 2 if layout.selective else _again(layout, plan, path)
            if layout.cp_mode == "ring":    # each block sent and received; a recompute
                block = B * n * 2 * kv * hs  # passes the K/V blocks around once more
                total += 2 * (ring_kv_bytes(B, layout.seq_len, kv, hs, cp, c, g)
                              + (again - 1) * (cp - 1) * block * c)
            else:                           # q|k|v and the output, each way
                total += (cp - 1) / cp * B * n * (2 * h + 2 * kv) * hs * (again + 1) * c
    return int(round(total * layout.micro_batches))


def _pp_message(stage, layout, act) -> tuple:
    """``(bytes of one pipeline message, messages a micro-batch receives, gathered)``: a
    message is a tp rank's block of the boundary's rows under sequence parallelism,
    and without it where they divide by tp (``gathered``: the receiver all-gathers the
    rest over tp; see [Note: scattered pipeline messages] in
    mpishard/parallel/pipeline/schedule.py)."""
    rows, width = stage.activation_shape(layout.batch_size, layout.local_seq_len)
    whole = rows * width * act.itemsize
    gathered = layout.tp > 1 and not layout.sequence_parallel and rows % layout.tp == 0
    split = layout.tp if layout.sequence_parallel or gathered else 1
    sides = sum(int(not chunk.first_stage) + int(not chunk.last_stage)   # each model chunk's
                for chunk in getattr(stage, "chunks", [stage]))          # (interleaved)
    return whole // split, sides, gathered


def _pp_bytes(stage, layout, act) -> int:
    if layout.pp == 1:
        return 0
    one, sides, _ = _pp_message(stage, layout, act)
    return 2 * sides * one * layout.micro_batches + 8      # sends + receives, loss broadcast


def _pp_gather_bytes(stage, layout, act) -> int:
    """Bus bytes over tp of the all-gathers that complete scattered pipeline messages."""
    if layout.pp == 1:
        return 0
    one, sides, gathered = _pp_message(stage, layout, act)
    return (layout.tp - 1) * one * sides * layout.micro_batches if gathered else 0


def _tie_bytes(stage, layout, plan, grad: int) -> int:
    if layout.pp == 1 or not (stage.first_stage or stage.last_stage):
        return 0
    names = dict(stage.named_parameters(remove_duplicate=False))
    return sum(names[source].size * grad for _, source in plan.tied if source in names)


def _ep_bytes(stage, layout, plan, act) -> int:
    """Expert parallelism's all-to-alls per step, with the routing even: per MoE layer
    and micro-batch the counts (``E`` integers) and, forward and again in backward, the
    routed rows out and back, ``(ep - 1) / ep`` of them leaving the rank (rows per
    expert capped by a capacity; the forward's again inside checkpointed blocks)."""
    ep = layout.ep
    if ep == 1:
        return 0
    sp = layout.tp if layout.sequence_parallel else 1
    rows = layout.batch_size * layout.local_seq_len // sp
    total = 0
    for path, moe in stage.named_modules():
        if getattr(moe, "dispatch", None) is None:
            continue
        E, k, C = moe.n_experts, moe.top_k, stage.activation_shape(1, 1)[1]
        routed = rows * k
        if moe.capacity is not None:
            routed = min(routed, E * math.ceil(moe.capacity * rows * k / E))
        again = _again(layout, plan, path)
        total += again * E * 8 + (2 * again + 2) * routed * C * act.itemsize
    return int(round((ep - 1) / ep * total * layout.micro_batches))


def stage_traffic(stage, layout, plan, act, wire: int, grad: int) -> dict:
    """Bus bytes per step of ``stage`` by mesh group: ``tp``, ``cp``, ``pp``, ``ep`` and
    (between the pipeline's ends) ``tied``, from :func:`layout_itemsizes`' sizes."""
    return {"tp": _tp_bytes(stage, layout, plan, wire, act)
            + _pp_gather_bytes(stage, layout, act),
            "cp": cp_attention_bytes(stage, layout, plan, act),
            "pp": _pp_bytes(stage, layout, act),
            "ep": _ep_bytes(stage, layout, plan, act),
            "tied": _tie_bytes(stage, layout, plan, grad)}

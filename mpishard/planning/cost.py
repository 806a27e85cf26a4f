"""Predicted step time of a layout on a machine: compute, communication, bubble, with the breakdown.

    cost = predict_step(lambda: Llama(cfg, materialize_now=False), layout,
                        load_machine("h100-sxm"))
    cost.seconds, cost.tokens_per_s, cost.mfu, cost.breakdown

[Note: step-time model]
Per step, on the busiest pipeline stage (the stage with the longest time):

* **compute** per micro-batch: the matrix products' FLOPs of this rank's part
  (every linear layer, ``2 rows in out`` forward, twice that backward; attention's
  scores and weighted values, ``4 B T_local T h hs`` forward; the experts' rows;
  the blocks' forward once more under activation checkpointing) at
  ``peak x matmul_efficiency`` plus ``matmul_overhead_s`` per product; the
  elementwise work, the activation bytes the forward keeps at the machine's
  ``activation_rate`` for the model's ops (calibrated per family's set: GPT's layer
  norm and GELU, the Llama family's RMS norm and SwiGLU; else three streams of them,
  written forward, read and their gradients written backward, at the memory's elementwise
  bandwidth), a third more for a checkpointed forward; ``op_overhead_s`` per op.
  On a machine with a ``matmul_efficiency_table`` (the shipped GPUs) instead
  kernel by kernel, see [Note: GPU kernel model] (``gpu_time.py``): the
  breakdown's ``compute <class>`` rows, recomputation inside them.
* **bubble**: a pipeline runs ``m + p - 1`` micro-batch slots for ``m``
  micro-batches (GPipe and 1F1B alike), so ``(p - 1)`` slots idle; interleaved
  over ``V`` chunks per rank, ``V m + p - 1`` chunk slots of ``1 / V`` the time,
  so ``(p - 1) / V`` micro-batch slots idle.
* **shared node**: see [Note: ranks sharing a node].
* **communication** per mesh group: the planner's bus bytes per step (exact,
  see [Note: layout plan]) over the group's link, plus its latency per call;
  a group spans nodes when its ranks do (block placement, ``ranks_per_node``), and
  its rings then cross them on as many NICs as it has ranks on a node, up to the
  machine's ``rails`` (see [Note: rails] in machine.py).
  On a machine that overlaps (``overlap``), what hides behind computation is
  taken off: DDP's bucket all-reduces behind backward (the last bucket stays),
  ZeRO-3's prefetched gathers and reduce-scatters behind the compute, ZeRO-1/2's
  reduce-scatters behind backward (their all-gather after the update stays);
  DDP and ZeRO-1/2 reduce on the last micro-batch only (``no_sync`` before it, as
  mpishard and Megatron-LM's ``forward_backward_no_pipelining`` do), so only that
  micro-batch's backward hides them, and DDP's last bucket holds the embeddings,
  whose gradients are complete only when backward ends;
  the ring's K/V passes behind attention; tensor-parallel, all-to-all, pipeline
  and replica all-reduces stay exposed (``dp_overlap=False``: the data-parallel
  reduction too), but for a framework that overlaps sequence parallelism's
  collectives with the products (``KernelSet.tp_overlap``: all but the forward
  reduce-scatters' last split hide). What hides still costs the compute it
  runs beside: the link's ``processor_usage`` of its seconds (the ``overlap``
  row: a collective's kernels take SMs and memory bandwidth; Calculon's 0.15 over
  NVLink, 0.02 over InfiniBand). Without overlap (a CPU: the same cores copy) everything is
  exposed. Under sequence parallelism the tp group's bytes go at the link's
  all-gather and reduce-scatter bandwidth; on a kernel-costed machine a
  stage's pipeline sends and receives cross a full-duplex link at once (half
  the planned bytes on the wire each way). Without sequence parallelism a
  pipeline message crosses as ``1 / tp`` of it per tp rank, then an all-gather
  over the tp group (mpishard's runs as Megatron-LM's: the plan's pp and tp bytes,
  see [Note: scattered pipeline messages] in mpishard/parallel/pipeline/schedule.py).
* **optimizer**: the model state the update touches (its targets' values,
  gradients and AdamW states: under ZeRO-1/2 the shard, not the whole
  parameters and gradients those stages also keep) at the calibrated optimizer
  rate plus a cost per target array (every parameter under full-precision DDP,
  one flat array per ZeRO unit; the rate of the host kernel's path for a step of
  that size), else one read and one write of it; and gradient clipping's global
  norm (on by default in training), over the gradients the rank's optimizer steps
  (ZeRO's shard, not the whole buffer ZeRO-1 also keeps) at the calibrated
  ``grad_norm_rate`` where there is one.

Step time is the sum; tokens/s the global batch's tokens over it; MFU the
model's FLOPs (forward and backward, no recomputation) over step time x ranks x
peak. What it leaves out: kernel-level fusion, stragglers and network
contention between groups, and the exact routing of mixtures of experts (even
routing is assumed).

[Note: ranks sharing a node]
A calibration times compute on one rank alone (the others asleep); in a run every
rank of a node computes at once. Ranks beyond a CPU's cores take turns (``share``
ranks per core); at any count they share the memory bus and the last-level cache,
and ranks that take turns refill their caches after each other's slices. The
calibration measures what that costs: a training step of the model (a
data-parallel rank's share of the batch) on ``n`` ranks at once, meeting at a
barrier before and after each step (a step ends when its slowest rank does: its
next collective waits for it; where ranks take turns, the last to finish does so
milliseconds after the first), each rank's time over one rank's alone
(``busy_slowdown``: 1.02-1.13x for 2 ranks and 2.25-2.50x for 4 on a 2-core machine,
where turns alone would be 2x). The step's compute and optimizer take that many
times as long (the breakdown's ``shared node`` row is the extra). MPI libraries
wait by spinning, so a rank waiting in the bubble keeps its turns: the bubble takes
``share`` times as long. The measured collectives already include the sharing.
Without a calibration (or on a GPU) compute takes ``share`` times as long.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from mpishard.models import spec_of
from mpishard.nn.sharding import plan_of
from mpishard.parallel.compose import build_stage
from mpishard.parallel.strategy import Sharded, strategy_entry
from mpishard.planning.gpu_time import (MPISHARD_KERNELS, KernelSet, micro_batch_times,
                                        moe_rows, stage_ops)
from mpishard.planning.layout import estimate_layout, memo_for, mesh_shape
from mpishard.planning.memory import cp_attention_bytes, layout_itemsizes
from mpishard.planning.offload import offload_seconds
from mpishard.parallel.plans import matching_modules

__all__ = ["StepCost", "predict_step", "stage_flops", "group_spans_nodes",
           "group_ranks_on_node"]


@dataclass
class StepCost:
    """A layout's predicted step: seconds, tokens/s, MFU, and where the time goes."""

    seconds: float
    tokens_per_s: float
    mfu: float
    breakdown: dict = field(default_factory=dict)      # part -> seconds (busiest stage)
    comm_total: dict = field(default_factory=dict)     # group -> seconds before overlap
    model_flops: float = 0.0
    stage: int = 0

    @property
    def exposed_comm(self) -> float:
        return sum(v for k, v in self.breakdown.items() if k.startswith("comm "))


def stage_flops(stage, layout) -> dict:
    """Forward FLOPs of one micro-batch on this rank: ``{"blocks": ..., "rest": ...,
    "products": count, "attention": ..., "kept": ...}`` (blocks: what activation
    checkpointing recomputes; attention: its share of both, what selective recomputation
    does; kept: the blocks' 1st, 3rd, ... products, what recomputation by op does not)."""
    plan = plan_of(stage)
    rows = layout.batch_size * layout.local_seq_len
    blocks = plan.pipeline.blocks + "." if plan.pipeline is not None else None
    out = {"blocks": 0.0, "rest": 0.0, "products": 0, "attention": 0.0, "kept": 0.0}
    seen: dict = {}      # a block -> its products so far (the 1st, 3rd, ... kept by op)

    def add(path, flops, products):
        key = "blocks" if blocks and path.startswith(blocks) else "rest"
        out[key] += flops
        out["products"] += products
    for path, m in stage.named_modules():
        w = m._parameters.get("weight")
        if w is not None and len(w.shape) == 2 and type(m).__name__.endswith("Linear"):
            flops = 2.0 * rows * w.shape[0] * w.shape[1]
            add(path, flops, 1)
            if blocks and path.startswith(blocks):
                block = path[len(blocks):].split(".", 1)[0]
                seen[block] = seen.get(block, 0) + 1
                out["kept"] += flops if seen[block] % 2 else 0.0
        if hasattr(m, "n_experts") and "experts" in m._modules:
            routed = moe_rows(m, rows)
            weights = [p for p in m.experts._parameters.values() if p is not None
                       and len(p.shape) == 3]
            add(path, sum(2.0 * routed * p.shape[1] * p.shape[2] for p in weights),
                len(weights) * weights[0].shape[0] if weights else 0)
    for pattern in plan.attention:
        for path, m in matching_modules(stage, pattern):
            heads, hs = spec_of(stage).attention_heads(m)
            flops = 4.0 * layout.batch_size * layout.local_seq_len * layout.seq_len * heads * hs
            add(path, flops, 2)
            out["attention"] += flops
    return out


def group_spans_nodes(layout, group: str, ranks_per_node: int, stage: int = 0) -> bool:
    """Whether the ``group`` (a mesh group name, or ``"tied"``: the pipeline's ends) of
    pipeline stage ``stage``'s first rank has ranks on two nodes, with ranks placed on
    nodes in blocks of ``ranks_per_node``."""
    return mesh_shape(layout, stage).groups["pp" if group == "tied" else group] \
        .spans_nodes(ranks_per_node)


@functools.lru_cache(maxsize=4096)
def group_ranks_on_node(layout, group: str, ranks_per_node: int, stage: int = 0) -> int:
    """The fewest ranks the ``group`` of stage ``stage``'s first rank has on any of its
    nodes (see :func:`group_spans_nodes`): what its ring collectives cross nodes with
    (see [Note: rails] in machine.py); the pipeline's ends (``"tied"``) are two ranks,
    one on each end's node. Cached: a search asks for the same ones many times."""
    if group == "tied":
        return 1
    return mesh_shape(layout, stage).groups[group].fewest_ranks_on_a_node(ranks_per_node)


_DP_GROUPS = ("dp_cp", "dp", "edp", "dp_shard_cp", "dp_shard", "edp_shard", "dp_replicate")
_KIND = {"tp": "all_reduce", "cp": "send", "pp": "send", "dp": "all_reduce",
         "dp_cp": "all_reduce", "dp_replicate": "all_reduce", "dp_shard": "all_gather",
         "dp_shard_cp": "all_gather", "ep": "all_to_all", "edp": "all_reduce",
         "edp_shard": "all_gather", "tied": "all_reduce"}


def _calls(layout, group: str, n_blocks: int, n_units: int, grad_bytes: float) -> float:
    """Collective calls a step issues on ``group`` (their latency terms)."""
    m = layout.micro_batches
    sharded = strategy_entry(layout.strategy).keeps_sharded
    if group in ("dp_cp", "dp", "edp") and sharded is Sharded.NOTHING:    # 4 MiB buckets
        return max(1.0, np.ceil(grad_bytes / (4 << 20)))
    if group in ("dp_shard_cp", "dp_shard", "dp", "edp_shard", "edp"):    # per unit
        return n_units * ((2 * m + 1) if sharded is Sharded.PARAMETERS else 2)
    if group == "dp_replicate":
        return float(n_units)
    if group == "tp":
        return 4.0 * n_blocks * m + 3 * m
    if group == "cp":
        return (2.0 * (layout.cp - 1) if layout.cp_mode == "ring" else 8.0) * n_blocks * m
    if group == "ep":
        return 5.0 * n_blocks * m
    return 2.0 * m * layout.virtual_stages      # pp: a message each way per chunk boundary


def _kv_share(model) -> float:
    """Key/value heads over query heads of ``model`` (1 without grouped-query attention)."""
    cfg = getattr(model, "config", None)
    heads, kv = getattr(cfg, "n_head", None), getattr(cfg, "n_kv_head", None)
    return kv / heads if heads and kv else 1.0


def _exposed(layout, group: str, seconds: float, calls: float, times: dict,
             overlap: bool, dp_overlap: bool = True, last: float = 0.0,
             tp_overlap: int = 0) -> float:
    """Seconds of ``group``'s communication left after overlap (see [Note: step-time
    model]); ``times``: the step's ``compute``, the ``backward`` a reduction hides behind
    (the last micro-batch's) and ``attention``; ``last``: the seconds of DDP's last
    bucket, when more than an even share; ``tp_overlap``: the splits of the forward
    reduce-scatters of a framework that overlaps sequence parallelism's collectives with
    the products (``KernelSet.tp_overlap``; 0: none)."""
    if not overlap or seconds == 0.0 or (not dp_overlap and group in _DP_GROUPS):
        return seconds
    if group == "tp" and tp_overlap and layout.sequence_parallel:
        return seconds / 4 / tp_overlap        # the forward reduce-scatters' last splits
    last = min(seconds, max(last, seconds / max(calls, 1.0)))
    sharded = strategy_entry(layout.strategy).keeps_sharded
    if sharded is Sharded.NOTHING and group in ("dp_cp", "dp", "edp"):
        return max(last, seconds - times["backward"])
    if group in ("dp_shard_cp", "dp_shard", "dp", "edp_shard", "edp"):
        if sharded is Sharded.PARAMETERS:          # gathered per unit, prefetched
            return max(last, seconds - times["compute"])
        return seconds / 2 + max(0.0, seconds / 2 - times["backward"])
    if group == "cp" and layout.cp_mode == "ring":
        return max(last, seconds - times["attention"])
    return seconds


def predict_step(make_model, layout, machine, ranks_per_node: int | None = None,
                 plan=None, stages=None, memo: dict | None = None, whole=None,
                 kernels: KernelSet = MPISHARD_KERNELS, dp_overlap: bool = True) -> StepCost:
    """The predicted step of ``layout`` for the model ``make_model()`` builds (whole,
    unmaterialised) on ``machine`` (see [Note: step-time model]).

    ``plan`` (the layout's :func:`estimate_layout`) and ``stages`` (stage index -> the
    built stage) reuse what a search already has, ``memo`` its cache (see
    :func:`estimate_layout`) and ``whole`` its whole model (only read); without them
    they are built. ``kernels``: what the framework runs on a machine costed kernel by
    kernel (:class:`~mpishard.planning.gpu_time.KernelSet`; mpishard's CUDA backend by
    default, ``MEGATRON_KERNELS`` for Megatron-LM's runs); ``dp_overlap=False``: the
    data-parallel reduction runs after backward, none of it hidden (Megatron-LM's 2021
    "local" DDP).
    """
    rpn = ranks_per_node or machine.ranks_per_node
    world = layout.dp * layout.cp * layout.tp * layout.pp
    plan = plan or estimate_layout(make_model(), layout)
    whole = whole if whole is not None else make_model()
    act, _, grad = layout_itemsizes(whole, layout)
    dtype = act.name
    busy_ranks = min(rpn, world)
    share = machine.share(busy_ranks)
    slow = machine.slowdown(busy_ranks)
    m, p = layout.micro_batches, layout.pp
    best = None
    total = memo_for(memo, whole)(("whole flops", layout.batch_size, layout.seq_len, layout.cp),
                                 lambda: stage_flops(whole, layout))
    model_flops = 3 * (total["blocks"] + total["rest"]) * m * layout.dp * layout.cp
    for stage_estimate in plan.stages:
        s = stage_estimate.stage
        mesh = mesh_shape(layout, s)
        stage = stages(s) if stages is not None else \
            build_stage(make_model(), mesh, None, layout.cp_mode, layout.sequence_parallel,
                        layout.virtual_stages)
        cached = memo_for(memo, stage)
        fl = cached(("flops", layout.batch_size, layout.seq_len, layout.cp),
                    lambda: stage_flops(stage, layout))
        forward = fl["blocks"] + fl["rest"]
        hardware = 3 * forward + (
            fl["blocks"] - (fl["kept"] if layout.keep_products else 0.0)
            if layout.activation_checkpointing else
            fl["attention"] if layout.selective else 0.0)
        activation = getattr(stage, "activation_bytes", None) and not machine.kernel_model
        kept = cached(("whole activations", layout.batch_size, layout.local_seq_len, act.name),
                      lambda: _whole_activations(stage, layout, act)) if activation else 0
        if machine.kernel_model:             # kernel by kernel (see [Note: GPU kernel model])
            ops = cached(("ops", layout.batch_size, layout.seq_len, layout.cp, act.itemsize,
                          layout.sequence_parallel, layout.keep_products, kernels),
                         lambda: stage_ops(stage, layout, act.itemsize, kernels))
            kernel = micro_batch_times(ops, machine, dtype, layout)
            micro = kernel["forward"] + kernel["backward"] + kernel["recompute"]
            compute = {f"compute {k}": v * m for k, v in kernel["by class"].items() if v}
            times = {"compute": micro * m, "backward": kernel["backward"],
                     "attention": kernel["attention"] * m}
        else:
            recomputed = 1.0 + (1 / 3 if layout.activation_checkpointing else 0.0)
            n_ops = 10 * cached(("modules",), lambda: sum(1 for _ in stage.named_modules()))
            matmul = machine.matmul_seconds(hardware, dtype, 3 * fl["products"])
            family_ops = spec_of(stage).elementwise
            elementwise = machine.activation_seconds(kept, family_ops) * recomputed + \
                n_ops * machine.op_overhead_s
            micro = matmul + elementwise
            attention_share = micro * fl["attention"] / forward if forward else 0.0
            times = {"compute": micro * m, "backward": micro * 2 / 3,
                     "attention": attention_share * m}
            compute = {"matmul": matmul * m, "elementwise": elementwise * m}
        steady = stage_estimate.memory.steady
        optimizer = (machine.optimizer_seconds(_updated_bytes(steady), cached(
            ("targets", layout.strategy, layout.precision), lambda: _targets(stage, layout)))
            + machine.grad_norm_seconds(stage_estimate.memory.clipped_grad_bytes)) * slow
        n_blocks = cached(("blocks",), lambda: _count_blocks(stage))
        n_units = n_blocks + 1
        busy = micro * m
        bubble = micro * (p - 1) / layout.virtual_stages
        breakdown = {**compute, "bubble": bubble, "optimizer": optimizer}
        # ranks sharing a node (see [Note: ranks sharing a node])
        shared = (slow - 1) * busy + (share - 1) * bubble
        if shared > 0:
            breakdown["shared node"] = shared
        comm_total = {}
        for group, nbytes in stage_estimate.bus_bytes.items():
            if not nbytes:
                continue
            calls = _calls(layout, group, n_blocks, n_units,
                           stage_estimate.memory.steady.get("grads", 0))
            kind = "all_gather" if group == "tp" and layout.sequence_parallel else \
                _KIND.get(group, "all_reduce")          # sp: gathers and reduce-scatters
            link = machine.link(kind, _group_size(mesh, group),
                                group_spans_nodes(layout, group, rpn, s),
                                group_ranks_on_node(layout, group, rpn, s), rpn)
            if group == "pp" and machine.kernel_model:
                nbytes /= 2     # a stage's sends and receives cross a full-duplex link at once
            if kernels.grad_reduce_itemsize and (group in _DP_GROUPS or group == "tied"):
                nbytes *= kernels.grad_reduce_itemsize / grad
            if group == "cp" and kernels.cp_grouped_kv:     # grouped K/V, 16-bit gradients
                nbytes += cached(("cp grouped", layout, act.name),
                                 lambda: cp_attention_bytes(stage, layout, plan_of(whole), act,
                                                            _kv_share(whole), act.itemsize)
                                 - cp_attention_bytes(stage, layout, plan_of(whole), act))
            t = link.seconds(nbytes, calls)
            comm_total[group] = t
            last = 0.0
            if group in _DP_GROUPS and machine.kernel_model and \
                    strategy_entry(layout.strategy).keeps_sharded is Sharded.NOTHING:
                # DDP's last bucket: the embeddings' gradients, complete when backward ends
                size = _group_size(mesh, group)
                last = link.seconds(2 * (size - 1) / size * (kernels.grad_reduce_itemsize or grad)
                                    * cached(("embeddings",), lambda: _embedding_elements(stage)))
            breakdown[f"comm {group}"] = exposed = _exposed(
                layout, group, t, calls, times, machine.overlap, dp_overlap, last,
                kernels.tp_overlap)
            if link.processor_usage and exposed < t:    # the hidden part slows the compute
                breakdown["overlap"] = breakdown.get("overlap", 0.0) + \
                    (t - exposed) * link.processor_usage
        seconds = sum(breakdown.values())
        if best is None or seconds > best[0]:
            best = (seconds, breakdown, comm_total, s)
    seconds, breakdown, comm_total, s = best
    host = next(e.memory.host_traffic for e in plan.stages if e.stage == s)
    if host is not None:     # offloaded: the update runs on the host, nothing overlapped
        breakdown = {**breakdown, "optimizer": 0.0,
                     **offload_seconds(host, machine, min(rpn, world))}
        seconds = sum(breakdown.values())       # (see [Note: offload plan] in offload.py)
    tokens = layout.dp * layout.batch_size * m * layout.seq_len
    mfu = model_flops / (seconds * world * machine.peak(dtype))
    return StepCost(seconds, tokens / seconds, mfu, breakdown, comm_total, model_flops, s)


def _group_size(mesh, group: str) -> int:
    if group == "tied":                              # the pipeline's two ends
        return 2
    return mesh.groups[group].size


def _updated_bytes(steady: dict) -> float:
    """The model state one optimizer step reads and writes: its targets' values,
    gradients and states. Under ZeRO that is the rank's shard of each, not the whole
    parameters (and gradients) stages 1 and 2 also keep: AdamW keeps two float32
    states per updated element (``optim``), and reads and writes its float32 value and
    gradient beside them, so twice the states' bytes; without states, everything."""
    optim = steady.get("optim", 0)
    return 2.0 * optim if optim else float(sum(steady.values()))


def _targets(stage, layout) -> int:
    """The optimizer's target arrays: every parameter under DDP in full precision (one
    flat master when mixed), one flat shard per unit under ZeRO."""
    if strategy_entry(layout.strategy).keeps_sharded is Sharded.NOTHING:
        return 1 if layout.precision else len(stage.parameters())
    plan = plan_of(stage)
    return len(plan.units) + 1


def _whole_activations(stage, layout, act) -> int:
    """What the forward of one micro-batch keeps without checkpointing, counted as a
    device's kernels keep (``lean=False``: the dropouts' float32 draws, the one-op
    attention's conjugates): a measure of the bytes the
    elementwise passes stream, the same
    for every model whatever the NumPy ops compute again in backward (and the one
    ``mpishard bench calibrate``'s ``activation_rate`` is per), also when checkpointing
    recomputes them."""
    checkpointed = layout.activation_checkpointing and hasattr(stage,
                                                               "set_activation_checkpointing")
    if checkpointed:
        stage.set_activation_checkpointing(False)
    try:
        return stage.activation_bytes(layout.batch_size, layout.local_seq_len, act,
                                      lean=False)
    finally:
        if checkpointed:
            stage.set_activation_checkpointing("op" if layout.keep_products else "full")


def _embedding_elements(stage) -> int:
    """Elements of the stage's embedding tables (their gradients complete last)."""
    return sum(int(np.prod(m.weight.shape)) for _, m in stage.named_modules()
               if "Embedding" in type(m).__name__ and m._parameters.get("weight") is not None)


def _count_blocks(stage) -> int:
    plan = plan_of(stage)
    if plan.pipeline is None:
        return 1
    try:
        return len(stage.get_submodule(plan.pipeline.blocks))
    except KeyError:
        return 1

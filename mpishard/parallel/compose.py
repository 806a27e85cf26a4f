"""Any model with a parallel plan on a pp x dp x cp x tp mesh: pipeline stage,
tensor-parallel layers, context parallelism, then a registered strategy (DDP or ZeRO)
over dp x cp.

    mesh = Mesh(world, dp=2, tp=2, pp=1)
    run = ParallelModel(GPT(GPTConfig(...), materialize_now=False), mesh, strategy="zero3",
                        micro_batches=2)
    opt = AdamW(run.parameters(), lr=3e-4, ledger=run.ledger)
    for step in range(steps):
        loss = run.train_step(x, y)          # x, y: this dp rank's batch (same on tp/pp peers)
        run.step(opt, max_norm=1.0)

Built in this order, each reading the model's own :class:`~mpishard.nn.ShardingPlan`
(see [Note: parallel plans] in mpishard/nn/sharding.py): this rank's pipeline
stage (:func:`build_stage`: the model's ``pipeline_stage`` for the blocks
:func:`partition_blocks` gives it), its tensor-parallel layers over ``mesh.tp``
(:func:`apply_tensor_plan`), the sequence split over ``mesh.cp``
(:func:`apply_context_plan`), then the strategy over ``mesh.dp_cp`` (ZeRO shards over
``dp_shard x cp`` and averages across ``dp_replicate``), driven
micro-batch by micro-batch by a :class:`Pipeline` (also when ``pp == 1``).
With ``virtual_stages=V`` (the interleaved schedule) a rank builds ``V`` such
stages, its model chunks, and the strategy wraps the one module holding them
(see [Note: one strategy over the chunks] in pipeline/chunks.py).
Parameters are materialised from (seed, name) straight into their tp slices
and, under ZeRO, into dp shards: no rank ever holds the whole model.
"""
from __future__ import annotations

import dataclasses

from mpishard.autodiff.tensor import no_grad
from mpishard.nn.sharding import plan_of
from mpishard.parallel.pipeline.chunks import ModelChunks, chunk_blocks
from mpishard.parallel.pipeline.schedule import Pipeline, partition_blocks
from mpishard.parallel.strategy import strategy_entry
from mpishard.parallel.context.apply import apply_context_plan
from mpishard.parallel.expert.layers import apply_expert_plan
from mpishard.parallel.offload import check_offload
from mpishard.parallel.tensor.layers import apply_tensor_plan

__all__ = ["ParallelModel", "build_stage", "check_interleaving", "stage_blocks", "wrap_model"]


def _params_in(model, paths, exclude=()) -> int:
    """Parameter elements of the modules at ``paths`` (that the model has), leaving out
    the parameters in ``exclude`` (ids)."""
    total, seen = 0, set(exclude)
    for path in paths:
        try:
            module = model.get_submodule(path)
        except KeyError:
            continue
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.size
    return total


def stage_blocks(model, pp: int, stage_estimate=None, virtual_stages: int = 1) -> tuple:
    """``(blocks of each of the pp x virtual_stages stages, names of the parameters the
    first stage owns)`` for ``model`` (whole); balanced by parameter count unless
    ``stage_estimate`` gives blocks per stage; equal runs with ``virtual_stages > 1``
    (:func:`~mpishard.parallel.pipeline.chunks.chunk_blocks`: stage ``r + c pp`` is
    chunk ``c`` of pipeline rank ``r``). A model whose structure is frozen (a layout
    search) keeps its answers."""
    plan = plan_of(model)
    if plan.pipeline is None:
        raise ValueError(f"{type(model).__name__} has no pipeline plan (its "
                         f"parallel_plan() has pipeline=None); use pp=1")
    memo = model.structure_cache("stage_blocks")
    key = (pp, tuple(stage_estimate) if stage_estimate is not None else None, virtual_stages)
    if key not in memo:
        pipe = plan.pipeline
        blocks = list(model.get_submodule(pipe.blocks).values())
        first = [(n, p) for n, p in model.named_parameters()
                 if any(n.startswith(f + ".") for f in pipe.first)]
        if virtual_stages > 1:
            if stage_estimate is not None:
                raise ValueError("a stage plan (blocks per stage) with virtual_stages > 1: "
                                 "interleaved chunks are equal runs of blocks; leave it out")
            ranges = chunk_blocks(len(blocks), pp, virtual_stages)
        else:
            ranges = partition_blocks(len(blocks), pp, [b.num_parameters() for b in blocks],
                                      first_extra=_params_in(model, pipe.first),
                                      last_extra=_params_in(model, pipe.last,
                                                            exclude={id(p) for _, p in first}),
                                      plan=stage_estimate)
        memo[key] = (ranges, {n for n, _ in first})
    return memo[key]


def _split_stage(stage, mesh, cp_mode: str, sequence_parallel: bool):
    """Apply the tensor, context and expert plans of ``stage`` over the mesh's axes."""
    apply_tensor_plan(stage, mesh.tp, plan_of(stage), sequence_parallel=sequence_parallel)
    cp = getattr(mesh, "cp", None)
    if cp is not None:
        apply_context_plan(stage, cp, cp_mode, plan_of(stage))
    ep = getattr(mesh, "ep", None)
    if ep is not None:
        apply_expert_plan(stage, ep)
    return stage


def _mark_stage(stage, s: int, first_names: set) -> None:
    """Record the owning stage ``s``; a tied copy of a first-stage parameter held by a
    later stage is a replica (saved once, counted once in norms)."""
    for name, p in stage.named_parameters():
        replica = s > 0 and name in first_names   # held for a tie; owned by stage 0
        p.spec = dataclasses.replace(p.spec, pp_stage=s, replica=p.spec.replica or replica)


def build_stage(model, mesh, stage_estimate=None, cp_mode: str = "ring",
                sequence_parallel: bool = False, virtual_stages: int = 1):
    """This rank's pipeline stage of ``model`` (whole and unmaterialised), with its
    tensor-parallel layers applied over ``mesh.tp``; unmaterialised.

    Stages are balanced by parameter count (``stage_estimate``, blocks per stage,
    overrides it). A tied parameter held by a stage other than its owner's
    (the token table on the last stage) is marked ``spec.replica``. With
    ``virtual_stages=V > 1`` the rank's ``V`` chunks (stages ``r, r + pp, ...`` of
    ``pp V`` equal ones) in one :class:`~mpishard.parallel.pipeline.chunks.ModelChunks`.

    Raises:
        ValueError: ``pp > 1`` for a model without a pipeline plan, more stages
            than blocks, blocks that do not split into ``pp x V`` equal chunks, or a
            tensor-parallel split that does not fit.
    """
    pp, s = mesh.pp.size, mesh.pp.rank
    if virtual_stages > 1:
        if pp < 2:
            raise ValueError(f"virtual_stages = {virtual_stages} with pp = {pp}: interleaved "
                             f"model chunks need pp >= 2; use virtual_stages = 1")
        ranges, first_names = stage_blocks(model, pp, stage_estimate, virtual_stages)
        chunks = []
        for c in range(virtual_stages):
            g = s + c * pp          # this chunk's stage of the pp x V
            chunk = model.pipeline_stage(ranges[g], first_stage=g == 0,
                                         last_stage=g == len(ranges) - 1)
            _mark_stage(_split_stage(chunk, mesh, cp_mode, sequence_parallel), g, first_names)
            chunks.append(chunk)
        return ModelChunks(chunks)
    first_names: set = set()   # parameters the first stage owns (a later stage's are replicas)
    if pp > 1:
        ranges, first_names = stage_blocks(model, pp, stage_estimate)
        model = model.pipeline_stage(ranges[s], first_stage=s == 0, last_stage=s == pp - 1)
    _split_stage(model, mesh, cp_mode, sequence_parallel)
    _mark_stage(model, s, first_names)
    return model


def check_interleaving(schedule: str, virtual_stages: int, pp: int,
                       micro_batches: int) -> None:
    """ValueError naming the fix for model chunks the schedule, ``pp`` or ``m`` cannot
    run (the same on every rank: it reads the arguments only)."""
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"virtual_stages must be an integer >= 1, got {virtual_stages!r}")
    if schedule != "interleaved":
        if virtual_stages > 1:
            raise ValueError(f"virtual_stages = {virtual_stages} needs the interleaved "
                             f"schedule, not {schedule!r}; pass schedule='interleaved' or "
                             f"virtual_stages=1")
        return
    if virtual_stages < 2 or pp < 2:
        raise ValueError(f"the interleaved schedule needs pp >= 2 and virtual_stages >= 2 "
                         f"(model chunks per rank), got pp = {pp}, virtual_stages = "
                         f"{virtual_stages}; pass both, or schedule='1f1b'")
    if micro_batches % pp:
        raise ValueError(f"the interleaved schedule sends micro-batches round the pipeline "
                         f"in groups of pp = {pp}; micro_batches = {micro_batches} is not a "
                         f"multiple of {pp}")


def wrap_model(model, mesh, strategy: str, seed: int | None = None, precision=None,
               offload=None):
    """Wrap ``model`` with the strategy registered as ``strategy`` (``ddp``, ``zero1``,
    ``zero2``, ``zero3``, or any name in :data:`STRATEGIES`).

    An unmaterialised model is materialised from ``seed`` (default
    ``model.seed``), or, under ZeRO, straight into shards. ``precision`` is
    passed on (see :class:`~mpishard.parallel.Precision`), and so is ``offload``
    (``"optimizer"``, ``"params"``: see mpishard/parallel/offload.py) to a strategy
    that takes it.
    """
    entry = strategy_entry(strategy)
    mode = check_offload(offload, entry.cls)
    extra = {"offload": mode} if mode else {}
    return entry.build(model, mesh, seed=seed, precision=precision, **extra)


class ParallelModel:
    """A model trained on any dp x tp x pp factorisation of the world.

    Args:
        model: the whole model, unmaterialised (``materialize_now=False``):
            only its shapes and plan are read; this rank builds its own part.
        mesh: the :class:`~mpishard.comm.Mesh`.
        strategy: a name in :data:`STRATEGIES` (``"ddp"``, ``"zero1"``, ...) over ``mesh.dp``.
        micro_batches: micro-batches per step (the pipeline's ``m``; plain
            gradient accumulation when ``pp == 1``).
        schedule: ``"1f1b"``, ``"gpipe"`` or ``"interleaved"``.
        virtual_stages: model chunks per pipeline rank (``V``; more than 1 only with
            ``"interleaved"``, which needs it at 2 or more, ``pp >= 2``, blocks that
            split into ``pp x V`` equal chunks, ``micro_batches`` a multiple of ``pp``
            and a strategy that keeps parameters whole: ``ddp``, ``zero1``, ``zero2``).
        stage_estimate: blocks per pipeline stage (default: balanced by parameters).
        precision: mixed precision, e.g. ``"bfloat16"`` (see :class:`~mpishard.parallel.Precision`).
        seed: initialisation seed (default: the model's).
        cp_mode: context parallelism's attention, ``"ring"`` or ``"all-to-all"``
            (when ``mesh.cp`` has more than one rank).
        sequence_parallel: Megatron's sequence parallelism with tp: norms and
            residuals hold 1/tp of the rows (see mpishard/parallel/tensor/layers.py).
        offload: ``"optimizer"``: float32 masters and optimizer state in host memory,
            updated there (DDP and ZeRO); ``"params"``: the parameter shards too, copied
            to the device for each all-gather (ZeRO-3; docs/offload.md).
    """

    def __init__(self, model, mesh, strategy: str = "zero3", micro_batches: int = 1,
                 schedule: str = "1f1b", stage_estimate=None, precision=None,
                 seed: int | None = None, cp_mode: str = "ring",
                 sequence_parallel: bool = False, virtual_stages: int = 1, offload=None):
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
        check_interleaving(schedule, virtual_stages, mesh.pp.size, micro_batches)
        plan = plan_of(model)
        self.mesh = mesh
        stage = build_stage(model, mesh, stage_estimate, cp_mode, sequence_parallel,
                            virtual_stages)
        self.sequence = getattr(stage, "sequence", None)   # a SequenceShard under cp
        self.strategy = wrap_model(stage, mesh, strategy, seed, precision, offload)
        tie, tied = None, []
        if mesh.pp.size > 1 and plan.tied:  # first and last stage of each (dp, tp) pipeline
            ends = mesh.pp.rank in (0, mesh.pp.size - 1)
            cp = getattr(mesh, "cp", None)
            column = (mesh.dp.rank * (cp.size if cp else 1) + (cp.rank if cp else 0)) \
                * mesh.tp.size + mesh.tp.rank
            color = column if ends else None
            tie = mesh.world.split(color, name="tied")
            names = dict(self.strategy.module.named_parameters(remove_duplicate=False))
            tied = [names[source] for _, source in plan.tied if source in names] if ends else []
        self.pipeline = Pipeline(self.strategy, mesh, micro_batches, schedule, tie, tied)

    # -- the training loop's verbs -------------------------------------------
    @property
    def module(self):
        """This rank's part of the model (a pipeline stage, tensor-parallel layers)."""
        return self.strategy.module

    @property
    def ledger(self):
        return self.strategy.ledger

    def parameters(self) -> list:
        """The optimizer's targets on this rank."""
        return self.strategy.parameters()

    def _local(self, x, y):
        """This rank's columns of a ``(B, T)`` batch under context parallelism."""
        if self.sequence is None:
            return x, y
        return self.sequence.split(x), self.sequence.split(y)

    def train_step(self, x, y) -> float:
        """Forward and backward of this dp rank's batch (the same on its cp, tp and pp
        peers); returns this rank's share of the mean loss: averaged over ``mesh.dp_cp``
        it is the mean over every valid target of the step (see [Note: global token
        count] in pipeline/schedule.py)."""
        return self.pipeline.train_step(*self._local(x, y))

    def forward_backward(self, x, y):
        """:meth:`train_step` with the loss left unread (a
        :class:`~mpishard.parallel.pipeline.schedule.StepLoss`): ``float(loss)`` after
        :meth:`step`, on every rank, keeps the step free of host reads."""
        return self.pipeline.forward_backward(*self._local(x, y))

    def eval_step(self, x, y) -> float:
        """Mean loss without gradients."""
        self.strategy.eval()
        try:
            with no_grad():
                return self.pipeline.eval_step(*self._local(x, y))
        finally:
            self.strategy.train()

    def step(self, optimizer, max_norm: float | None = None):
        """Reduce gradients over dp, clip over the whole mesh, update; see Strategy.step."""
        return self.strategy.step(optimizer, max_norm)

    def zero_grad(self) -> None:
        """Drop the gradients of a :meth:`train_step` no :meth:`step` took (``step``
        drops its own); see Strategy.zero_grad."""
        self.strategy.zero_grad()

    def gather_full_params(self) -> dict:
        """Name -> whole parameter on every rank (collective over the world; small models)."""
        return self.strategy.gather_full_params()

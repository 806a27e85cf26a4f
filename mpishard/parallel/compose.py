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
Parameters are materialised from (seed, name) straight into their tp slices
and, under ZeRO, into dp shards: no rank ever holds the whole model.
"""
from __future__ import annotations

import dataclasses

from mpishard.autodiff.tensor import no_grad
from mpishard.nn.sharding import plan_of
from mpishard.parallel.pipeline.schedule import Pipeline, partition_blocks
from mpishard.parallel.strategy import strategy_entry
from mpishard.parallel.context.apply import apply_context_plan
from mpishard.parallel.expert.layers import apply_expert_plan
from mpishard.parallel.tensor.layers import apply_tensor_plan

__all__ = ["ParallelModel", "build_stage", "stage_blocks", "wrap_model"]


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


def stage_blocks(model, pp: int, stage_estimate=None) -> tuple:
    """``(blocks of each of the pp stages, names of the parameters the first stage
    owns)`` for ``model`` (whole); balanced by parameter count unless ``stage_estimate``
    gives blocks per stage. A model whose structure is frozen (a layout search)
    keeps its answers."""
    plan = plan_of(model)
    if plan.pipeline is None:
        raise ValueError(f"{type(model).__name__} has no pipeline plan (its "
                         f"parallel_plan() has pipeline=None); use pp=1")
    memo = model.structure_cache("stage_blocks")
    key = (pp, tuple(stage_estimate) if stage_estimate is not None else None)
    if key not in memo:
        pipe = plan.pipeline
        blocks = list(model.get_submodule(pipe.blocks).values())
        first = [(n, p) for n, p in model.named_parameters()
                 if any(n.startswith(f + ".") for f in pipe.first)]
        ranges = partition_blocks(len(blocks), pp, [b.num_parameters() for b in blocks],
                                  first_extra=_params_in(model, pipe.first),
                                  last_extra=_params_in(model, pipe.last,
                                                        exclude={id(p) for _, p in first}),
                                  plan=stage_estimate)
        memo[key] = (ranges, {n for n, _ in first})
    return memo[key]


def build_stage(model, mesh, stage_estimate=None, cp_mode: str = "ring",
                sequence_parallel: bool = False):
    """This rank's pipeline stage of ``model`` (whole and unmaterialised), with its
    tensor-parallel layers applied over ``mesh.tp``; unmaterialised.

    Stages are balanced by parameter count (``stage_estimate``, blocks per stage,
    overrides it). A tied parameter held by a stage other than its owner's
    (the token table on the last stage) is marked ``spec.replica``.

    Raises:
        ValueError: ``pp > 1`` for a model without a pipeline plan, more stages
            than blocks, or a tensor-parallel split that does not fit.
    """
    plan = plan_of(model)
    pp, s = mesh.pp.size, mesh.pp.rank
    first_names: set = set()   # parameters the first stage owns (a later stage's are replicas)
    if pp > 1:
        ranges, first_names = stage_blocks(model, pp, stage_estimate)
        model = model.pipeline_stage(ranges[s], first_stage=s == 0, last_stage=s == pp - 1)
    apply_tensor_plan(model, mesh.tp, plan_of(model), sequence_parallel=sequence_parallel)
    cp = getattr(mesh, "cp", None)
    if cp is not None:
        apply_context_plan(model, cp, cp_mode, plan_of(model))
    ep = getattr(mesh, "ep", None)
    if ep is not None:
        apply_expert_plan(model, ep)
    for name, p in model.named_parameters():
        replica = s > 0 and name in first_names   # held for a tie; owned by stage 0
        p.spec = dataclasses.replace(p.spec, pp_stage=s, replica=p.spec.replica or replica)
    return model


def wrap_model(model, mesh, strategy: str, seed: int | None = None, precision=None):
    """Wrap ``model`` with the strategy registered as ``strategy`` (``ddp``, ``zero1``,
    ``zero2``, ``zero3``, or any name in :data:`STRATEGIES`).

    An unmaterialised model is materialised from ``seed`` (default
    ``model.seed``), or, under ZeRO, straight into shards. ``precision`` is
    passed on (see :class:`~mpishard.parallel.Precision`).
    """
    return strategy_entry(strategy).build(model, mesh, seed=seed, precision=precision)


class ParallelModel:
    """A model trained on any dp x tp x pp factorisation of the world.

    Args:
        model: the whole model, unmaterialised (``materialize_now=False``):
            only its shapes and plan are read; this rank builds its own part.
        mesh: the :class:`~mpishard.comm.Mesh`.
        strategy: a name in :data:`STRATEGIES` (``"ddp"``, ``"zero1"``, ...) over ``mesh.dp``.
        micro_batches: micro-batches per step (the pipeline's ``m``; plain
            gradient accumulation when ``pp == 1``).
        schedule: ``"1f1b"`` or ``"gpipe"``.
        stage_estimate: blocks per pipeline stage (default: balanced by parameters).
        precision: mixed precision, e.g. ``"bfloat16"`` (see :class:`~mpishard.parallel.Precision`).
        seed: initialisation seed (default: the model's).
        cp_mode: context parallelism's attention, ``"ring"`` or ``"all-to-all"``
            (when ``mesh.cp`` has more than one rank).
        sequence_parallel: Megatron's sequence parallelism with tp: norms and
            residuals hold 1/tp of the rows (see mpishard/parallel/tensor/layers.py).
    """

    def __init__(self, model, mesh, strategy: str = "zero3", micro_batches: int = 1,
                 schedule: str = "1f1b", stage_estimate=None, precision=None,
                 seed: int | None = None, cp_mode: str = "ring",
                 sequence_parallel: bool = False):
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
        plan = plan_of(model)
        self.mesh = mesh
        stage = build_stage(model, mesh, stage_estimate, cp_mode, sequence_parallel)
        self.sequence = getattr(stage, "sequence", None)   # a SequenceShard under cp
        self.strategy = wrap_model(stage, mesh, strategy, seed, precision)
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

    def gather_full_params(self) -> dict:
        """Name -> whole parameter on every rank (collective over the world; small models)."""
        return self.strategy.gather_full_params()

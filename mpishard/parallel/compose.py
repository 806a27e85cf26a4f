"""One GPT on a dp x tp x pp mesh: pipeline stage, tensor-parallel layers, ZeRO or DDP.

    mesh = Mesh(world, dp=2, tp=2, pp=1)
    run = ParallelGPT(GPTConfig(...), mesh, strategy="zero3", micro_batches=2)
    opt = AdamW(run.parameters(), lr=3e-4, ledger=run.ledger)
    for step in range(steps):
        loss = run.train_step(x, y)          # x, y: this dp rank's batch (same on tp/pp peers)
        run.step(opt, max_norm=1.0)

Built in this order, each layer reading the one before: the pipeline stage's
blocks (:func:`partition_blocks`), tensor-parallel layers over ``mesh.tp``
(:func:`parallelize_gpt`), then DataParallel or ZeRO over ``mesh.dp``, driven
micro-batch by micro-batch by a :class:`Pipeline` (also when ``pp == 1``).
Parameters are materialised from (seed, name) straight into their tp slices
and, under ZeRO-3, into dp shards: no rank ever holds the whole model.
"""
from __future__ import annotations

import dataclasses

from ..autodiff.tensor import no_grad
from ..backend import Backend
from ..models.gpt import GPT, GPTConfig
from .pipeline import Pipeline, partition_blocks
from .tensor_parallel import parallelize_gpt
from .strategy import strategy_entry

__all__ = ["ParallelGPT", "build_stage", "wrap_model"]


def build_stage(config: GPTConfig, mesh, seed: int = 0, dtype: str = "float32",
                backend: Backend | None = None, stage_plan=None) -> GPT:
    """This rank's pipeline stage of the GPT, with tensor-parallel layers, unmaterialised."""
    C = config.n_embd
    per_block = 12 * C * C + 13 * C
    ranges = partition_blocks(config.n_layer, mesh.pp.size, per_block,
                              first_extra=(config.vocab_size + config.block_size) * C,
                              last_extra=2 * C, plan=stage_plan)
    s, last = mesh.pp.rank, mesh.pp.size - 1
    model = GPT(config, seed=seed, dtype=dtype, backend=backend, materialize_now=False,
                blocks=ranges[s], first_stage=s == 0, last_stage=s == last)
    parallelize_gpt(model, mesh.tp)
    if mesh.pp.size > 1 and s == last:  # a copy of the first stage's token table
        wte = model.transformer.wte.weight
        wte.spec = dataclasses.replace(wte.spec, replica=True)
    for p in model.parameters():
        p.spec = dataclasses.replace(p.spec, pp_stage=s)
    return model


def wrap_model(model, mesh, strategy: str, seed: int | None = None, precision=None):
    """Wrap ``model`` with the strategy registered as ``strategy`` (``ddp``, ``zero1``,
    ``zero2``, ``zero3``, or any name in :data:`STRATEGIES`).

    An unmaterialised model is materialised from ``seed`` (default
    ``model.seed``), or, under ZeRO, straight into shards. ``precision`` is
    passed on (see :class:`~mpishard.parallel.Precision`).
    """
    return strategy_entry(strategy).build(model, mesh, seed=seed, precision=precision)


class ParallelGPT:
    """A GPT trained on any dp x tp x pp factorisation of the world.

    Args:
        config: the model.
        mesh: the :class:`~mpishard.comm.Mesh`.
        strategy: ``"ddp"``, ``"zero1"``, ``"zero2"`` or ``"zero3"`` over ``mesh.dp``.
        micro_batches: micro-batches per step (the pipeline's ``m``; plain
            gradient accumulation when ``pp == 1``).
        schedule: ``"1f1b"`` or ``"gpipe"``.
        stage_plan: blocks per pipeline stage (default: balanced by parameters).
        precision: mixed precision, e.g. ``"bfloat16"`` (see :class:`~mpishard.parallel.Precision`).
    """

    def __init__(self, config: GPTConfig, mesh, strategy: str = "zero3", seed: int = 0,
                 dtype: str = "float32", backend: Backend | None = None,
                 micro_batches: int = 1, schedule: str = "1f1b", stage_plan=None,
                 precision=None):
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
        self.config, self.mesh = config, mesh
        backend = backend or Backend()
        self.strategy = wrap_model(build_stage(config, mesh, seed, dtype, backend, stage_plan),
                                   mesh, strategy, seed, precision)
        tie = None
        if mesh.pp.size > 1:  # first and last stage of each (dp, tp) pipeline share wte
            ends = mesh.pp.rank in (0, mesh.pp.size - 1)
            color = mesh.dp.rank * mesh.tp.size + mesh.tp.rank if ends else None
            tie = mesh.world.split(color, name="tied-embedding")
        self.pipeline = Pipeline(self.strategy, mesh, micro_batches, schedule, tie)

    # -- the training loop's verbs -------------------------------------------
    @property
    def module(self) -> GPT:
        return self.strategy.module

    @property
    def ledger(self):
        return self.strategy.ledger

    def parameters(self) -> list:
        """The optimizer's targets on this rank."""
        return self.strategy.parameters()

    def train_step(self, x, y) -> float:
        """Forward and backward of this dp rank's batch; the mean loss (same on every rank)."""
        return self.pipeline.train_step(x, y)

    def eval_step(self, x, y) -> float:
        """Mean loss without gradients."""
        self.strategy.eval()
        try:
            with no_grad():
                return self.pipeline.eval_step(x, y)
        finally:
            self.strategy.train()

    def step(self, optimizer, max_norm: float | None = None):
        """Reduce gradients over dp, clip over the whole mesh, update; see Strategy.step."""
        return self.strategy.step(optimizer, max_norm)

    def gather_full_params(self) -> dict:
        """Name -> whole parameter on every rank (collective over the world; small models)."""
        return self.strategy.gather_full_params()

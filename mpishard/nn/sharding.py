"""A model's parallel plan: how it may be split, written as data the model owns.

    plan = model.parallel_plan()
    plan.tensor      # (("transformer.h.*.attn.<qkv projection>", ColumnParallel(parts=3, ...)), ...)
    plan.units       # ("transformer.h.0", "transformer.h.1", ...)   ZeRO units
    plan.pipeline    # PipelinePlan(blocks="transformer.h", first=(...), last=(...))
    plan.tied        # (("lm_head.weight", "transformer.wte.weight"),)

[Note: parallel plans]
``mpishard.parallel`` applies any plan and knows no model: a model says, in its
``parallel_plan()``, which modules are split over the tensor-parallel axis and
how (a table of module path -> style, ``*`` matching one path component), which
modules ZeRO communicates as units, how its blocks form pipeline stages (the
container of blocks, the modules only the first and the last stage hold) and
which parameters are one tensor used twice (tied). Styles name the split only;
the tensor-parallel layers that implement them live in ``mpishard.parallel``.
A module not in the tensor table is replicated over tp. A model with no
``parallel_plan`` is replicated over tp and pp and has no ZeRO units (a root
unit holds everything).

[Note: pipeline stage interface]
A model that has a :class:`PipelinePlan` also answers, so that the pipeline
never reads its attributes:

- ``pipeline_stage(blocks, first_stage, last_stage)``: a new, unmaterialised
  model of the same kind holding blocks ``blocks`` (global indices; names
  unchanged) and, on the first or last stage, what those add;
- ``first_stage`` / ``last_stage``: attributes of every model (both true for a
  whole model);
- ``forward(inputs, targets=None, batch_size=None)``: the first stage takes the
  model's inputs, the others the previous stage's activations (with
  ``batch_size``); the last returns ``(output, loss)``, the others activations;
- ``activation_shape(batch_size, seq_len)``: the shape of those activations.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ColumnParallel", "RowParallel", "VocabParallel", "VocabParallelLoss",
           "PipelinePlan", "ShardingPlan", "plan_of", "TP_STYLES"]


@dataclass(frozen=True)
class ColumnParallel:
    """A linear layer's output features split over tp (Megatron's column parallel).

    The ``out_features`` are ``parts`` equal segments (3 for a fused q/k/v
    projection); each segment is cut into groups of ``unit`` features (one
    attention head: ``unit = head_size``), and each tp rank takes a contiguous
    run of groups from every segment. ``groups`` names what a group is for
    error messages (``"n_head"``).

    ``replicate_unless_divisible``: when tp does not divide the groups, keep the
    layer whole on every rank instead, and sum its output's gradient over tp
    (Megatron's ``f`` after it): each rank then uses the part of the output it
    needs (key/value heads shared by a rank's query heads).
    """

    parts: int = 1
    unit: int = 1
    groups: str = "output features"
    replicate_unless_divisible: bool = False


@dataclass(frozen=True)
class RowParallel:
    """A linear layer's input features split over tp, in groups of ``unit``
    (matching the column-parallel layer before it); its output is summed over tp."""

    unit: int = 1
    groups: str = "input features"


@dataclass(frozen=True)
class VocabParallel:
    """An embedding table split by rows (the vocabulary) over tp."""

    groups: str = "vocabulary rows"


@dataclass(frozen=True)
class VocabParallelLoss:
    """A cross-entropy module computed from logits split by vocabulary, following
    the column split of the module at ``logits`` (the output projection)."""

    logits: str


#: the styles :func:`mpishard.parallel.apply_tensor_plan` knows
TP_STYLES = (ColumnParallel, RowParallel, VocabParallel, VocabParallelLoss)


@dataclass(frozen=True)
class PipelinePlan:
    """How a model's blocks form pipeline stages (see [Note: pipeline stage interface]).

    Attributes:
        blocks: path of the module holding the blocks in order (a ModuleDict
            keyed by block index, e.g. ``"transformer.h"``).
        first: modules only the first stage holds (embeddings).
        last: modules only the last stage holds (final norm, output layer).
    """

    blocks: str
    first: tuple = ()
    last: tuple = ()


@dataclass(frozen=True)
class ShardingPlan:
    """Everything ``mpishard.parallel`` needs to split one model (see [Note: parallel plans]).

    Attributes:
        tensor: ``(module path pattern, style)`` pairs, in the order to apply.
        units: module paths ZeRO communicates as units, in order.
        pipeline: a :class:`PipelinePlan`, or ``None`` (the model is one stage).
        tied: ``(alias, source)`` parameter names that are one tensor.
        sequence_entry: the module whose output rows enter the sequence-parallel
            region (the embeddings' last module), or ``None`` (no sequence
            parallelism); see [Note: sequence parallel] in
            mpishard/parallel/tensor/layers.py.
        attention: module path patterns of the attention modules; under context
            parallelism each gets a ``sequence`` attribute its forward consults
            (see mpishard/parallel/context/apply.py).
    """

    tensor: tuple = ()
    units: tuple = ()
    pipeline: PipelinePlan | None = None
    tied: tuple = ()
    attention: tuple = ()
    sequence_entry: str | None = None

    def __post_init__(self):
        for pattern, style in self.tensor:
            if not isinstance(style, TP_STYLES):
                raise TypeError(f"ShardingPlan.tensor: {pattern!r} has style {style!r}; use "
                                f"one of {', '.join(t.__name__ for t in TP_STYLES)}")


def plan_of(module) -> ShardingPlan:
    """``module.parallel_plan()``, or the empty plan for a module without one."""
    make = getattr(module, "parallel_plan", None)
    return make() if make is not None else ShardingPlan()

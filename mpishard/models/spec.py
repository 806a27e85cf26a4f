"""A model family's spec: everything the layers above need to know about it, as data.

[Note: model specs]
A model family is a folder, ``models/<family>/``: its module, its activation
terms, and one :class:`ModelSpec` that names the config class, the model class,
its sharding plan and activation terms, the ``[model]`` keys it reads with their
defaults, its presets, the mesh axes it can be split over, and its Hugging Face
mapping (:class:`~mpishard.models.hf_mapping.HFMapping`). The recipe
(mpishard/recipes/text.py), the ``[model]`` section of the configuration
(mpishard/config/), the Hugging Face interop (mpishard/hf/) and the planner read
the registry, :data:`mpishard.models.MODELS`, never a model's attribute or class
names. A new family is its folder and one line in the registry; a variant of a
family (Qwen2 of Llama) is mostly a spec of its own over the family's module.

    spec = MODELS["llama"]
    config = spec.build_config({"vocab_size": 256, "block_size": 64, ...})
    model = spec.model_class(config, seed=0)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

__all__ = ["ModelKey", "ModelSpec", "AxisSizes", "TEXT_KEYS", "split_counts"]


@dataclass(frozen=True)
class ModelKey:
    """One ``[model]`` key a model family reads, with that family's default.

    Attributes:
        name: the key (and, with dashes, its flag: ``n_kv_head`` is ``--n-kv-head``).
        default: this family's value when the key is not given.
        help: what it means (``mpishard train --help``).
        choices, low, above, high: the values it admits (one of; ``>=``, ``>``, ``<``).
        estimate: ``mpishard estimate`` reads it too.
        shapes: it changes the parameters a checkpoint holds (a resume compares it).
    """

    name: str
    default: object
    help: str
    choices: tuple | None = None
    low: float | None = None
    above: float | None = None
    high: float | None = None
    estimate: bool = False
    shapes: bool = False


#: the ``[model]`` keys every language model reads (config/sections.py declares them):
#: the config dataclass of each family takes them under these names
TEXT_KEYS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")


@dataclass(frozen=True)
class AxisSizes:
    """The split a run asks for, as a model family's :attr:`ModelSpec.check_split` sees it."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    activation_checkpointing: bool = False


def split_counts(n: int, parts: int) -> str:
    """How ``n`` items go to ``parts`` ranks, the first ``n % parts`` one more: ``"2+1+1"``."""
    base, extra = divmod(n, parts)
    return "+".join(str(base + (i < extra)) for i in range(parts))


@dataclass(frozen=True)
class ModelSpec:
    """One model family (see [Note: model specs]).

    Attributes:
        name: its ``--model`` name.
        summary: one line: what it is.
        task: the recipe that trains it (``"text"`` or ``"digits"``,
            mpishard/recipes/).
        model_class: the module class, built as ``model_class(config, seed=...,
            dtype=..., backend=..., materialize_now=...)``.
        config_class: its config dataclass (``None``: the model takes its keys itself).
        keys: the ``[model]`` keys of its own (:class:`ModelKey`), beyond
            :data:`TEXT_KEYS` and the section's common ones.
        build_config: ``[model]`` keys (a dict) -> the config dataclass; a
            ValueError naming the key and the fix for what it cannot build.
        presets: preset name -> the ``[model]`` keys it sets.
        sharding: the model's :class:`~mpishard.nn.sharding.ShardingPlan` (``model ->
            plan``: its ``parallel_plan``), which mpishard.parallel applies.
        activations: ``(model, batch_size, seq_len, dtype, checkpointing, *, cp,
            cp_mode, sp) -> bytes`` one micro-batch keeps for backward.
        attention_heads: an attention module of the plan's ``attention`` patterns ->
            ``(query heads on this tp rank, head size)``.
        axes: the mesh axes beyond data parallelism it splits over (of ``tp``,
            ``pp``, ``cp``, ``sp``, ``ep``).
        check_split: ``(config, AxisSizes) -> notes``: a ValueError naming the fix for
            a split this family cannot honour (checked with the configuration, before
            anything is built), else lines for the plan on how it splits (a list,
            possibly empty); or ``None``.
        hf: its Hugging Face mapping, or ``None``.
        positions_key: the ``[model]`` key holding the context the model is made for
            when a run may train at another (rotary positions; the model config checks
            how far), or ``None``: ``block_size`` is both (a learned position table).
        elementwise: the elementwise ops of its blocks, as ``mpishard bench calibrate``
            times them for the planner's ``activation_rates`` (``"layernorm-gelu"`` or
            ``"rmsnorm-swiglu"``, mpishard/bench/calibrate.py).
    """

    name: str
    summary: str
    task: str
    model_class: type
    config_class: type | None = None
    keys: tuple = ()
    build_config: Callable | None = None
    presets: dict = field(default_factory=dict)
    sharding: Callable | None = None
    activations: Callable | None = None
    attention_heads: Callable | None = None
    axes: frozenset = frozenset({"tp", "pp", "cp", "sp", "ep"})
    check_split: Callable | None = None
    hf: object | None = None
    positions_key: str | None = None
    elementwise: str = "layernorm-gelu"

    def key(self, name: str) -> ModelKey | None:
        """This family's :class:`ModelKey` called ``name``, or ``None``."""
        return next((k for k in self.keys if k.name == name), None)

    def config_of(self, section, **given):
        """:attr:`build_config` of a ``[model]`` section (an object with the keys as
        attributes: :data:`TEXT_KEYS` and this family's), ``given`` keys replacing its."""
        names = (*TEXT_KEYS, *(k.name for k in self.keys))
        return self.build_config({**{k: getattr(section, k) for k in names}, **given})

    def defaults(self) -> dict:
        """Key -> this family's default, for every key of its own."""
        return {k.name: list(k.default) if isinstance(k.default, list) else k.default
                for k in self.keys}

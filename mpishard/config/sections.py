"""Training configuration: five sections, read from TOML, every key also a flag.

    mpishard train --config examples/configs/demo.toml --steps 50 --strategy zero3

The sections are the TOML tables ``[model]``, ``[parallel]``, ``[optim]``,
``[data]`` and ``[run]`` (:class:`TrainConfig`); in code ``cfg.optim.lr``. Each
key has one flag name, unique across sections (``lr`` is ``--lr``; the model's
``name`` is ``--model``, the data's ``path`` is ``--data``), and each field
carries its own help text, which ``--help`` prints. Precedence: defaults < TOML
file < command-line flags. A key or flag that does not exist is an error naming
the closest real one; top-level (flat) keys, as written before the sections
existed, are still read, with a note saying where each belongs now. The
``[model]`` section (mpishard/config/model_section.py) holds each model
family's own keys with that family's defaults ([Note: per-family model keys]).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from mpishard.config.init_from import shape_from_folder
from mpishard.config.model_section import ModelConfig
from mpishard.config.options import strategy_names, opt
from mpishard.config.support import check_supported
from mpishard.core.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["TrainConfig", "ParallelConfig", "OptimConfig", "DataConfig",
           "RunConfig", "ConfigError", "SECTIONS", "KEYS", "Key", "load_config",
           "config_from_dict"]


@dataclass
class ParallelConfig:
    """[parallel] how the model is split over the ranks"""

    strategy: str = opt("zero3", "data-parallel strategy over dp", choices=strategy_names,
                        estimate=True)
    dp: int = opt(0, "data-parallel size dp_replicate x dp_shard (0: world size / "
                  "(tp * cp * pp))", low=0, estimate=True)
    dp_replicate: int = opt(1, "replicas of the sharded state (hybrid sharding: ZeRO "
                            "shards within dp_shard, averages across replicas)", low=1,
                            estimate=True)
    dp_shard: int = opt(0, "ranks sharing one copy of the sharded state (0: dp / "
                        "dp_replicate)", low=0, estimate=True)
    cp: int = opt(1, "context-parallel size (ranks splitting each sequence)", low=1,
                  estimate=True)
    cp_mode: str = opt("ring", "context-parallel attention: ring (K/V passed around) or "
                       "all-to-all (Ulysses)", choices=("ring", "all-to-all"), estimate=True)
    tp: int = opt(1, "tensor-parallel size (ranks splitting each layer)", low=1, estimate=True)
    ep: int = opt(1, "expert-parallel size (ranks of dp_shard x cp splitting the experts)",
                  low=1, estimate=True)
    sequence_parallel: bool = opt(False, "with tp: norms and residuals hold 1/tp of the "
                                  "rows (all-gather in, reduce-scatter out)", estimate=True)
    pp: int = opt(1, "pipeline-parallel size (stages of blocks)", low=1, estimate=True)
    pipeline_schedule: str = opt("1f1b", "pipeline schedule (interleaved: 1F1B over "
                                 "virtual_stages model chunks per rank)",
                                 choices=("1f1b", "gpipe", "interleaved"), estimate=True)
    virtual_stages: int = opt(1, "model chunks per pipeline rank (the interleaved schedule's "
                              "V: the blocks are cut into pp x V equal stages)", low=1,
                              estimate=True)
    precision: str = opt("float32", "compute precision: float32, or float16/bfloat16 with "
                         "float32 masters (mixed precision); fp32, fp16 and bf16 too",
                         choices=("float32", "float16", "bfloat16"), estimate=True,
                         aliases={"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"})
    reduce_dtype: str = opt("float32", "dtype gradients are added and reduced in under a "
                            "16-bit precision: float32, or the 16-bit one, half the gradient "
                            "bytes and dp traffic (FSDP2's reduce_dtype; docs/offload.md)",
                            choices=("float32", "bfloat16", "float16"), estimate=True,
                            aliases={"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"})
    offload: str = opt("none", "optimizer: keep the float32 master weights and the optimizer "
                       "state in host memory and update them there (DDP and ZeRO); params: "
                       "the parameter shards too, copied to the device for each gather "
                       "(ZeRO-3; docs/offload.md)", choices=("none", "optimizer", "params"),
                       estimate=True)
    layout: str = opt("", "auto: train the layout mpishard plan predicts fastest for these "
                      "ranks on --machine (it sets dp, tp, pp, cp, strategy, batch size, "
                      "micro-steps, checkpointing and offload, but keeps those of them given as "
                      "flags or in the config file; the global batch stays); auto-all: "
                      "sets them all, replacing any given", choices=("", "auto", "auto-all"))
    machine: str = opt("cpu-2core", "machine description --layout auto plans for (a JSON "
                       "file, e.g. from mpishard bench calibrate, or a shipped name)")

    @property
    def policy(self):
        """The :class:`~mpishard.parallel.Precision` a strategy and the plan take:
        ``precision``'s, its gradients in ``reduce_dtype`` (checked first, see
        [Note: refused before anything is built])."""
        from mpishard.parallel.precision import Precision  # noqa: PLC0415 (as options.py)
        return Precision.of(self.precision).reducing_in(self.reduce_dtype)


@dataclass
class OptimConfig:
    """[optim] the optimizer and its schedule"""

    optimizer: str = opt("adamw", "the optimizer (its state is sharded like the parameters)",
                         choices=("adamw", "adam", "sgd", "sgd-momentum"), estimate=True)
    steps: int = opt(100, "optimizer steps to train for", low=1)
    batch_size: int = opt(8, "sequences (or samples) per dp rank per micro-step", low=1,
                          estimate=True)
    micro_steps: int = opt(1, "micro-batches per step (gradient accumulation; the "
                           "pipeline's micro-batches)", low=1, estimate=True)
    global_batch: int = opt(0, "sequences per step over all dp ranks; when set, micro_steps "
                            "follows from it (global_batch / (batch_size x dp)), also when "
                            "a run resumes on another number of ranks (0: batch_size x "
                            "micro_steps x dp)", low=0)
    lr: float = opt(3e-3, "peak learning rate (0: the parameters stay as they are)", low=0.0)
    min_lr: float = opt(3e-4, "learning rate at the end of the cosine decay, at most lr "
                        "(not given: this default, or lr where lr is lower)", low=0.0)
    warmup_steps: int = opt(10, "linear warm-up steps", low=0)
    weight_decay: float = opt(0.1, "weight decay of matrices and embeddings only: "
                              "decoupled under adamw, L2 (added to the gradient) under adam, "
                              "sgd and sgd-momentum", low=0.0)
    beta1: float = opt(0.9, "Adam beta1", low=0.0, high=1.0)
    beta2: float = opt(0.95, "Adam beta2", low=0.0, high=1.0)
    grad_clip: float = opt(1.0, "global-norm gradient clipping (0: off)", low=0.0)


@dataclass
class DataConfig:
    """[data] what is trained on"""

    path: str = opt("", "text file or folder of text, or a folder of token ids (train.bin, "
                    "val.bin: see mpishard prepare); empty: the Python standard library's "
                    "sources", flag="data")
    dtype: str = opt("", "token ids' dtype in a folder without meta.json (empty: uint16, "
                     "nanoGPT's)", flag="data_dtype", choices=("", "uint16", "uint32"))
    max_bytes: int = opt(0, "read at most this many bytes of text (0: all of --data, or "
                         "4,000,000 bytes of the built-in corpus)", low=0)


@dataclass
class RunConfig:
    """[run] evaluation, checkpoints, output and placement"""

    seed: int = opt(0, "initialisation and data order", low=0)
    backend: str = opt("numpy", "array backend: numpy, cupy (one GPU per rank) or auto",
                       choices=("numpy", "cupy", "auto"))
    memory_budget: int = opt(0, "per-rank byte budget: a run whose plan needs more stops "
                             "before step 1, the memory ledger refuses model state past it, "
                             "and mpishard plan fits layouts into it (e.g. 60GiB; 0: none)",
                             low=0,
                             estimate=True, size=True)
    eval_interval: int = opt(50, "steps between validation losses (0: start and end only)",
                             low=0)
    eval_batches: int = opt(4, "batches per validation loss", low=1)
    init_from: str = opt("", "start from these weights: a Hugging Face model folder "
                         "(config.json and safetensors; the [model] shape comes from it) or "
                         "a consolidated mpishard .safetensors file (empty: random init)")
    checkpoint_dir: str = opt("", "where step-N/ checkpoints go (empty: none)")
    checkpoint_interval: int = opt(0, "steps between checkpoints (0: only at the end)", low=0)
    keep_last: int = opt(2, "checkpoints to keep", low=1)
    checkpoint_async: bool = opt(False, "write checkpoints on a thread while training goes "
                                 "on (each rank holds a host copy of its shards while a "
                                 "save is in flight)")
    resume: bool = opt(False, "resume from the newest checkpoint in checkpoint_dir that "
                       "verifies (a damaged newer one is renamed step-N.damaged)")
    resume_from: str = opt("", "resume from this checkpoint instead: step-N in "
                           "checkpoint_dir, or a step directory's path (implies resume)")
    overwrite: bool = opt(False, "start afresh where checkpoint_dir or the metrics file hold "
                          "an earlier run: its checkpoints are deleted, its metrics "
                          "replaced")
    metrics: str = opt("", "JSON-lines metrics file (empty: none)")
    log_dir: str = opt("", "one log file per rank (empty: none)")
    sample_tokens: int = opt(0, "tokens to sample from the model at the end", low=0)
    sample_prompt: str = opt("def ", "prompt for that sample")
    progress: bool = opt(True, "progress bar on rank 0")
    dry_run: bool = opt(False, "print the plan and exit")


@dataclass
class TrainConfig:
    """Everything ``mpishard train`` reads: one dataclass per TOML section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)


#: section name -> its dataclass
SECTIONS = {f.name: f.default_factory for f in fields(TrainConfig)}


@dataclass(frozen=True)
class Key:
    """One config key: its section, field, flat (flag) name and metadata."""

    section: str
    name: str
    flat: str
    type: str
    default: object
    meta: dict

    @property
    def flag(self) -> str:
        return "--" + self.flat.replace("_", "-")


#: flat name -> :class:`Key`, in section order
KEYS: dict = {}
for _section, _cls in SECTIONS.items():
    for _f in fields(_cls):
        _default = _f.default_factory() if _f.default is dataclasses.MISSING else _f.default
        _key = Key(_section, _f.name, _f.metadata["flag"] or _f.name, _f.type, _default,
                   dict(_f.metadata))
        KEYS[_key.flat] = _key
#: flat names from before a rename -> today's
RENAMED = {"schedule": "pipeline_schedule"}
#: names other tools use -> ours (suggested, never accepted silently)
KNOWN_AS = {"learning_rate": "lr", "max_lr": "lr", "lr_min": "min_lr", "final_lr": "min_lr",
            "n_layers": "n_layer", "num_layers": "n_layer", "num_hidden_layers": "n_layer",
            "n_heads": "n_head", "num_heads": "n_head", "num_attention_heads": "n_head",
            "hidden_size": "n_embd", "d_model": "n_embd", "dim": "n_embd",
            "seq_len": "block_size", "seq_length": "block_size", "max_seq_len": "block_size",
            "context_length": "block_size", "micro_batch_size": "batch_size",
            "gradient_accumulation_steps": "micro_steps", "grad_accum_steps": "micro_steps",
            "max_steps": "steps", "train_steps": "steps", "max_iters": "steps",
            "warmup_iters": "warmup_steps", "warmup": "warmup_steps",
            "clip_grad": "grad_clip", "max_grad_norm": "grad_clip",
            "tensor_parallel": "tp", "pipeline_parallel": "pp", "data_parallel": "dp",
            "dataset": "data", "data_path": "data", "out_dir": "checkpoint_dir",
            "save_interval": "checkpoint_interval", "eval_iters": "eval_batches",
            "vocab": "vocab_size", "dropout_p": "dropout", "mixed_precision": "precision"}


def closest_key(name: str, names=None) -> str | None:
    """The real key a mistyped or foreign ``name`` most likely means, or ``None``."""
    names = list(KEYS if names is None else names)
    if name in KNOWN_AS and KNOWN_AS[name] in names:
        return KNOWN_AS[name]
    match = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    return match[0] if match else None


def _closest(name: str, names) -> str:
    match = closest_key(name, names)
    return f"; did you mean {match!r}?" if match else ""


def _coerce(key: Key, value, where: str):
    """``value`` as the key's type (an alias as the value it stands for), or a ConfigError
    naming the key."""
    if isinstance(value, bool) and key.type == "str" and str(value).lower() in key.meta["aliases"]:
        value = str(value).lower()          # a TOML true for a key that also takes words
    if isinstance(value, str):
        value = key.meta["aliases"].get(value, value)
    if key.type == "float" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if key.type == "list":
        if isinstance(value, str):  # "128,64", as flags and older files write it
            try:
                return [int(w) for w in value.split(",") if w.strip()]
            except ValueError:
                raise ConfigError(f"{where} {key.flat!r}: give widths like [128, 64], got "
                                  f"{value!r}") from None
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                           for v in value):
            return list(value)
    elif key.type == type(value).__name__:
        return value
    raise ConfigError(f"{where} {key.flat!r} wants a {key.type}, got {value!r}")


def _check(key: Key, value, family: str) -> None:
    """ConfigError unless ``value`` is one ``key`` admits (under model ``family``, for a
    family's own key: [Note: per-family model keys]); ``None`` is a key not read."""
    if value is None:
        return
    m, label = key.meta, f"{key.flat} = {value!r}"
    own = m["families"].get(family)
    if own is not None:
        m = dict(choices=own.choices, low=own.low, above=own.above, high=own.high)
    choices = m["choices"]() if callable(m["choices"]) else m["choices"]
    if choices is not None and value not in choices:
        raise ConfigError(f"{label} is not one of {', '.join(choices)}")
    if m["low"] is not None and value < m["low"]:
        raise ConfigError(f"{key.flat} must be >= {m['low']}, got {value}")
    if m["above"] is not None and not value > m["above"]:
        raise ConfigError(f"{key.flat} must be > {m['above']}, got {value}")
    if m["high"] is not None and not value < m["high"]:
        raise ConfigError(f"{label}: must be below {m['high']}")


def flat_values(raw: dict, where: str, notes: list) -> dict:
    """Flat name -> value from a TOML document (or a saved config): sections, and
    the top-level keys of older files (each noted in ``notes``)."""
    values: dict = {}
    for top, value in raw.items():
        top = top.replace("-", "_")
        if isinstance(value, dict) and top in SECTIONS:
            by_name = {k.name: k for k in KEYS.values() if k.section == top}
            for name, v in value.items():
                name = name.replace("-", "_")
                key = by_name.get(name) or (KEYS.get(name) if KEYS.get(name) and
                                            KEYS[name].section == top else None)
                if key is None:
                    raise ConfigError(f"unknown config key {name!r} in [{top}]"
                                      f"{_closest(name, by_name)}")
                values[key.flat] = v
        elif isinstance(value, dict) and top == "train":   # an old table of flat keys
            values.update(flat_values({k: v for k, v in value.items()}, where, notes))
        elif isinstance(value, dict):
            match = closest_key(top, SECTIONS)
            hint = f"; did you mean [{match}]?" if match else ""
            raise ConfigError(f"unknown config table [{top}] in {where}{hint} (the tables "
                              f"are {', '.join(f'[{t}]' for t in SECTIONS)})")
        else:
            name = RENAMED.get(top, top)
            if name not in KEYS:
                raise ConfigError(f"unknown config key {top!r}{_closest(top, KEYS)}")
            key = KEYS[name]
            notes.append(f"{where}: top-level key {top!r} is read as before; write it as "
                         f"{key.name!r} under [{key.section}]")
            values[name] = value
    return values


def config_from_dict(values: dict, where: str = "config") -> TrainConfig:
    """A checked :class:`TrainConfig` from flat names -> values (defaults for the rest,
    the model family's for its own keys; a ``preset`` fills the model keys not given;
    ``None`` is a key the family does not read, as saved configs hold it)."""
    preset = values.get("preset") or ""
    if preset:
        from mpishard.config.presets import PRESETS  # noqa: PLC0415

        if preset not in PRESETS:
            raise ConfigError(f"preset = {preset!r} is not one of {', '.join(PRESETS)}")
        values = {("model" if k == "name" else k): v for k, v in PRESETS[preset].items()} \
            | dict(values)
    parts = {section: {} for section in SECTIONS}
    for flat, value in values.items():
        if flat not in KEYS:
            raise ConfigError(f"unknown config key {flat!r}{_closest(flat, KEYS)}")
        key = KEYS[flat]
        if value is not None:
            parts[key.section][key.name] = _coerce(key, value, where)
    cfg = TrainConfig(**{s: SECTIONS[s](**v) for s, v in parts.items()})
    for key in KEYS.values():
        _check(key, getattr(getattr(cfg, key.section), key.name), cfg.model.name)
    o = cfg.optim
    if o.min_lr > o.lr and "min_lr" not in values:    # the default follows a lower lr
        o.min_lr = o.lr
    run = cfg.run
    if run.resume_from and not run.checkpoint_dir:
        raise ConfigError(f"resume_from = {run.resume_from!r} needs checkpoint_dir: where "
                          f"the resumed run saves (--checkpoint-dir DIR)")
    if run.resume_from and run.overwrite:
        raise ConfigError("resume_from and overwrite = true contradict each other: resume "
                          "continues a run, overwrite deletes it")
    run.resume = run.resume or bool(run.resume_from)
    if run.checkpoint_async and not run.checkpoint_dir:
        raise ConfigError("checkpoint_async = true needs checkpoint_dir: where the "
                          "checkpoints go (--checkpoint-dir DIR)")
    if run.resume and not run.checkpoint_dir:
        raise ConfigError("resume = true needs checkpoint_dir: the directory to resume from "
                          "(--checkpoint-dir DIR)")
    if run.resume and run.overwrite:
        raise ConfigError("resume = true and overwrite = true contradict each other: resume "
                          "continues the run in checkpoint_dir, overwrite deletes it")
    return cfg


def load_config(path: str | Path | None, overrides: dict | None = None,
                notes: list | None = None, given: set | None = None) -> TrainConfig:
    """Defaults, then the TOML file at ``path``, then ``overrides`` (flat names), then the
    shape of an ``init_from`` folder ([Note: the shape of an init-from folder] in
    mpishard/config/init_from.py), checked for what the model and the axes can honour ([Note: refused before anything is
    built] in mpishard/config/support.py).

    Notes (flat keys, the folder's shape, how tp splits heads) are appended to ``notes``
    when given; the flat names the file and ``overrides`` set are added to ``given``
    (``--layout auto`` and ``mpishard plan`` keep those layout keys).
    """
    values: dict = {}
    notes = [] if notes is None else notes
    if path:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} " + (
                "is a folder; pass a TOML file (e.g. examples/configs/demo.toml)"
                if path.is_dir() else "does not exist"))
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {err}") from None
        except OSError as err:
            raise ConfigError(f"config file {str(path)!r} cannot be read: "
                              f"{err.strerror or err}") from None
        values = flat_values(raw, str(path), notes)
    values.update(overrides or {})
    for flat, value in values.items():     # no bound catches nan (saved configs: as written)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{flat} = {value!r}: must be a finite number")
    if given is not None:
        given.update(values)
    cfg = config_from_dict(shape_from_folder(values, notes), "config key")
    o = cfg.optim
    if o.min_lr > o.lr:      # given so (a saved config from before may hold it: read as is)
        raise ConfigError(f"min_lr = {o.min_lr:g} is above lr = {o.lr:g}: the cosine decay "
                          f"would raise the rate; use --min-lr {o.lr:g} or less")
    _check_read(values, cfg.model)
    notes.extend(check_supported(cfg))
    notes.extend(_unused(values, cfg))
    return cfg


def _unused(given: dict, cfg) -> list:
    """Notes for given keys the run has no use for (never carried silently); under
    ``--layout auto`` the layout keys are the plan's to use."""
    p, run, notes = cfg.parallel, cfg.run, []
    if not p.layout and given.get("sequence_parallel") and p.tp == 1:
        notes.append("sequence_parallel = true does nothing with tp = 1: it splits the "
                     "norms' rows over the tensor-parallel ranks")
    if not p.layout and "cp_mode" in given and p.cp == 1:
        notes.append(f"cp_mode = {p.cp_mode!r} does nothing with cp = 1: it is how "
                     f"context-parallel ranks share attention")
    o = cfg.optim
    betas = [k for k in ("beta1", "beta2") if k in given]
    if betas and o.optimizer.startswith("sgd"):
        notes.append(f"{' and '.join(betas)} {'are' if len(betas) > 1 else 'is'} Adam's: "
                     f"optimizer = {o.optimizer!r} does not read "
                     f"{'them' if len(betas) > 1 else 'it'}")
    if "warmup_steps" in given and o.warmup_steps > o.steps:
        notes.append(f"warmup_steps = {o.warmup_steps} is above steps = {o.steps}: the "
                     f"warm-up is cut to the run's {o.steps} steps")
    if given.get("checkpoint_interval") and not run.checkpoint_dir:
        notes.append(f"checkpoint_interval = {run.checkpoint_interval} saves nothing "
                     f"without checkpoint_dir; add --checkpoint-dir DIR to keep checkpoints")
    return notes


def _check_read(given: dict, model) -> None:
    """A ConfigError for a given ``[model]`` key that the model would not read: a key of
    other families only (``--n-kv-head`` on a GPT), a mixture of experts' key on a dense
    model, a preset of another family than ``--model``'s."""
    preset = given.get("preset")
    if preset:
        from mpishard.config.presets import PRESETS  # noqa: PLC0415 (as config_from_dict)
        family = PRESETS[preset]["name"]
        if family != model.name:
            raise ConfigError(f"preset = {preset!r} is a {family} shape, but model = "
                              f"{model.name!r}; leave out --model (or --preset)")
    for flat in given:
        key = KEYS[flat]
        families = key.meta["families"]
        if families and model.name not in families:
            raise ConfigError(f"{key.flag} is a key of the {' and '.join(families)} "
                              f"model{'s' if len(families) > 1 else ''}, which the "
                              f"{model.name} model does not read; leave it out, or pass "
                              f"--model {next(iter(families))}")
        if flat.startswith("moe_") and flat != "moe_experts" and \
                not getattr(model, "moe_experts", 0):
            raise ConfigError(f"{key.flag} sets up a mixture of experts, but the model is "
                              f"dense (moe_experts = 0); add --moe-experts N, or leave it out")

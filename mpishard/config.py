"""Training configuration: one dataclass, read from TOML, every key also a flag.

    mpishard train --config examples/configs/demo.toml --steps 50 --strategy zero3

Precedence: dataclass defaults < TOML file < command-line flags. A TOML key
or flag that does not exist is an error that names the closest real key.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from dataclasses import dataclass, fields
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["TrainConfig", "ConfigError", "load_config", "add_config_flags", "config_from_args"]


class ConfigError(ValueError):
    """A configuration file or flag that cannot be used."""


@dataclass
class TrainConfig:
    """Everything ``mpishard train`` needs, with a comment per field."""

    # model
    model: str = "gpt"                 # "gpt" (text) or "mlp" (digits)
    block_size: int = 64               # GPT context length in bytes
    n_layer: int = 2                   # GPT blocks
    n_head: int = 4                    # GPT attention heads
    n_embd: int = 64                   # GPT width
    dropout: float = 0.0               # GPT dropout probability
    bias: bool = True                  # biases in Linear and LayerNorm
    hidden: str = "128,128"            # MLP hidden widths, comma-separated
    # parallelism
    strategy: str = "zero3"            # ddp | zero1 | zero2 | zero3
    dp: int = 0                        # data-parallel size (0: world size / (tp * pp))
    tp: int = 1                        # tensor-parallel size
    pp: int = 1                        # pipeline-parallel size
    schedule: str = "1f1b"             # pipeline schedule: 1f1b | gpipe
    # optimisation
    steps: int = 100                   # optimizer steps
    batch_size: int = 8                # sequences (or samples) per dp rank per micro-step
    micro_steps: int = 1               # micro-batches per step (accumulation; pipeline m)
    lr: float = 3e-3                   # peak learning rate
    min_lr: float = 3e-4               # learning rate at the end of the cosine decay
    warmup_steps: int = 10             # linear warm-up steps
    weight_decay: float = 0.1          # AdamW decoupled weight decay (matrices only)
    beta1: float = 0.9                 # AdamW beta1
    beta2: float = 0.95                # AdamW beta2
    grad_clip: float = 1.0             # global-norm clipping (0: off)
    dtype: str = "float32"             # float32 or float64 (master weights, optimizer state)
    precision: str = "float32"         # compute in float32 | float16 | bfloat16 (mixed precision)
    activation_checkpointing: bool = False  # GPT: recompute each block's activations in backward
    seed: int = 0                      # initialisation and data order
    backend: str = "numpy"             # numpy | cupy | auto
    memory_budget: int = 0             # per-rank byte budget for the ledger (0: none)
    # data
    data: str = ""                     # text file or folder ("": Python stdlib sources)
    max_bytes: int = 4_000_000         # read at most this many bytes of text
    # evaluation, checkpoints, output
    eval_interval: int = 50            # steps between validation losses (0: start and end only)
    eval_batches: int = 4              # batches per validation loss
    checkpoint_dir: str = ""           # where step-N/ checkpoints go ("": none)
    checkpoint_interval: int = 0       # steps between checkpoints (0: only at the end)
    keep_last: int = 2                 # checkpoints to keep
    resume: bool = False               # resume from the latest checkpoint in checkpoint_dir
    metrics: str = ""                  # JSON-lines metrics file ("": none)
    log_dir: str = ""                  # one log file per rank ("": none)
    sample_tokens: int = 0             # bytes to sample from the model at the end
    sample_prompt: str = "def "        # prompt for that sample
    progress: bool = True              # progress bar on rank 0
    dry_run: bool = False              # print the plan and exit

    def validate(self) -> None:
        """Raise :class:`ConfigError` for values no run can use."""
        from .parallel import PRECISIONS, STRATEGIES  # noqa: PLC0415

        choices = {"model": ("gpt", "mlp"), "strategy": tuple(STRATEGIES),
                   "dtype": ("float32", "float64"), "backend": ("numpy", "cupy", "auto"),
                   "precision": PRECISIONS,
                   "schedule": ("1f1b", "gpipe")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(f"{key} = {getattr(self, key)!r} is not one of "
                                  f"{', '.join(allowed)}")
        for key in ("steps", "batch_size", "micro_steps", "block_size", "n_layer", "n_head",
                    "n_embd", "tp", "pp", "eval_batches"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.dp < 0:
            raise ConfigError(f"dp must be >= 0 (0 = infer), got {self.dp}")

    def hidden_sizes(self) -> tuple:
        try:
            return tuple(int(w) for w in self.hidden.split(",") if w.strip())
        except ValueError:
            raise ConfigError(f"hidden = {self.hidden!r}: give widths like '128,64'") from None


_FIELDS = {f.name: f for f in fields(TrainConfig)}


def _closest(name: str) -> str:
    match = difflib.get_close_matches(name, list(_FIELDS), n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else ""


def load_config(path: str | Path | None, overrides: dict | None = None) -> TrainConfig:
    """Defaults, then the TOML file at ``path``, then ``overrides``."""
    values: dict = {}
    if path:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {err}") from None
        for section, value in raw.items():  # [train] tables are flattened
            items = value.items() if isinstance(value, dict) else [(section, value)]
            for key, v in items:
                values[key.replace("-", "_")] = v
    values.update(overrides or {})
    for key, value in values.items():
        if key not in _FIELDS:
            raise ConfigError(f"unknown config key {key!r}{_closest(key)}")
        expected = _FIELDS[key].type
        if expected == "float" and isinstance(value, int) and not isinstance(value, bool):
            values[key] = float(value)
        elif expected != type(value).__name__:
            raise ConfigError(f"config key {key!r} wants a {expected}, got {value!r}")
    config = dataclasses.replace(TrainConfig(), **values)
    config.validate()
    return config


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per config key (defaults come from the dataclass and the TOML file)."""
    group = parser.add_argument_group("training settings (also TOML keys)")
    converters = {"int": int, "float": float, "str": str, "bool": _bool}
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kwargs = dict(dest=f.name, default=None, type=converters[f.type],
                      help=f"(default {f.default!r})", metavar=f.type.upper())
        if f.type == "bool":
            kwargs["nargs"] = "?"
            kwargs["const"] = True
        group.add_argument(flag, **kwargs)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Merge ``--config FILE`` and the flags that were given."""
    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig)
                 if getattr(args, f.name, None) is not None}
    return load_config(getattr(args, "config", None), overrides)

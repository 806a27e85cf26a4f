"""Command-line flags of the training configuration: one per key, grouped by section.

Each flag carries its key's meaning, allowed values and default (mpishard
train --help); see mpishard/config/sections.py for the keys themselves.
"""
from __future__ import annotations

import argparse

from mpishard.core.parse import parse_bool, parse_bytes
from mpishard.config.sections import KEYS, RENAMED, SECTIONS, TrainConfig, load_config

__all__ = ["add_config_flags", "config_from_args"]


def _default(key) -> str:
    """The default ``--help`` shows: the key's, or each model family's for its own keys."""
    families = key.meta["families"]
    if not families:
        return _shown(key.default)
    return ", ".join(f"{_shown(k.default)} for {name}" for name, k in families.items())


def _shown(value) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    return repr(value) if isinstance(value, str) else str(value).lower() \
        if isinstance(value, bool) else str(value)


def add_config_flags(parser, command: str = "train") -> None:
    """One ``--flag`` per config key, grouped by section, each with its meaning and
    default; ``command="estimate"`` adds only the keys the estimate reads."""
    converters = {"int": int, "float": float, "str": str, "bool": parse_bool, "list": str}
    for section, cls in SECTIONS.items():
        keys = [k for k in KEYS.values() if k.section == section
                and (command != "estimate" or k.meta["estimate"])]
        if not keys:
            continue
        group = parser.add_argument_group(cls.__doc__.strip())
        for key in keys:
            choices = key.meta["choices"]
            choices = choices() if callable(choices) else choices
            listed = f"; one of {', '.join(choices)}" if choices else ""
            size = key.meta.get("size")
            kwargs = dict(dest=key.flat, default=None,
                          type=parse_bytes if size else converters[key.type],
                          metavar="SIZE" if size else key.type.upper(),
                          help=f"{key.meta['help']}{listed} (default: {_default(key)})")
            if key.type == "bool":
                kwargs.update(nargs="?", const=True)
            names = [key.flag] + [f"--{old.replace('_', '-')}" for old, new in RENAMED.items()
                                  if new == key.flat]
            group.add_argument(*names, **kwargs)


def config_from_args(args, notes: list | None = None, given: set | None = None) -> TrainConfig:
    """Merge ``--config FILE`` and the flags that were given (their flat names added to
    ``given``, with the file's, when given)."""
    overrides = {flat: getattr(args, flat) for flat in KEYS
                 if getattr(args, flat, None) is not None}
    return load_config(getattr(args, "config", None), overrides, notes, given)

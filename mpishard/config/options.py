"""How a config field is declared: :func:`opt` and the registries its choices come from.

Kept apart from the schema in config.py: a field is its default, its help text
and the values it admits (see :func:`opt`).
"""
from __future__ import annotations

from dataclasses import field

__all__ = ["opt"]


def opt(default, help: str, *, flag: str | None = None, choices=None, low=None,
        above=None, high=None, estimate: bool = False):
    """A config field: its default, what it means, and the values it admits.

    ``choices`` is a tuple or a function returning one (registries are read
    when validating); ``low``/``above``/``high`` bound numbers (``>=``, ``>``,
    ``<``); ``flag`` is its flat name when not the field's own; ``estimate``:
    ``mpishard estimate`` reads it too.
    """
    meta = dict(help=help, flag=flag, choices=choices, low=low, above=above, high=high,
                estimate=estimate)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _models():
    from mpishard.recipes import RECIPES  # noqa: PLC0415 (the registry fills on import)
    return tuple(RECIPES)


def _presets():
    from mpishard.config.presets import PRESETS  # noqa: PLC0415
    return ("", *PRESETS)


def _strategies():
    from mpishard.parallel import STRATEGIES  # noqa: PLC0415
    return tuple(STRATEGIES)

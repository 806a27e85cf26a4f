"""How a config field is declared: :func:`opt` and the registries its choices come from.

Kept apart from the schema in config.py: a field is its default, its help text
and the values it admits (see :func:`opt`).
"""
from __future__ import annotations

from dataclasses import field

__all__ = ["opt"]


def opt(default, help: str, *, flag: str | None = None, choices=None, low=None,
        above=None, high=None, estimate: bool = False, aliases: dict | None = None,
        families: dict | None = None, size: bool = False):
    """A config field: its default, what it means, and the values it admits.

    ``choices`` is a tuple or a function returning one (registries are read
    when validating); ``low``/``above``/``high`` bound numbers (``>=``, ``>``,
    ``<``); ``flag`` is its flat name when not the field's own; ``estimate``:
    ``mpishard estimate`` reads it too; ``aliases``: other spellings taken as a
    value (``{"bf16": "bfloat16"}``); ``families``: for a model family's own
    ``[model]`` key, family name -> its :class:`~mpishard.models.ModelKey` (the
    default and bounds that apply under that family); ``size``: a byte count, whose
    flag also takes ``60GiB``, ``500MB`` (:func:`~mpishard.core.parse.parse_bytes`).
    """
    meta = dict(help=help, flag=flag, choices=choices, low=low, above=above, high=high,
                estimate=estimate, aliases=aliases or {}, families=families or {}, size=size)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def model_names():
    from mpishard.models import MODELS  # noqa: PLC0415
    return tuple(MODELS)


def preset_names():
    from mpishard.config.presets import PRESETS  # noqa: PLC0415
    return ("", *PRESETS)


def strategy_names():
    from mpishard.parallel import STRATEGIES  # noqa: PLC0415
    return tuple(STRATEGIES)

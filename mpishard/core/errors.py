"""User errors that every layer above the library core may raise.

They are raised alike on every rank (or agreed first, see [Note: agreed
errors] in mpishard/core/agree.py); ``mpishard`` prints one line and exits 2.
"""
from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration file, flag or layout that cannot be used."""

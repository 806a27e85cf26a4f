"""Parsing of the text values that flags and configuration files share."""
from __future__ import annotations

import argparse

__all__ = ["parse_bool"]


def parse_bool(text: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no, on/off) as a bool, for argparse's ``type=``."""
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")

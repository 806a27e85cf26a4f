"""Parsing of the text values that flags and configuration files share."""
from __future__ import annotations

import argparse
import re

__all__ = ["parse_bool", "parse_bytes", "format_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bool(text: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no, on/off) as a bool, for argparse's ``type=``."""
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def parse_bytes(text: str) -> int:
    """``"5GB"`` -> 5 * 10**9, ``"60GiB"`` -> 60 * 2**30, ``"1024"`` -> 1024 (bytes), for
    argparse's ``type=`` (an :class:`argparse.ArgumentTypeError` naming the forms)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give one such as 5GB, "
                                         f"200MB, 60GiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(nbytes: float) -> str:
    """``1536`` -> ``"1.5 KiB"``: bytes in the largest binary unit up to GiB that keeps
    the figure at or above 1 (whole bytes below 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""

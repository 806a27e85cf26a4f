"""The benchmark commands' flags: one-line errors, all found before anything is measured.

A bad value (``--iters 0``, ``--sizes-mib -1``) or an output file nothing can be
written to (a folder, a path under a file) is refused as one line, ``PROG: error:
...``, printed by rank 0, and every rank exits with status 2, as ``mpishard``'s own
commands do; a run is never measured and then lost at the end.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from mpi4py import MPI

from mpishard.core.paths import why_unwritable

__all__ = ["BenchParser", "check_count", "check_sizes", "check_output", "output_problem",
           "write_json"]


class BenchParser(argparse.ArgumentParser):
    """argparse, but an error is one line (``PROG: error: ... (see PROG --help)``)
    printed by rank 0 only; every rank exits with status 2."""

    def error(self, message):
        if MPI.COMM_WORLD.rank == 0:
            sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
            sys.stderr.flush()
        sys.exit(2)


def check_count(parser, flag: str, value: int, least: int, what: str, example) -> None:
    """Refuse ``value`` of ``flag`` below ``least``; ``what`` it counts and an ``example``
    value complete the message."""
    if value < least:
        parser.error(f"{flag} {value} must be at least {least}: {what}, e.g. {flag} {example}")


def check_sizes(parser, flag: str, values, what: str, example: str) -> None:
    """Refuse a size in ``values`` that is not a finite number above 0."""
    for value in values:
        if not (math.isfinite(value) and value > 0):
            parser.error(f"{flag} {value:g}: each size must be above 0: {what}, e.g. "
                         f"{flag} {example}")


def output_problem(path, example: str) -> str | None:
    """Why no file can be written at ``path`` (:func:`~mpishard.core.paths.why_unwritable`,
    or no permission to write there), to follow the path in a message; ``None`` where
    nothing stands in the way (missing parent folders are made when it is written)."""
    why = why_unwritable(path, folder=False, example=example)
    if why is not None:
        return why
    path = Path(path).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not os.access(existing, os.W_OK):
        where = "to it" if existing == path else f"in {existing}"
        return f"cannot be written (no permission to write {where}); pass another path"
    return None


def check_output(parser, flag: str, path, example: str) -> None:
    """Refuse an output file nothing can be written to, before any measurement. Rank 0
    writes, so rank 0 decides and every rank receives its answer (no rank is left
    waiting)."""
    world = MPI.COMM_WORLD
    why = output_problem(path, example) if world.rank == 0 else None
    if world.size > 1:
        why = world.bcast(why, root=0)
    if why is not None:
        parser.error(f"{flag} {path} {why}")


def write_json(path, data) -> None:
    """Write ``data`` as JSON to ``path``, making missing parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)

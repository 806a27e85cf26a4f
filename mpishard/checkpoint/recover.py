"""Resuming from the newest checkpoint that verifies, and setting damaged ones aside.

[Note: damaged checkpoints]
A checkpoint can be complete (its manifest committed) and still fail to load:
a shard truncated or overwritten afterwards, a disk that lost a block. A resume
then tries the complete checkpoints newest first (the one ``latest`` names,
then the others by step) and loads the first that verifies; each newer one that
failed is renamed ``step-N.damaged`` (by rank 0), so that retention
(``keep_last``) neither counts it nor deletes it, a later save of step N does
not collide with it, and its files stay for a person to look at. Only damage is
skipped: a checkpoint that does not fit the model (rule ``mismatch``) is a
configuration error, and stops the resume on the newest one.

A failed attempt leaves nothing half-loaded that matters: each load overwrites
every parameter and optimizer value it reads, and the step counters are
restored only by the load that succeeds.
"""
from __future__ import annotations

import os
from pathlib import Path

from mpishard.checkpoint.collective import agree
from mpishard.checkpoint.errors import CheckpointError
from mpishard.checkpoint.locate import resume_candidates
from mpishard.checkpoint.reader import load_checkpoint

__all__ = ["load_newest_valid", "set_aside", "DAMAGED_SUFFIX"]

#: the suffix of a step directory that failed to load and was set aside
DAMAGED_SUFFIX = ".damaged"

#: failures that are not damage: the checkpoint is fine, the run does not fit it
_NOT_DAMAGE = ("mismatch", "no-checkpoint")


def set_aside(step_dir) -> Path:
    """Rename ``step_dir`` to ``step-N.damaged`` (``.damaged-2``, ... when taken); not
    collective. Returns the new path."""
    step_dir = Path(step_dir)
    target, n = step_dir.with_name(step_dir.name + DAMAGED_SUFFIX), 1
    while target.exists():
        n += 1
        target = step_dir.with_name(f"{step_dir.name}{DAMAGED_SUFFIX}-{n}")
    os.rename(step_dir, target)
    return target


def load_newest_valid(root, strategy, optimizer=None, *, world=None):
    """Load the newest checkpoint under ``root`` that verifies (see [Note: damaged checkpoints]).

    Collective over ``world`` (default ``strategy.mesh.world``).

    Returns:
        ``(extra_state, step_dir, skipped)``: what :func:`load_checkpoint` returns,
        the step directory loaded, and ``[(step_dir, moved_to, error)]`` for each
        newer checkpoint that failed and was set aside (the same on every rank).

    Raises:
        CheckpointError: rule ``no-checkpoint`` when ``root`` holds none; the
            newest one's error when none verifies (nothing is set aside then) or
            when it does not fit the model.
    """
    world = world if world is not None else strategy.mesh.world
    err, found = None, []
    if world.rank == 0:
        try:
            found = [str(p) for p in resume_candidates(root)]
        except OSError as exc:
            err = CheckpointError(root, "io", f"cannot list the checkpoints: {exc}")
    candidates = agree(world, err, f"finding the checkpoints in {root}", found)[0]
    if not candidates:
        raise CheckpointError(root, "no-checkpoint", "no complete checkpoint here: no "
                              "step-N/ directory with a manifest.json")
    failed: list = []
    for step_dir in candidates:
        try:
            extra = load_checkpoint(step_dir, strategy, optimizer, world=world)
        except CheckpointError as exc:               # the same on every rank
            if exc.rule in _NOT_DAMAGE or step_dir == candidates[-1]:
                if failed and exc.rule not in _NOT_DAMAGE:
                    raise failed[0][1] from None     # none verifies: the newest's error
                raise
            failed.append((step_dir, exc))
            continue
        return extra, Path(step_dir), _set_aside_all(world, failed)
    raise AssertionError("unreachable: the last candidate returns or raises")


def _set_aside_all(world, failed: list) -> list:
    err, moved = None, []
    if world.rank == 0:
        for step_dir, _ in failed:
            try:
                moved.append(str(set_aside(step_dir)))
            except OSError as exc:
                err = CheckpointError(step_dir, "io", f"cannot set the damaged checkpoint "
                                      f"aside: {exc}")
                break
    moved = agree(world, err, "setting damaged checkpoints aside", moved)[0]
    return [(Path(step_dir), Path(path), exc) for path, (step_dir, exc) in zip(moved, failed)]

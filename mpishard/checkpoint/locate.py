"""Finding checkpoints under a root: the complete ones, the one to resume from.

See [Note: checkpoint layout] in format.py: only ``step-N`` (or ``step-N.old``
when no ``step-N`` exists) holding a manifest counts.
"""
from __future__ import annotations

from pathlib import Path

from mpishard.core.paths import inside
from mpishard.checkpoint.errors import CheckpointError
from mpishard.checkpoint.format import LATEST, LATEST_RE, MANIFEST, STEP_RE

__all__ = ["complete_steps", "latest_checkpoint", "resolve_checkpoint", "resume_candidates",
           "check_output_outside"]


def complete_steps(root) -> dict:
    """``{step: directory}`` of complete checkpoints under ``root`` (see [Note: checkpoint layout]).

    ``step-N`` wins over ``step-N.old``; a directory counts once its manifest exists.
    """
    found: dict = {}
    try:
        entries = sorted(Path(root).iterdir())
    except OSError:
        return found
    for entry in entries:
        match = STEP_RE.fullmatch(entry.name)
        if match is None or not (entry / MANIFEST).is_file():
            continue
        step = int(match.group(1))
        if match.group(2) is None or step not in found:
            found[step] = entry
    return found


def latest_checkpoint(root):
    """The checkpoint to resume from under ``root``, or ``None`` if there is none.

    The step named in ``root/latest`` when that directory is complete; otherwise
    (``latest`` missing or pointing at a directory a crash left incomplete) the
    complete checkpoint with the highest step.
    """
    root = Path(root)
    try:
        with open(root / LATEST, "rb") as f:
            named = f.read(64).decode("ascii", "replace").strip()
    except OSError:
        named = ""
    if LATEST_RE.fullmatch(named) and (root / named / MANIFEST).is_file():
        return root / named
    steps = complete_steps(root)
    return steps[max(steps)] if steps else None


def resume_candidates(root) -> list:
    """The complete checkpoints under ``root``, in the order a resume tries them: the
    one :func:`latest_checkpoint` picks, then the others from the highest step down."""
    first = latest_checkpoint(root)
    if first is None:
        return []
    rest = [path for _, path in sorted(complete_steps(root).items(), reverse=True)]
    return [first] + [path for path in rest if path != first]


def resolve_checkpoint(path) -> Path:
    """A step directory from ``path``: itself if it holds a manifest, else its latest.

    Raises:
        CheckpointError: rule ``no-checkpoint`` when there is none.
    """
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    if not path.exists():
        raise CheckpointError(path, "no-checkpoint", "does not exist; pass a checkpoint "
                              "root (the --checkpoint-dir of a run) or a step-N directory")
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointError(path, "no-checkpoint", "no complete checkpoint here: neither "
                              "a manifest.json nor a step-N/ directory with one")
    return found


def check_output_outside(out, step_dir) -> None:
    """ValueError where the output ``out`` is, or lies in, a step folder of the run whose
    checkpoint ``step_dir`` is read (``step_dir`` itself, or a ``step-N`` beside it):
    writing there would destroy a checkpoint, the one read among them."""
    step_dir = Path(step_dir)
    folders = [step_dir] + sorted(p for p in step_dir.parent.iterdir()
                                  if STEP_RE.fullmatch(p.name) and p.is_dir())
    hit = next((f for f in folders if inside(out, f)), None)
    if hit is not None:
        where = "is" if inside(hit, out) else f"lies inside {hit},"
        raise ValueError(f"{out} {where} a step folder of the checkpoint being read; writing "
                         f"there would overwrite it: pass an output outside {hit}")

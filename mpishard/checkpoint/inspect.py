"""What a checkpoint holds, and whether it is intact: ``mpishard checkpoint inspect DIR``.

    $ mpishard checkpoint inspect ckpt/
    checkpoint  ckpt/step-40 (step 40)
    layout      ZeRO stage 3, world 4 = pp 1 x dp 4 x cp 1 x tp 1
    ...
    integrity   ok: 4 files (SHA-256, headers), 36 tensors each covered exactly once
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from mpishard.checkpoint.errors import CheckpointError
from mpishard.checkpoint.format import FORMAT_NAME, MANIFEST, read_manifest
from mpishard.checkpoint.locate import resolve_checkpoint, resume_candidates
from mpishard.checkpoint.reader import verify_file
from mpishard.core.parse import format_bytes

__all__ = ["inspect_checkpoint", "Inspection"]


@dataclass
class Inspection:
    """The report (``text``), every integrity problem found (``errors``) and the step
    directory described (``step_dir``)."""

    text: str
    errors: list = field(default_factory=list)
    step_dir: Path | None = None

    @property
    def ok(self) -> bool:
        return not self.errors


def _axes(mesh: dict) -> str:
    """``pp 1 x dp 4 x cp 1 x tp 1`` (with the hybrid split of dp when it has one)."""
    text = " x ".join(f"{a} {mesh[a]}" for a in ("pp", "dp", "cp", "tp") if a in mesh)
    if mesh.get("dp_replicate", 1) > 1:
        text += f" (dp_replicate {mesh['dp_replicate']} x dp_shard {mesh['dp_shard']})"
    if mesh.get("ep", 1) > 1:
        text += f", experts over ep {mesh['ep']}"
    return text


def inspect_checkpoint(path, *, verify: bool = True) -> Inspection:
    """Describe a checkpoint (step, layout, tensors and sizes) and verify it.

    Args:
        path: a step directory, or a checkpoint root: then the newest checkpoint
            that verifies, the one ``--resume`` takes (see [Note: damaged
            checkpoints]), with a line for each newer one that does not, each
            save that never committed (``step-N.tmp``) and each set aside.
        verify: hash every file and check its header against the manifest.

    Raises:
        CheckpointError: no checkpoint at ``path``, or a manifest that fails
            its checks (nothing can be described then). Problems in the rank
            files are collected in ``Inspection.errors`` instead.
    """
    path = Path(path)
    if (path / MANIFEST).is_file() or not path.is_dir():
        return _inspect(resolve_checkpoint(path), verify)
    candidates = resume_candidates(path) or [resolve_checkpoint(path)]  # raises: none
    skipped, report = [], None
    for step_dir in candidates:
        try:
            report = _inspect(step_dir, verify)
        except CheckpointError as err:
            skipped.append((step_dir, f"skipped     {step_dir.name}: {err}"))
            continue
        if report.ok:
            break
        skipped.append((step_dir, f"skipped     {step_dir.name}: {report.errors[0]}"))
    if report is None:
        raise CheckpointError(path, "no-valid-checkpoint", "no checkpoint here verifies: "
                              + "; ".join(line.split(None, 1)[1] for _, line in skipped))
    notes = [line for step_dir, line in skipped if step_dir != report.step_dir]
    for entry in sorted(path.iterdir()):
        if re.fullmatch(r"step-\d+\.tmp", entry.name):
            notes.append(f"unfinished  {entry.name}: a save that never committed (the next "
                         f"save removes it)")
        elif re.fullmatch(r"step-\d+(\.old)?\.damaged(-\d+)?", entry.name):
            notes.append(f"set aside   {entry.name}: damaged, kept for a person to look at")
    if report.ok and skipped:
        notes.append(f"newest valid {report.step_dir.name}: --resume continues from it")
    return Inspection("\n".join([report.text, *notes]), report.errors, report.step_dir)


def _inspect(step_dir: Path, verify: bool) -> Inspection:
    m = read_manifest(step_dir)
    stage = m.strategy.get("stage")
    lines = [f"checkpoint  {step_dir} (step {m.step})",
             f"format      {FORMAT_NAME} v{m.body['format_version']}, written by mpishard "
             f"{m.mpishard_version}",
             f"layout      {m.strategy['name']}{f' stage {stage}' if stage else ''}, world "
             f"{m.world_size} = {_axes(m.mesh)}",
             f"counters    {m.strategy['steps']} strategy steps, "
             f"{m.strategy['skipped_steps']} skipped"]
    if m.optimizer is not None:
        o = m.optimizer
        lines.append(f"optimizer   {o['type']}, step_count {o['step_count']}, lr {o['lr']:g}, "
                     f"state {', '.join(o['state_names']) or 'none'}")
    total = sum(f.bytes for f in m.files.values())
    lines.append(f"files       {len(m.files)} ({format_bytes(total)}): " + ", ".join(
        f"{name} {format_bytes(f.bytes)}" for name, f in sorted(m.files.items(),
                                                        key=lambda kv: kv[1].rank)))
    lines.append(f"extra state {', '.join(sorted(m.extra)) or 'none'}")
    for alias, target in sorted(m.aliases.items()):
        lines.append(f"alias       {alias} -> {target}")
    params = [t for t in m.tensors.values() if t.kind == "param"]
    others = [t for t in m.tensors.values() if t.kind != "param"]
    lines.append(f"parameters  {len(params)} tensors, {sum(t.numel for t in params):,} "
                 f"elements, {format_bytes(sum(t.nbytes for t in params))}")
    if others:
        lines.append(f"opt. state  {len(others)} tensors, {format_bytes(sum(t.nbytes for t in others))}")
    width = max([len(t.name) for t in params] + [4])
    lines.append(f"  {'name':<{width}}  {'shape':<14} {'dtype':<8} {'pieces':>6} {'bytes':>10}")
    for t in params:
        shape = "x".join(str(n) for n in t.shape) or "scalar"
        lines.append(f"  {t.name:<{width}}  {shape:<14} {t.dtype:<8} {len(t.pieces):>6} "
                     f"{format_bytes(t.nbytes):>10}")
    errors = []
    if verify:
        for name in sorted(m.files, key=lambda n: m.files[n].rank):
            try:
                verify_file(step_dir, m, name)
            except CheckpointError as err:
                errors.append(err)
        if errors:
            lines += [f"integrity   FAILED: {err}" for err in errors]
        else:
            lines.append(f"integrity   ok: {len(m.files)} files (SHA-256, headers), "
                         f"{len(m.tensors)} tensors each covered exactly once")
    else:
        lines.append("integrity   manifest ok; files not verified (--no-verify)")
    return Inspection("\n".join(lines), errors, Path(step_dir))

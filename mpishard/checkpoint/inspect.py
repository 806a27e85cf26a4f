"""What a checkpoint holds, and whether it is intact: ``mpishard checkpoint inspect DIR``.

    $ mpishard checkpoint inspect ckpt/
    checkpoint  ckpt/step-40 (step 40)
    layout      ZeRO stage 3, world 4 = pp 1 x dp 4 x cp 1 x tp 1
    ...
    integrity   ok: 4 files (SHA-256, headers), 36 tensors each covered exactly once
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mpishard.checkpoint.errors import CheckpointError
from mpishard.checkpoint.format import FORMAT_NAME, read_manifest
from mpishard.checkpoint.locate import resolve_checkpoint
from mpishard.checkpoint.reader import verify_file

__all__ = ["inspect_checkpoint", "Inspection"]


@dataclass
class Inspection:
    """The report (``text``) and every integrity problem found (``errors``)."""

    text: str
    errors: list = field(default_factory=list)

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


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def inspect_checkpoint(path, *, verify: bool = True) -> Inspection:
    """Describe a checkpoint (step, layout, tensors and sizes) and verify it.

    Args:
        path: a step directory, or a checkpoint root (its latest step).
        verify: hash every file and check its header against the manifest.

    Raises:
        CheckpointError: no checkpoint at ``path``, or a manifest that fails
            its checks (nothing can be described then). Problems in the rank
            files are collected in ``Inspection.errors`` instead.
    """
    step_dir = resolve_checkpoint(path)
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
    lines.append(f"files       {len(m.files)} ({_size(total)}): " + ", ".join(
        f"{name} {_size(f.bytes)}" for name, f in sorted(m.files.items(),
                                                        key=lambda kv: kv[1].rank)))
    lines.append(f"extra state {', '.join(sorted(m.extra)) or 'none'}")
    for alias, target in sorted(m.aliases.items()):
        lines.append(f"alias       {alias} -> {target}")
    params = [t for t in m.tensors.values() if t.kind == "param"]
    others = [t for t in m.tensors.values() if t.kind != "param"]
    lines.append(f"parameters  {len(params)} tensors, {sum(t.numel for t in params):,} "
                 f"elements, {_size(sum(t.nbytes for t in params))}")
    if others:
        lines.append(f"opt. state  {len(others)} tensors, {_size(sum(t.nbytes for t in others))}")
    width = max([len(t.name) for t in params] + [4])
    lines.append(f"  {'name':<{width}}  {'shape':<14} {'dtype':<8} {'pieces':>6} {'bytes':>10}")
    for t in params:
        shape = "x".join(str(n) for n in t.shape) or "scalar"
        lines.append(f"  {t.name:<{width}}  {shape:<14} {t.dtype:<8} {len(t.pieces):>6} "
                     f"{_size(t.nbytes):>10}")
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
    return Inspection("\n".join(lines), errors)

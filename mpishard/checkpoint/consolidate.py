"""One safetensors file with the whole model, and starting a run from one.

    mpishard checkpoint consolidate ckpt/ model.safetensors      # latest step

    >>> import torch, safetensors.torch
    >>> model = GPT(cfg)                                  # a PyTorch nanoGPT
    >>> model.load_state_dict(safetensors.torch.load_file("model.safetensors"))

The export holds every parameter under its model name (nanoGPT's, for the GPT:
``transformer.h.0.mlp.c_fc.weight``, ...) with its global shape (weights
``[out, in]``, as ``torch.nn.Linear`` stores them) and dtype, plus each tied
alias as its own copy (``lm_head.weight``, tied to ``transformer.wte.weight``),
because ``load_state_dict`` expects every name of the state dict. Optimizer
state is not exported.

It streams: the header is written from the manifest first, then one tensor at
a time is assembled from the byte ranges of its pieces and written, so peak
memory is the largest tensor plus a constant, whatever the model's size.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from mpishard import __version__
from mpishard.core.backend import xp_of
from mpishard.core.paths import why_unwritable
from mpishard.parallel.pieces import load_pieces
from mpishard.parallel.strategy import Strategy
from mpishard.checkpoint.collective import agree, exchange_json
from mpishard.checkpoint.errors import CheckpointError
from mpishard.checkpoint.format import numel
from mpishard.checkpoint.locate import check_output_outside, resolve_checkpoint
from mpishard.checkpoint.reader import ShardReader, verify_checkpoint
from mpishard.checkpoint.shards import SafetensorsWriter, ShardFile

__all__ = ["consolidate", "load_consolidated"]


def consolidate(path, out_path, *, verify: bool = True) -> Path:
    """Write the parameters of a checkpoint as one safetensors file (streamed).

    Args:
        path: a step directory, or a checkpoint root (its latest step).
        out_path: the ``.safetensors`` file to write (replaced atomically).
        verify: hash every file first (streamed); headers and the manifest are
            checked either way.

    Returns:
        ``out_path``.

    Raises:
        CheckpointError: the checkpoint is missing or damaged.
        ValueError: ``out_path`` is a folder, or lies inside the checkpoint being read.
    """
    step_dir = resolve_checkpoint(path)
    check_output_outside(out_path, step_dir)
    out_path = _writable_file(out_path)
    # Headers are always checked (cheap), so no size below comes unchecked from a file.
    manifest = verify_checkpoint(step_dir, check_hashes=verify)
    params = [t for t in manifest.tensors.values() if t.kind == "param"]
    aliases: dict = {}
    for alias, target in manifest.aliases.items():
        aliases.setdefault(target, []).append(alias)
    specs = []
    for t in params:
        specs += [(name, t.dtype, t.shape) for name in [t.name, *aliases.get(t.name, [])]]
    writer = SafetensorsWriter(out_path, specs, {"format": "pt", "step": str(manifest.step),
                                                 "producer": f"mpishard {__version__}"})
    try:
        with ShardReader(step_dir, manifest) as reader:
            for t in params:
                full = np.empty(t.numel, dtype=np.dtype(t.dtype).newbyteorder("<"))
                reader.read_into(t.name, "param", [(0, t.numel)] if t.numel else [], full)
                for name in [t.name, *aliases.get(t.name, [])]:
                    writer.write(name, full)
                del full
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def _writable_file(out_path) -> Path:
    """``out_path`` with its parent folders made; ValueError where it is a folder (or a
    file stands where a parent folder should), before any byte is written."""
    out = Path(out_path)
    why = why_unwritable(out, folder=False, example="model.safetensors")
    if why is not None:
        raise ValueError(f"{out} {why}")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def load_consolidated(path, target, *, world=None, strict: bool = True) -> None:
    """Set a model's parameters from a consolidated safetensors file (to fine-tune from it).

    Args:
        path: a ``.safetensors`` file with the model's parameter names and
            global shapes (a :func:`consolidate` export, or one saved from a
            PyTorch nanoGPT).
        target: a materialised :class:`~mpishard.nn.Module`, or a
            :class:`~mpishard.parallel.Strategy` (then collective over
            ``world``, default ``strategy.mesh.world``; each rank reads only
            the byte ranges of its own pieces, so a ZeRO-3 model is never
            whole on any rank).
        strict: every name in the file must belong to the model (tied
            aliases such as ``lm_head.weight`` included).

    Raises:
        CheckpointError: a damaged file, a missing or unexpected name, or a
            shape that differs from the model's (on every rank, for a strategy).
    """
    if not isinstance(target, Strategy):
        _load_into_module(path, target, strict)
        return
    world = world if world is not None else target.mesh.world
    # Every rank's names: a pipeline stage holds only its own parameters.
    every_name = set().union(*exchange_json(world, [
        name for name, _ in target.module.named_parameters(remove_duplicate=False)]))
    shard, err, failure = None, None, None

    def read(name, kind, runs, dtype):
        nonlocal failure
        size = sum(b - a for a, b in runs)
        if failure is None:
            try:
                out = np.empty(size, dtype=shard.entries[name].dtype)
                pos = 0
                for start, stop in runs:
                    shard.read_into(name, start, out[pos:pos + stop - start])
                    pos += stop - start
                return out.astype(dtype, copy=False)
            except Exception as exc:  # noqa: BLE001 -- agreed after load_pieces
                failure = exc
        return np.zeros(size, dtype=dtype)

    try:
        try:
            shard = ShardFile(path)
            _check_names(shard, target.module, strict, every_name)
        except Exception as exc:  # noqa: BLE001 -- agreed, see [Note: checkpoint agreement]
            err = exc
        agree(world, err, f"reading {path}")
        load_pieces(target, None, read)
    finally:
        if shard is not None:
            shard.close()
    agree(world, failure, f"loading {path}")


def _load_into_module(path, module, strict: bool) -> None:
    every_name = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    with ShardFile(path) as shard:
        _check_names(shard, module, strict, every_name)
        for name, p in module.named_parameters():
            if p.data is None:
                raise CheckpointError(path, "mismatch", f"parameter {name} is not "
                                      f"materialised; materialise the model or pass its "
                                      f"strategy")
            full = np.empty(numel(p.spec.global_shape), dtype=shard.entries[name].dtype)
            shard.read_into(name, 0, full)
            local = p.spec.local_slice_of(full.reshape(p.spec.global_shape))
            p.data[...] = xp_of(p.data).asarray(local, dtype=p.data.dtype)


def _check_names(shard: ShardFile, module, strict: bool, every_name: set) -> None:
    """This rank's parameters are in the file with their global shapes; with ``strict``,
    every tensor of the file is one of ``every_name`` (the model's, tied aliases included)."""
    for name, p in module.named_parameters():
        entry = shard.entries.get(name)
        if entry is None:
            raise CheckpointError(shard.path, "missing-tensor", f"{name} is not in the file")
        if entry.shape != tuple(p.spec.global_shape):
            raise CheckpointError(shard.path, "shape", f"{name} has shape {list(entry.shape)} "
                                  f"in the file, {list(p.spec.global_shape)} in the model")
    unexpected = sorted(set(shard.entries) - every_name)
    if strict and unexpected:
        raise CheckpointError(shard.path, "mismatch", f"the file has tensors the model does "
                              f"not: {', '.join(unexpected[:5])}")

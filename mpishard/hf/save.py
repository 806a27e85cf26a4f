"""Handing results back: a Hugging Face folder from a model, a strategy, or a checkpoint.

    save_pretrained(model, "out/")                       # a whole model, one process
    save_pretrained(run.strategy, "out/")                # collective: any layout
    export_checkpoint("ckpt/", "out/")                   # one process, no model built

The folder loads with ``transformers.AutoModelForCausalLM.from_pretrained`` and
reports no missing or unexpected keys (see mpishard/hf/names.py for the
tensors written, [Note: writing a model folder] in folder.py for the files).

[Note: streaming a strategy's export]
Every rank owns a disjoint share of every parameter ([Note: counted once] in
mpishard/parallel/strategy.py). The ranks first exchange, as JSON, how many
elements and runs of each tensor they own; then, tensor by tensor in the
folder's order, each owner sends its runs and values to rank 0
(point-to-point, buffers only), which places them into that one tensor,
writes it and lets it go. Rank 0 thus holds one whole tensor (and its
transpose, for GPT-2's ``Conv1D`` weights) beyond its own pieces, the others
nothing beyond theirs. A write that fails on rank 0 still receives the rest,
and a rank that cannot produce its share still sends a placeholder, so no
rank is left waiting; the outcome is agreed before the folder is moved into
place, so a failure anywhere leaves the destination untouched and raises the
same error on every rank.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from mpishard.core.backend import to_numpy
from mpishard.checkpoint.collective import agree
from mpishard.checkpoint.errors import CheckpointError
from mpishard.checkpoint.locate import check_output_outside, resolve_checkpoint
from mpishard.checkpoint.reader import ShardReader, verify_checkpoint
from mpishard.parallel.strategy import Strategy
from mpishard.hf.config import hf_config, mapping_of
from mpishard.hf.folder import FolderWriter
from mpishard.hf.names import tensor_plan

__all__ = ["save_pretrained", "export_checkpoint", "config_of_manifest"]

_RUNS, _VALUES = 1, 2       # message tags


def _as_array(t, full: np.ndarray) -> np.ndarray:
    """The tensor as the Hugging Face file stores it (GPT-2's Conv1D transposed)."""
    full = full.reshape(t.shape)
    return np.ascontiguousarray(full.T) if t.transposed else full


def save_pretrained(model_or_strategy, path, world=None, max_shard_bytes: int = 5 * 2**30
                    ) -> Path:
    """Write a Hugging Face model folder that ``transformers`` loads without warnings.

    Args:
        model_or_strategy: a whole, materialised GPT or Llama (one process), or a
            :class:`~mpishard.parallel.Strategy` (or ``ParallelModel``) wrapping one
            on any layout (collective over ``world``; rank 0 writes, see
            [Note: streaming a strategy's export]).
        path: the folder (created, or its weight files and config.json replaced).
        world: for a strategy, every rank taking part (default ``strategy.mesh.world``).
        max_shard_bytes: past this size the weights are split into several files
            with an index, as transformers does.

    Returns:
        ``path``.

    Raises:
        CheckpointError: the write failed (on every rank alike, for a strategy).
        ValueError: the model has no Hugging Face form, or is only a part of one.
    """
    target = getattr(model_or_strategy, "strategy", model_or_strategy)
    if isinstance(target, Strategy):
        world = world if world is not None else target.mesh.world
        return _save_strategy(target, Path(path), world, max_shard_bytes)
    return _save_module(target, Path(path), max_shard_bytes)


def _layout(plan, dtype: str) -> list:
    """``(key, dtype, shape)`` of every tensor the files will hold, in order."""
    return [(key, dtype, shape) for t in plan for key, shape in t.files()]


def _write(writer, t, full: np.ndarray) -> None:
    """Write tensor ``t`` (its whole mpishard value ``full``): itself, or part by part."""
    if not t.parts:
        writer.write(t.key, _as_array(t, full))
        return
    block = int(np.prod(t.part_shape))
    flat = full.reshape(-1)
    for j, key in enumerate(t.parts):
        writer.write(key, np.ascontiguousarray(flat[j * block:(j + 1) * block])
                     .reshape(t.part_shape))


def _save_module(model, path: Path, max_shard_bytes: int) -> Path:
    config = getattr(model, "config", None)
    mapping_of(config)                # raises for a model without a Hugging Face form
    params = dict(model.named_parameters())
    partial = [n for n, p in params.items() if p.data is None or p.spec.tp_dim is not None
               or p.spec.ep_range is not None or p.spec.flat is not None]
    if partial or not (model.first_stage and model.last_stage) \
            or len(model.block_ids) != config.n_layer:
        raise ValueError("save_pretrained: this model is a part of one (a pipeline stage, "
                         "tensor-parallel or ZeRO-sharded, or unmaterialised"
                         f"{': ' + partial[0] if partial else ''}); pass its strategy")
    dtype = next(iter(params.values())).spec.dtype
    plan, written = tensor_plan(config), hf_config(config, dtype)
    writer = FolderWriter(path, _layout(plan, dtype), max_shard_bytes)
    try:
        for t in plan:
            full = (np.zeros(t.shape, dtype) if t.name is None
                    else np.asarray(to_numpy(params[t.name].data), dtype=dtype))
            _write(writer, t, full)
        return writer.finish(written)
    except BaseException:
        writer.abort()
        raise


def _save_strategy(strategy, path: Path, world, max_shard_bytes: int) -> Path:
    owned: dict = {}
    for piece in strategy.pieces():
        if piece.kind == "param" and piece.owner and piece.size:
            owned.setdefault(piece.name, []).append(piece)
    mine = {name: [sum(p.size for p in ps), sum(len(p.runs) for p in ps), ps[0].dtype]
            for name, ps in owned.items()}
    err, plan, written = None, None, None
    dtype = str(strategy.master_dtype)
    try:
        config = strategy.module.config
        plan, written = tensor_plan(config), hf_config(config, dtype)
    except Exception as exc:  # noqa: BLE001 -- agreed
        err = exc
    counts = agree(world, err, f"exporting to {path}", mine)
    writer, err = None, None
    if world.rank == 0:
        try:
            for t in plan:
                have = sum(c[t.name][0] for c in counts if t.name in c)
                if t.name is not None and have != int(np.prod(t.shape)):
                    raise CheckpointError(path, "coverage", f"the ranks own {have} elements of "
                                          f"{t.name}, it has {int(np.prod(t.shape))}")
            writer = FolderWriter(path, _layout(plan, dtype), max_shard_bytes)
        except Exception as exc:  # noqa: BLE001
            err = exc
    agree(world, err, f"exporting to {path}")
    failure = None
    for t in plan:
        if world.rank == 0:
            full = _gather_tensor(t, owned, counts, world, dtype)
            if failure is None:
                try:
                    _write(writer, t, full)
                except Exception as exc:  # noqa: BLE001 -- keep receiving, agree below
                    failure = exc
                    writer.abort()
            del full
        elif t.name in owned:
            pieces = owned[t.name]
            runs = np.array([r for p in pieces for r in p.runs], dtype=np.int64).reshape(-1)
            try:
                values = np.concatenate([np.asarray(to_numpy(p.array), dtype=dtype)
                                         .reshape(-1) for p in pieces])
            except Exception as exc:  # noqa: BLE001 -- rank 0 still expects the message
                failure = failure or exc
                values = np.zeros(mine[t.name][0], dtype=dtype)
            world.send(runs, 0, _RUNS)
            world.send(values, 0, _VALUES)
    try:                    # every tensor arrived and was written, or nothing is kept
        agree(world, failure, f"writing {path}")
    except CheckpointError:
        if writer is not None:
            writer.abort()
        raise
    if world.rank == 0:
        try:
            writer.finish(written)
        except Exception as exc:  # noqa: BLE001
            err = exc
            writer.abort()
    agree(world, err, f"writing {path}")
    return path


def _gather_tensor(t, owned: dict, counts: list, world, dtype: str) -> np.ndarray:
    """On rank 0: tensor ``t`` whole, from its own pieces and every other owner's."""
    n = int(np.prod(t.shape))
    flat = np.zeros(n, dtype=dtype)
    if t.name is None:
        return flat

    def place(runs, values):
        pos = 0
        for a, b in runs:
            flat[a:b] = values[pos:pos + b - a]
            pos += b - a

    for piece in owned.get(t.name, []):
        place(piece.runs, np.asarray(to_numpy(piece.array), dtype=dtype).reshape(-1))
    for rank in range(1, world.size):
        if t.name not in counts[rank]:
            continue
        size, n_runs, _ = counts[rank][t.name]
        runs = world.recv(np.empty(2 * n_runs, dtype=np.int64), rank, _RUNS)
        values = world.recv(np.empty(size, dtype=dtype), rank, _VALUES)
        place(runs.reshape(-1, 2).tolist(), values)
    return flat


def config_of_manifest(manifest):
    """The model config (GPTConfig, LlamaConfig, ...) a checkpoint was trained with (its
    ``extra["config"]``)."""
    from mpishard.config.sections import KEYS, ConfigError, config_from_dict, flat_values  # noqa: PLC0415
    from mpishard.models import MODELS  # noqa: PLC0415
    from mpishard.recipes import recipe_for  # noqa: PLC0415

    raw = manifest.extra.get("config")
    if not isinstance(raw, dict):
        raise CheckpointError(manifest.path, "config", "the manifest has no training config "
                              "(extra['config']), so the model's shape is unknown; save with "
                              "'mpishard train', or call mpishard.hf.save_pretrained(strategy, "
                              "...) from the training script")
    if isinstance(raw.get("model"), dict):      # sections, as mpishard train saves them
        raw = {"model": raw["model"]}
    else:                                       # older flat keys: the model's only
        raw = {k: v for k, v in raw.items() if k.replace("-", "_") in KEYS
               and KEYS[k.replace("-", "_")].section == "model"}
    try:
        cfg = config_from_dict(flat_values(raw, manifest.path, []), manifest.path)
        if MODELS[cfg.model.name].hf is None:
            forms = ", ".join(name for name, spec in MODELS.items() if spec.hf is not None)
            raise ConfigError(f"model {cfg.model.name!r} has no Hugging Face form; these "
                              f"have: {forms}")
        return recipe_for(cfg).model_config()
    except ConfigError as err:
        raise CheckpointError(manifest.path, "config", str(err)) from None


def export_checkpoint(ckpt_path, out_dir, max_shard_bytes: int = 5 * 2**30, *,
                      verify: bool = True) -> Path:
    """Write an mpishard checkpoint's parameters as a Hugging Face folder (one process).

    Streamed like :func:`mpishard.checkpoint.consolidate`: no model is built;
    one tensor at a time is read from the byte ranges of its pieces, converted
    and written, so memory peaks at about the largest tensor (twice, for a
    transposed one). Nothing is written unless the checkpoint fits.

    Args:
        ckpt_path: a checkpoint root (its latest step) or a ``step-N`` directory,
            saved by ``mpishard train`` (its manifest holds the model's config).
        out_dir: the folder to write.
        max_shard_bytes: split into several files with an index past this size.
        verify: hash every checkpoint file first.

    Raises:
        CheckpointError: a missing or damaged checkpoint, no model config in it,
            or tensors that do not fit that config.
        ValueError: ``out_dir`` lies inside the checkpoint being read.
    """
    step_dir = resolve_checkpoint(ckpt_path)
    check_output_outside(out_dir, step_dir)
    manifest = verify_checkpoint(step_dir, check_hashes=verify)
    config = config_of_manifest(manifest)
    plan = tensor_plan(config)
    params = {name: t for (name, kind), t in manifest.tensors.items() if kind == "param"}
    problems = [f"{t.name} is not in the checkpoint" for t in plan
                if t.name is not None and t.name not in params]
    problems += [f"{t.name} has shape {list(params[t.name].shape)} in the checkpoint, its "
                 f"config gives {list(t.shape)}" for t in plan
                 if t.name in params and params[t.name].shape != t.shape]
    names = {t.name for t in plan}
    problems += [f"{name} is in the checkpoint but not in the model" for name in params
                 if name not in names]
    if problems:
        raise CheckpointError(manifest.path, "mismatch", "the checkpoint does not fit its "
                              "config: " + "; ".join(problems[:5]))
    dtype = next(iter(params.values())).dtype
    written = hf_config(config, dtype)
    writer = FolderWriter(out_dir, _layout(plan, dtype), max_shard_bytes)
    try:
        with ShardReader(step_dir, manifest) as reader:
            for t in plan:
                n = int(np.prod(t.shape))
                full = np.zeros(n, dtype=dtype)
                if t.name is not None and n:
                    entry = params[t.name]
                    full = np.empty(n, dtype=np.dtype(entry.dtype).newbyteorder("<"))
                    reader.read_into(t.name, "param", [(0, n)], full)
                _write(writer, t, full)
                del full
        return writer.finish(written)
    except BaseException:
        writer.abort()
        raise

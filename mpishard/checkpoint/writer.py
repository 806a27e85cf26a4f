"""Saving a checkpoint: every rank writes its pieces, then one atomic commit.

    path = save_checkpoint("ckpt", step, strategy, optimizer,
                           extra_state={"data": sampler.state_dict()}, keep_last=3)

[Note: atomic commit]
1. Rank 0 clears what killed saves left behind (``step-*.tmp``, ``*.deleting``)
   and creates ``step-N.tmp/`` afresh; every rank checks its arguments. Agree.
2. Every rank writes ``rank-R.safetensors`` (its owned pieces, see
   [Note: pieces]) into ``step-N.tmp/``, fsyncs and hashes it. Agree, sharing
   each rank's table of pieces (see [Note: checkpoint agreement]).
3. Rank 0 writes ``manifest.json``, fsyncs it and the directory, renames
   ``step-N.tmp`` to ``step-N`` (an existing ``step-N`` is moved aside to
   ``step-N.old`` first and deleted after), fsyncs the parent, then replaces
   ``latest`` (``latest.tmp`` + rename + fsync) and only then deletes
   checkpoints beyond ``keep_last``. Agree.

The rename in step 3 is the commit point: before it the new checkpoint does
not exist, after it it is complete. A kill at any moment therefore leaves every
earlier complete checkpoint as it was, and at worst a ``.tmp`` directory that
the next save removes. If any rank fails, every rank raises the same
:class:`CheckpointError` with the per-rank failure map, and the temporary
directory is removed.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import numpy as np

from mpishard import __version__
from mpishard.core.backend import to_numpy
from mpishard.checkpoint.collective import agree
from mpishard.checkpoint.errors import CheckpointError
from mpishard.checkpoint.format import (DTYPES, FORMAT_NAME, FORMAT_VERSION, LATEST, MANIFEST, parse_manifest,
                     seal_manifest, shard_file_name, step_dir_name)
from mpishard.checkpoint.locate import complete_steps
from mpishard.checkpoint.shards import fsync_path, sha256_file

__all__ = ["save_checkpoint", "delete_checkpoints"]

_LEFTOVER = re.compile(r"step-\d+\.tmp|step-\d+(\.old)?\.deleting|latest\.tmp")
_REPLACED = re.compile(r"(step-\d+)\.old")


def save_checkpoint(directory, step: int, strategy, optimizer=None, *, world=None,
                    extra_state: dict | None = None, keep_last: int | None = None) -> Path:
    """Save parameters, optimizer state and ``extra_state`` as ``directory/step-{step}``.

    Collective over ``world``: call it on every rank with the same arguments.
    See [Note: atomic commit].

    Args:
        directory: the checkpoint root (created if missing).
        step: the number of completed training steps (an int >= 0). Saving a
            step that exists replaces it.
        strategy: the :class:`~mpishard.parallel.Strategy` wrapping the model.
        optimizer: its optimizer, or ``None`` for parameters only.
        world: every rank that holds pieces (default: ``strategy.mesh.world``).
        extra_state: JSON-able state to restore with the model: data-loader
            position, RNG states (:func:`generator_state`), loss scale, ... The
            value rank 0 passes is saved; it should be the same on every rank.
        keep_last: keep this many complete checkpoints (the highest steps, and
            always the one just written); ``None`` keeps all.

    Returns:
        The committed step directory.

    Raises:
        CheckpointError: on every rank, if any rank failed; ``failures`` maps
            each failing rank to its error. The previous checkpoints are intact.
        ValueError: ``step`` or ``keep_last`` out of range (raised alike on
            every rank before any communication).
    """
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
        raise ValueError(f"save_checkpoint: step must be an int >= 0, got {step!r}")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"save_checkpoint: keep_last must be None or an int >= 1, got "
                         f"{keep_last!r}")
    world = world if world is not None else strategy.mesh.world
    root = Path(directory)
    final = root / step_dir_name(int(step))
    tmp = root / (final.name + ".tmp")

    err = None
    try:
        _check_local(extra_state)
        if world.rank == 0:
            _prepare(root, tmp)
    except Exception as exc:  # noqa: BLE001 -- every failure is agreed, see the Note
        err = exc
    agree(world, err, f"preparing {tmp}")

    record = None
    try:
        record = _write_shard(tmp, world.rank, strategy.pieces(optimizer), int(step))
        record.update(_model_names(strategy.module))
    except Exception as exc:  # noqa: BLE001
        err = exc
    try:
        records = agree(world, err, f"writing {tmp}", record)
    except CheckpointError:
        if world.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    if world.rank == 0:
        try:
            body = _manifest_body(int(step), records, strategy, optimizer, world, extra_state)
            _commit(root, tmp, final, body, keep_last)
        except Exception as exc:  # noqa: BLE001
            err = exc
            shutil.rmtree(tmp, ignore_errors=True)  # gone already if the rename happened
    agree(world, err, f"committing {final}")
    return final


def _check_local(extra_state) -> None:
    if extra_state is not None:
        if not isinstance(extra_state, dict):
            raise TypeError(f"extra_state must be a dict or None, got "
                            f"{type(extra_state).__name__}")
        try:
            json.dumps(extra_state)
        except (TypeError, ValueError) as err:
            raise TypeError(f"extra_state is not JSON-able ({err}); pass dicts, lists, str, "
                            f"numbers and bools (generator_state() turns an RNG into "
                            f"those)") from None
    try:
        import safetensors.numpy  # noqa: F401, PLC0415
    except ImportError:
        raise CheckpointError("", "dependency", "saving needs the safetensors package: pip "
                              "install 'mpishard[checkpoint]'") from None


def _prepare(root: Path, tmp: Path) -> None:
    """Rank 0: remove what killed saves left, create ``tmp`` afresh."""
    root.mkdir(parents=True, exist_ok=True)
    for entry in root.iterdir():
        if _LEFTOVER.fullmatch(entry.name):
            _delete(entry)
        elif (replaced := _REPLACED.fullmatch(entry.name)) \
                and (root / replaced.group(1) / MANIFEST).is_file():
            _remove_tree(entry)  # a replaced step whose replacement was committed
    tmp.mkdir()


def _write_shard(tmp: Path, rank: int, pieces: list, step: int) -> dict:
    """Write this rank's owned pieces; return its file record and piece table."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    tensors, table, counts = {}, [], {}
    for piece in pieces:
        if not piece.owner or piece.size == 0:
            continue
        i = counts.get((piece.name, piece.kind), 0)
        counts[(piece.name, piece.kind)] = i + 1
        key = f"{piece.name}::{piece.kind}::{i}"
        array = np.ascontiguousarray(to_numpy(piece.array)).reshape(-1)
        dtype = str(array.dtype)
        if dtype not in DTYPES:
            raise CheckpointError("", "dtype", f"{piece.name} ({piece.kind}) is {dtype}; a "
                                  f"checkpoint holds {sorted(DTYPES)}")
        if array.size != piece.size:
            raise CheckpointError("", "runs", f"{piece.name} ({piece.kind}): the piece holds "
                                  f"{array.size} elements, its runs {piece.size}")
        tensors[key] = array
        table.append({"name": piece.name, "kind": piece.kind,
                      "shape": [int(n) for n in piece.global_shape], "dtype": dtype,
                      "key": key, "runs": [[int(a), int(b)] for a, b in piece.runs]})
    if not tensors:
        return {"file": None, "pieces": []}
    name = shard_file_name(rank)
    path = tmp / name
    save_file(tensors, path, metadata={"format": FORMAT_NAME, "step": str(step),
                                       "rank": str(rank)})
    os.chmod(path, 0o666 & ~_umask())    # safetensors writes 0600; a project group reads too
    fsync_path(path)
    return {"file": name, "bytes": path.stat().st_size, "sha256": sha256_file(path),
            "pieces": table}


def _umask() -> int:
    """The process's umask (POSIX has no getter: set one and put it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _model_names(module) -> dict:
    """This rank's parameter names in order and its tied aliases (a pipeline stage: its own)."""
    canonical, aliases = {}, {}
    for name, p in module.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), name)
        if canonical[id(p)] != name:
            aliases[name] = canonical[id(p)]
    return {"names": [name for name, _ in module.named_parameters()], "aliases": aliases}


def _manifest_body(step: int, records: list, strategy, optimizer, world, extra_state) -> dict:
    """Rank 0: the manifest body from every rank's piece table (see [Note: manifest])."""
    files, tensors = {}, {}
    for rank, record in enumerate(records):
        if record["file"] is None:
            continue
        files[record["file"]] = {"rank": rank, "bytes": record["bytes"],
                                 "sha256": record["sha256"]}
        for p in record["pieces"]:
            entry = tensors.setdefault((p["name"], p["kind"]), {
                "name": p["name"], "kind": p["kind"], "shape": p["shape"], "dtype": p["dtype"],
                "pieces": []})
            if (entry["shape"], entry["dtype"]) != (p["shape"], p["dtype"]):
                raise CheckpointError(record["file"], "layout", f"{p['name']} ({p['kind']}): "
                                      f"ranks disagree on its shape or dtype")
            entry["pieces"].append({"file": record["file"], "key": p["key"], "runs": p["runs"]})
    state_names = list(getattr(optimizer, "state_names", ())) if optimizer is not None else []
    everyone = dict.fromkeys(name for record in records for name in record["names"])
    names = {name: i for i, name in enumerate(everyone)}
    kinds = {kind: i for i, kind in enumerate(["param", *state_names])}
    order = sorted(tensors, key=lambda nk: (names.get(nk[0], len(names)), nk[0],
                                            kinds.get(nk[1], len(kinds)), nk[1]))
    aliases = {alias: target for record in records for alias, target in record["aliases"].items()
               if (target, "param") in tensors and (alias, "param") not in tensors}
    sizes = strategy.mesh.shape
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
        "mpishard_version": __version__, "step": step, "world_size": world.size,
        "mesh": {axis: int(sizes[axis]) for axis in ("pp", "dp", "tp", "cp", "dp_replicate",
                                                     "dp_shard", "ep") if axis in sizes},
        "strategy": strategy.state_dict(),
        "optimizer": None if optimizer is None else {
            "type": type(optimizer).__name__, "step_count": int(optimizer.step_count),
            "lr": float(optimizer.lr), "state_names": state_names},
        "files": files,
        "tensors": [tensors[nk] for nk in order],
        "aliases": aliases,
        "extra": extra_state if extra_state is not None else {},
    }


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _commit(root: Path, tmp: Path, final: Path, body: dict, keep_last: int | None) -> None:
    """Rank 0: manifest, rename into place, ``latest``, pruning. See [Note: atomic commit]."""
    sealed = seal_manifest(body)
    parse_manifest(sealed, str(tmp / MANIFEST))  # never commit a manifest we could not load
    _write_durably(tmp / MANIFEST, sealed)
    fsync_path(tmp)
    old = final.with_name(final.name + ".old")
    if final.exists():
        if old.exists():
            _remove_tree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_path(root)
    _write_durably(root / (LATEST + ".tmp"), f"{final.name}\n".encode("ascii"))
    os.replace(root / (LATEST + ".tmp"), root / LATEST)
    fsync_path(root)
    if old.exists():
        _remove_tree(old)
    if keep_last is not None:
        _prune(root, keep_last, body["step"])


def _prune(root: Path, keep_last: int, committed: int) -> None:
    """Delete complete checkpoints beyond the ``keep_last`` highest steps (never ``committed``)."""
    steps = complete_steps(root)
    keep = set(sorted(steps)[-keep_last:]) | {committed}
    for step, path in sorted(steps.items()):
        if step not in keep:
            try:
                _remove_tree(path)
            except OSError as err:
                warnings.warn(f"checkpoint {path} was not deleted (keep_last={keep_last}): "
                              f"{err}", stacklevel=3)


def delete_checkpoints(root) -> int:
    """Delete every checkpoint under ``root`` (complete ones, killed saves' leftovers,
    damaged ones set aside, ``latest``); returns how many complete checkpoints there
    were. Not collective: rank 0 calls it (``mpishard train --overwrite true``)."""
    root = Path(root)
    if not root.is_dir():
        return 0
    complete = len(complete_steps(root))
    for entry in sorted(root.iterdir()):
        if re.fullmatch(r"step-\d+(\.old|\.tmp)?(\.damaged(-\d+)?)?", entry.name):
            _remove_tree(entry)
        elif _LEFTOVER.fullmatch(entry.name) or entry.name == LATEST:
            _delete(entry)
    return complete


def _remove_tree(path: Path) -> None:
    """Delete a step directory, renaming it first so it never looks complete half-deleted."""
    doomed = path.with_name(path.name + ".deleting")
    if doomed.exists():
        _delete(doomed)
    os.rename(path, doomed)
    _delete(doomed)


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)

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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpishard import __version__
from mpishard.core.backend import to_numpy
from mpishard.checkpoint.collective import agree
from mpishard.checkpoint.errors import CheckpointError
from mpishard.checkpoint.format import (DTYPES, FORMAT_NAME, FORMAT_VERSION, LATEST, MANIFEST, parse_manifest,
                     seal_manifest, shard_file_name, step_dir_name)
from mpishard.checkpoint.locate import complete_steps
from mpishard.checkpoint.shards import PAGE, SafetensorsWriter, fsync_path

__all__ = ["save_checkpoint", "delete_checkpoints", "Snapshot", "write_snapshot",
           "check_arguments"]

_LEFTOVER = re.compile(r"step-\d+\.tmp|step-\d+(\.old)?\.deleting|latest\.tmp")
_REPLACED = re.compile(r"(step-\d+)\.old")


def save_checkpoint(directory, step: int, strategy, optimizer=None, *, world=None,
                    extra_state: dict | None = None, keep_last: int | None = None) -> Path:
    """Save parameters, optimizer state and ``extra_state`` as ``directory/step-{step}``.

    Collective over ``world``: call it on every rank with the same arguments.
    See [Note: atomic commit]; :class:`~mpishard.checkpoint.BackgroundSaver`
    does the same with the writing on a thread.

    Args:
        directory: the checkpoint root (created if missing).
        step: the number of completed training steps (an int >= 0). Saving a
            step that exists replaces it.
        strategy: the :class:`~mpishard.parallel.Strategy` wrapping the model (or a
            :class:`~mpishard.parallel.ParallelModel`: its strategy).
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
    check_arguments(step, keep_last)
    strategy = strategy_of(strategy, "save_checkpoint")
    world = world if world is not None else strategy.mesh.world
    snapshot, failed = None, None
    try:
        snapshot = Snapshot.take(strategy, optimizer, world, int(step), extra_state)
    except Exception as exc:  # noqa: BLE001 -- agreed in write_snapshot's first step
        failed = exc
    return write_snapshot(directory, int(step), snapshot, world, keep_last=keep_last,
                          failed=failed)


def strategy_of(target, caller: str):
    """The strategy a checkpoint is saved from or loaded into: ``target``, or a
    :class:`~mpishard.parallel.ParallelModel`'s own; TypeError (the same on every rank,
    before any communication) for anything else, naming what to pass."""
    strategy = getattr(target, "strategy", target)
    if not (hasattr(strategy, "pieces") and hasattr(strategy, "mesh")):
        raise TypeError(f"{caller} takes the strategy wrapping the model (DataParallel, "
                        f"ZeRO, or a ParallelModel), got {type(target).__name__}")
    return strategy


def check_arguments(step, keep_last) -> None:
    """ValueError for a ``step`` or ``keep_last`` out of range (the same on every rank)."""
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
        raise ValueError(f"save_checkpoint: step must be an int >= 0, got {step!r}")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"save_checkpoint: keep_last must be None or an int >= 1, got "
                         f"{keep_last!r}")


@dataclass
class Snapshot:
    """What one rank saves at one step, taken from the strategy: its owned pieces'
    arrays (host copies when ``copy``) and everything the manifest needs, so that
    writing it needs neither the strategy nor the optimizer (which train on)."""

    step: int
    arrays: list            # (piece name, kind, global shape, runs, 1-D NumPy array)
    names: dict             # this rank's parameter names and tied aliases
    strategy_state: dict
    optimizer: dict | None
    mesh: dict
    extra_state: dict | None
    data: np.ndarray | None = None   # with staging: every array's bytes, in their order

    @classmethod
    def take(cls, strategy, optimizer, world, step: int, extra_state, *,
             staging: dict | None = None):
        """The snapshot of this rank (local: no communication). Without ``staging``
        the arrays are host views of the pieces (a copy only from a device), to be
        written before training goes on. With ``staging`` (a dict the caller keeps
        from save to save) they are this rank's own copies, which training may
        overwrite the originals of at once: views of one host buffer kept there and
        reused by the next snapshot of the same layout (fresh host memory costs a
        page fault per page, about 50x the copy), laid out as the shard file's data,
        so that it is written with one call.

        The pieces go in order of falling item size (stable), so that each starts
        aligned for its dtype in the file and in the buffer."""
        owned = [p for p in strategy.pieces(optimizer) if p.owner and p.size]
        owned.sort(key=lambda p: -np.dtype(str(p.array.dtype)).itemsize)
        data = None
        if staging is not None:
            views, data = _stage(staging, owned)
        else:
            views = [np.ascontiguousarray(to_numpy(p.array)).reshape(-1) for p in owned]
        sizes = strategy.mesh.shape
        return cls(
            step=step, arrays=[(p.name, p.kind, p.global_shape, p.runs, view)
                               for p, view in zip(owned, views)],
            names=_model_names(strategy.module),
            strategy_state=strategy.state_dict(),
            optimizer=None if optimizer is None else {
                "type": type(optimizer).__name__, "step_count": int(optimizer.step_count),
                "lr": float(optimizer.lr),
                "state_names": list(getattr(optimizer, "state_names", ()))},
            mesh={axis: int(sizes[axis]) for axis in ("pp", "dp", "tp", "cp", "dp_replicate",
                                                       "dp_shard", "ep") if axis in sizes},
            extra_state=extra_state, data=data)

    @property
    def nbytes(self) -> int:
        return sum(a[-1].nbytes for a in self.arrays)


def _stage(staging: dict, pieces: list) -> tuple:
    """Copy ``pieces`` into consecutive views of ``staging["buffer"]`` (made, or made
    again, when the layout changes); ``(views, the buffer's used bytes)``."""
    layout = tuple((np.dtype(str(p.array.dtype)).str, int(p.array.size)) for p in pieces)
    total = sum(np.dtype(d).itemsize * n for d, n in layout)
    if staging.get("layout") != layout:
        staging.clear()
        raw = np.empty(total + PAGE, np.uint8)          # page-aligned: see write_all
        start = -raw.ctypes.data % PAGE
        staging.update(layout=layout, buffer=raw[start:start + total])
    buffer, views, offset = staging["buffer"], [], 0
    for p, (dtype, size) in zip(pieces, layout):
        nbytes = np.dtype(dtype).itemsize * size
        view = buffer[offset:offset + nbytes].view(dtype)
        _copy_to(view, p.array)
        views.append(view)
        offset += nbytes
    return views, buffer[:total]


def _copy_to(out: np.ndarray, array) -> None:
    """``out[...] = array`` (1-D), from host or device memory."""
    if isinstance(array, np.ndarray):
        np.copyto(out, array.reshape(-1))
    elif type(array).__module__.startswith("cupy"):
        array.reshape(-1).get(out=out)            # one device-to-host copy
    else:
        np.copyto(out, to_numpy(array).reshape(-1))


def write_snapshot(directory, step: int, snapshot: Snapshot | None, world, *,
                   keep_last: int | None = None, failed: BaseException | None = None) -> Path:
    """Write ``snapshot`` as ``directory/step-{step}`` and commit it (collective over
    ``world``: every rank with its own snapshot of that step). ``failed``: why this rank
    has no snapshot, agreed with the first step's outcome. See [Note: atomic commit]."""
    root = Path(directory)
    final = root / step_dir_name(step)
    tmp = root / (final.name + ".tmp")

    err = None
    try:
        if failed is not None:
            raise failed
        _check_local(snapshot.extra_state)
        if world.rank == 0:
            _prepare(root, tmp)
    except Exception as exc:  # noqa: BLE001 -- every failure is agreed, see the Note
        err = exc
    try:
        agree(world, err, f"preparing {tmp}")
    except CheckpointError:
        if world.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)   # made here while another rank failed
        raise

    record = None
    try:
        record = _write_shard(tmp, world.rank, snapshot.arrays, snapshot.step, snapshot.data)
        record.update(snapshot.names)
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
            body = _manifest_body(snapshot, records, world)
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


def _write_shard(tmp: Path, rank: int, arrays: list, step: int, data=None) -> dict:
    """Write this rank's pieces (hashing them as they go out), with one write of ``data``
    when it holds all their bytes in order; return its file record and piece table."""
    specs, table, counts = [], [], {}
    for name, kind, global_shape, runs, array in arrays:
        i = counts.get((name, kind), 0)
        counts[(name, kind)] = i + 1
        key = f"{name}::{kind}::{i}"
        dtype = str(array.dtype)
        if dtype not in DTYPES:
            raise CheckpointError("", "dtype", f"{name} ({kind}) is {dtype}; a "
                                  f"checkpoint holds {sorted(DTYPES)}")
        size = sum(b - a for a, b in runs)
        if array.size != size:
            raise CheckpointError("", "runs", f"{name} ({kind}): the piece holds "
                                  f"{array.size} elements, its runs {size}")
        specs.append((key, dtype, (int(array.size),)))
        table.append({"name": name, "kind": kind,
                      "shape": [int(n) for n in global_shape], "dtype": dtype,
                      "key": key, "runs": [[int(a), int(b)] for a, b in runs]})
    if not specs:
        return {"file": None, "pieces": []}
    name = shard_file_name(rank)
    writer = SafetensorsWriter(tmp / name, specs, metadata={
        "format": FORMAT_NAME, "step": str(step), "rank": str(rank)}, hash_sha256=True,
        align=PAGE)
    try:
        if data is not None:
            writer.write_all(data, direct=True)
        else:
            for (key, _, _), (*_, array) in zip(specs, arrays):
                writer.write(key, array)
        path = writer.close()
    except BaseException:
        writer.abort()
        raise
    return {"file": name, "bytes": path.stat().st_size, "sha256": writer.sha256,
            "pieces": table}


def _model_names(module) -> dict:
    """This rank's parameter names in order and its tied aliases (a pipeline stage: its own)."""
    canonical, aliases = {}, {}
    for name, p in module.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), name)
        if canonical[id(p)] != name:
            aliases[name] = canonical[id(p)]
    return {"names": [name for name, _ in module.named_parameters()], "aliases": aliases}


def _manifest_body(snapshot: Snapshot, records: list, world) -> dict:
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
    state_names = snapshot.optimizer["state_names"] if snapshot.optimizer is not None else []
    everyone = dict.fromkeys(name for record in records for name in record["names"])
    names = {name: i for i, name in enumerate(everyone)}
    kinds = {kind: i for i, kind in enumerate(["param", *state_names])}
    order = sorted(tensors, key=lambda nk: (names.get(nk[0], len(names)), nk[0],
                                            kinds.get(nk[1], len(kinds)), nk[1]))
    aliases = {alias: target for record in records for alias, target in record["aliases"].items()
               if (target, "param") in tensors and (alias, "param") not in tensors}
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
        "mpishard_version": __version__, "step": snapshot.step, "world_size": world.size,
        "mesh": snapshot.mesh,
        "strategy": snapshot.strategy_state,
        "optimizer": snapshot.optimizer,
        "files": files,
        "tensors": [tensors[nk] for nk in order],
        "aliases": aliases,
        "extra": snapshot.extra_state if snapshot.extra_state is not None else {},
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

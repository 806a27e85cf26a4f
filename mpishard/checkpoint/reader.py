"""Verifying and loading a checkpoint onto any strategy, mesh and world size.

    extra = load_checkpoint("ckpt", strategy, optimizer)      # the latest complete step
    sampler.load_state_dict(extra["data"])

[Note: loading onto any layout]
The new layout asks, piece by piece (:func:`mpishard.parallel.load_pieces`),
for runs of the global flat index; :class:`ShardReader` intersects each run
with the runs of the saved pieces (sorted, so a binary search finds the first)
and reads exactly those byte ranges into the destination
(see [Note: reading only what is needed]). Neither side needs to know the other's
strategy or world size: a ZeRO-3 checkpoint from 4 ranks loads into ZeRO-2 on 2
ranks, or one unsharded process, or ZeRO-3 on 3, and will load into tensor- and
pipeline-parallel layouts through the same runs.

Loading is collective over ``world`` and agrees after each stage
([Note: checkpoint agreement]): choosing the step (rank 0 decides, everyone
follows), reading and checking the manifest against the model, verifying the
files (each rank hashes a share of them, so together they read the checkpoint
once), and reading the pieces.
"""
from __future__ import annotations

import os
from bisect import bisect_right
from pathlib import Path

import numpy as np

from mpishard.parallel.pieces import load_pieces
from mpishard.checkpoint.collective import agree, exchange_json
from mpishard.checkpoint.errors import CheckpointError
from mpishard.checkpoint.format import MANIFEST, Manifest, numel, read_manifest
from mpishard.checkpoint.locate import resolve_checkpoint
from mpishard.checkpoint.shards import ShardFile, sha256_file
from mpishard.checkpoint.writer import strategy_of

__all__ = ["load_checkpoint", "verify_checkpoint", "verify_file", "ShardReader"]


def verify_checkpoint(path, *, check_hashes: bool = True) -> Manifest:
    """Check a checkpoint completely, in this process; return its manifest.

    Checks the manifest (seal, schema, allowed dtypes, runs in bounds, every
    global tensor covered exactly once) and every rank file (present, the
    recorded size, a sane header that agrees with the manifest, no overlapping
    offsets, the recorded SHA-256).

    Args:
        path: a step directory, or a checkpoint root (its latest step).
        check_hashes: also hash every file (reads the whole checkpoint once).

    Raises:
        CheckpointError: naming the file and the rule that failed.
    """
    step_dir = resolve_checkpoint(path)
    manifest = read_manifest(step_dir)
    for name in manifest.files:
        verify_file(step_dir, manifest, name, check_hashes)
    return manifest


def verify_file(step_dir, manifest: Manifest, name: str, check_hash: bool = True) -> None:
    """Check one rank file against the manifest (see :func:`verify_checkpoint`)."""
    path = Path(step_dir) / name
    with ShardFile(path, manifest.files[name].bytes) as shard:
        check_header(shard, manifest, name)
    if check_hash:
        try:
            digest = sha256_file(path)
        except OSError as err:
            raise CheckpointError(path, "io", f"cannot read: {err}") from None
        if digest != manifest.files[name].sha256:
            raise CheckpointError(path, "sha256", f"the file's SHA-256 is {digest}, the "
                                  f"manifest records {manifest.files[name].sha256}")


def check_header(shard: ShardFile, manifest: Manifest, name: str) -> None:
    """The file's header lists exactly the manifest's pieces for it, with their dtypes and sizes."""
    expected = {p.key: (t, p) for t, p in manifest.pieces_in(name)}
    for key in shard.entries:
        if key not in expected:
            raise CheckpointError(shard.path, "header-schema", f"tensor {key!r} is not in the "
                                  f"manifest")
    for key, (tensor, piece) in expected.items():
        entry = shard.entries.get(key)
        if entry is None:
            raise CheckpointError(shard.path, "header-schema", f"tensor {key!r} of the "
                                  f"manifest is not in the file")
        if entry.dtype != tensor.dtype:
            raise CheckpointError(shard.path, "dtype", f"tensor {key!r} is {entry.dtype}, the "
                                  f"manifest says {tensor.dtype}")
        if entry.shape != (piece.size,):
            raise CheckpointError(shard.path, "shape", f"tensor {key!r} has shape "
                                  f"{list(entry.shape)}, its runs hold {piece.size} elements")


class ShardReader:
    """Reads runs of global tensors from a checkpoint, byte range by byte range.

    See [Note: loading onto any layout]. Files are opened (and their headers
    checked against the manifest) on first use; :meth:`close` closes them.

    Args:
        step_dir: the step directory.
        manifest: its validated manifest.
    """

    def __init__(self, step_dir, manifest: Manifest):
        self.step_dir, self.manifest = Path(step_dir), manifest
        self._segments = {}
        for key, tensor in manifest.tensors.items():
            segments = []
            for piece in tensor.pieces:
                first = 0
                for start, stop in piece.runs:
                    segments.append((start, stop, piece.file, piece.key, first))
                    first += stop - start
            segments.sort()
            self._segments[key] = ([s[0] for s in segments], segments)
        self._files: dict = {}
        self._closed_bytes = 0

    @property
    def bytes_read(self) -> int:
        """Bytes of tensor data read so far (headers not counted)."""
        return self._closed_bytes + sum(f.bytes_read for f in self._files.values())

    def _file(self, name: str) -> ShardFile:
        shard = self._files.get(name)
        if shard is None:
            shard = ShardFile(self.step_dir / name, self.manifest.files[name].bytes)
            try:
                check_header(shard, self.manifest, name)
            except CheckpointError:
                shard.close()
                raise
            self._files[name] = shard
        return shard

    def tensor(self, name: str, kind: str):
        """The manifest entry of ``name`` (a tied alias resolves to its parameter)."""
        name = self.manifest.aliases.get(name, name)
        entry = self.manifest.tensors.get((name, kind))
        if entry is None:
            raise CheckpointError(self.manifest.path, "missing-tensor", f"{name} ({kind}) is "
                                  f"not in the checkpoint")
        return entry

    def read_into(self, name: str, kind: str, runs, out: np.ndarray) -> None:
        """Fill the 1-D array ``out`` (of the saved dtype) with ``runs`` of tensor ``name``."""
        entry = self.tensor(name, kind)
        starts, segments = self._segments[(entry.name, kind)]
        pos = 0
        for start, stop in runs:
            if not 0 <= start < stop <= entry.numel:
                raise CheckpointError(self.manifest.path, "runs", f"{name} ({kind}): run "
                                      f"[{start}, {stop}) is outside its {entry.numel} "
                                      f"elements")
            i = bisect_right(starts, start) - 1
            while start < stop:
                seg_start, seg_stop, file, key, first = segments[i]
                if not seg_start <= start < seg_stop:  # cannot happen after coverage checks
                    raise CheckpointError(self.manifest.path, "coverage", f"{name} ({kind}): "
                                          f"element {start} is in no piece")
                end = min(stop, seg_stop)
                self._file(file).read_into(key, first + start - seg_start,
                                           out[pos:pos + end - start])
                pos, start, i = pos + end - start, end, i + 1

    def read(self, name: str, kind: str, runs, dtype) -> np.ndarray:
        """``runs`` of tensor ``name`` as a new 1-D ``dtype`` array (``load_pieces``'s reader)."""
        entry = self.tensor(name, kind)
        out = np.empty(sum(b - a for a, b in runs), dtype=np.dtype(entry.dtype).newbyteorder("<"))
        self.read_into(name, kind, runs, out)
        return out.astype(dtype, copy=False)

    def close(self) -> None:
        for shard in self._files.values():
            self._closed_bytes += shard.bytes_read
            shard.close()
        self._files.clear()

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_checkpoint(path, strategy, optimizer=None, *, world=None, verify: bool = True,
                    strict: bool = True) -> dict:
    """Load a checkpoint into ``strategy`` (and ``optimizer``), whatever layout saved it.

    Collective over ``world``. Restores parameters, optimizer state (when the
    checkpoint has it: a checkpoint saved without an optimizer leaves the
    optimizer's freshly allocated zeros), ``optimizer.step_count`` and ``lr``,
    and the strategy's step counters. See [Note: loading onto any layout].

    Args:
        path: a step directory, or a checkpoint root (its latest complete step).
        strategy: the :class:`~mpishard.parallel.Strategy` wrapping the model (or a
            :class:`~mpishard.parallel.ParallelModel`: its strategy).
        optimizer: its optimizer, or ``None`` to load parameters only.
        world: every rank taking part (default: ``strategy.mesh.world``).
        verify: hash every file first (each rank a share of them).
        strict: the checkpoint's parameters must be exactly the model's.

    Returns:
        The ``extra_state`` that was saved (``{}`` if none).

    Raises:
        CheckpointError: on every rank, naming the file and rule that failed
            (with ``failures`` per rank), or rule ``mismatch`` when the
            checkpoint does not fit the model.
    """
    strategy = strategy_of(strategy, "load_checkpoint")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"load_checkpoint: path must be a step directory or a checkpoint "
                        f"root (a str or Path), got {path!r}")
    world = world if world is not None else strategy.mesh.world
    err, chosen = None, None
    if world.rank == 0:
        try:
            chosen = str(resolve_checkpoint(path))
        except Exception as exc:  # noqa: BLE001 -- agreed, see [Note: checkpoint agreement]
            err = exc
    step_dir = Path(agree(world, err, f"finding a checkpoint in {path}", chosen)[0])

    # Every rank's parameter names: a pipeline stage holds only its own.
    model_names = set().union(*exchange_json(
        world, [name for name, _ in strategy.module.named_parameters()]))
    manifest, with_state = None, False
    try:
        manifest = read_manifest(step_dir)
        with_state = _check_fits(manifest, strategy, optimizer, strict, model_names)
    except Exception as exc:  # noqa: BLE001
        err = exc
    agree(world, err, f"reading {step_dir / MANIFEST}")

    if verify:
        try:
            for name in sorted(manifest.files)[world.rank::world.size]:
                verify_file(step_dir, manifest, name)
        except Exception as exc:  # noqa: BLE001
            err = exc
        agree(world, err, f"verifying {step_dir}")

    # A failed read is kept, not raised, until every rank has finished
    # load_pieces: it ends in a collective for ZeRO-1/2 (re-gathering parameters).
    failure = None
    reader = ShardReader(step_dir, manifest)

    def read(name, kind, runs, dtype):
        nonlocal failure
        if failure is None:
            try:
                return reader.read(name, kind, runs, dtype)
            except Exception as exc:  # noqa: BLE001
                failure = exc
        return np.zeros(sum(b - a for a, b in runs), dtype=dtype)

    if optimizer is not None:
        optimizer.allocate_state()
    try:
        load_pieces(strategy, optimizer if with_state else None, read)
    finally:
        reader.close()
    agree(world, failure, f"loading {step_dir}")

    if optimizer is not None and manifest.optimizer is not None:
        optimizer.step_count = manifest.optimizer["step_count"]
        optimizer.lr = float(manifest.optimizer["lr"])
    strategy.load_state_dict(manifest.strategy)
    return dict(manifest.extra)


def _check_fits(manifest: Manifest, strategy, optimizer, strict: bool,
                model_names: set) -> bool:
    """Raise ``mismatch`` unless the checkpoint fits the model; say whether to load optimizer state.

    ``model_names``: the parameter names of every rank (pipeline stages differ).
    """
    missing, shapes = [], []
    for name, p in strategy.module.named_parameters():
        entry = manifest.tensors.get((name, "param"))
        if entry is None:
            if numel(p.spec.global_shape):
                missing.append(f"{name} is not in the checkpoint")
        elif entry.shape != tuple(p.spec.global_shape):
            shapes.append(f"{name} has shape {list(entry.shape)} in the checkpoint, "
                          f"{list(p.spec.global_shape)} in the model")
    unexpected = [f"{name} is in the checkpoint but not in the model"
                  for name, kind in manifest.tensors
                  if strict and kind == "param" and name not in model_names]
    problems = missing + unexpected + shapes
    with_state = False
    if optimizer is not None:
        saved = sorted({kind for _, kind in manifest.tensors if kind != "param"})
        wanted = sorted(getattr(optimizer, "state_names", ()))
        if saved and saved != wanted:
            problems.append(f"the checkpoint holds optimizer state {saved}, "
                            f"{type(optimizer).__name__} keeps {wanted}")
        with_state = bool(saved) and saved == wanted
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(manifest.path, "mismatch", "the checkpoint does not fit this "
                              "model: " + "; ".join(problems[:5]) + more)
    return with_state

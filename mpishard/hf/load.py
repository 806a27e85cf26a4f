"""Starting from published weights: a whole model on one process, or any layout's pieces.

    model = from_pretrained("gpt2-folder", dtype="float64")       # one process, whole
    load_pretrained(run.strategy, "llama-folder")                 # collective, streamed

[Note: loading Hugging Face weights onto any layout]
:func:`load_pretrained` asks the strategy for the pieces this rank holds
([Note: pieces] in mpishard/parallel/pieces.py) and fills each from the runs
of the global flat index it covers, read straight out of the safetensors
files (:class:`~mpishard.hf.files.HFWeights`): under ZeRO-3, tensor or
pipeline parallelism no rank reads, or holds, more than its own share, plus
at most one rectangle of a transposed GPT-2 tensor at a time (see
[Note: reading a transposed tensor] in files.py). Everything that can fail
(config.json, a missing file or tensor, a shape) is checked by every rank
before any piece is read, and failures are agreed, so every rank raises the
same :class:`~mpishard.checkpoint.CheckpointError` ([Note: checkpoint agreement]).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from mpishard.checkpoint.collective import agree
from mpishard.checkpoint.consolidate import load_consolidated
from mpishard.checkpoint.errors import CheckpointError
from mpishard.nn.init import seed_dropout
from mpishard.parallel.pieces import load_pieces
from mpishard.hf.config import check_model_matches, config_from_fields, mapping_of, model_fields
from mpishard.hf.files import HFWeights
from mpishard.hf.names import tensor_plan
from mpishard.models import spec_of
from mpishard.models.hf_mapping import CONFIG

__all__ = ["from_pretrained", "load_pretrained", "match_tensors"]


def _fields(path: Path) -> dict:
    try:
        return model_fields(path)
    except ValueError as err:
        raise CheckpointError(path / CONFIG, "config", str(err)) from None


def _find(entries: dict, key: str, prefix: str):
    """``key`` as the files name it: itself, or without the base-model ``prefix``."""
    if key in entries:
        return key
    bare = key[len(prefix):] if key.startswith(prefix) else None
    return bare if bare in entries else None


def match_tensors(weights: HFWeights, config) -> dict:
    """mpishard name -> ``(key in the files, HFTensor)`` for every parameter of the model
    ``config`` builds; every tensor present with its shape, none left over.

    Names are also found without transformers' base-model prefix (the mapping's
    ``base_prefix``: a checkpoint saved from ``GPT2Model``, as OpenAI's ``gpt2`` is).

    Raises:
        CheckpointError: rule ``missing-tensor``, ``shape`` or ``unexpected-tensor``.
    """
    mapping = mapping_of(config)
    prefix = mapping.base_prefix
    found, missing, shapes = {}, [], []
    for t in tensor_plan(config):
        if t.name is None:
            continue
        keys = []
        for want, shape in t.files():
            key = _find(weights.entries, want, prefix)
            if key is None:
                missing.append(want)
                continue
            weights.check_readable(key)
            entry = weights.entries[key]
            if entry.shape != shape:
                shapes.append(f"{key} has shape {list(entry.shape)} in {entry.file}, the model "
                              f"needs {list(shape)}" + (" ([in, out], as GPT-2's Conv1D)"
                                                        if t.transposed else ""))
            keys.append(key)
        found[t.name] = (tuple(keys) if t.parts else (keys[0] if keys else None), t)
    used = {k for key, _ in found.values()
            for k in (key if isinstance(key, tuple) else (key,))}
    unexpected = sorted(k for k in weights.entries if k not in used
                        and not mapping.ignorable(k, config))
    where = weights.folder
    if missing:
        raise CheckpointError(where, "missing-tensor", f"{len(missing)} tensors the model needs "
                              f"are not in the files: {', '.join(missing[:5])}")
    if shapes:
        raise CheckpointError(where, "shape", "; ".join(shapes[:5]))
    if unexpected:
        raise CheckpointError(where, "unexpected-tensor", f"the files hold tensors this "
                              f"{spec_of(config).model_class.__name__} has not: "
                              f"{', '.join(unexpected[:5])}; is config.json "
                              f"the one these weights were saved with?")
    _check_tied_head(weights, found, mapping.tied_head(config))
    return found


def _check_tied_head(weights: HFWeights, found: dict, tied, chunk: int = 1 << 20) -> None:
    """Refuse a stored head that a tied config would drop: one of other values than the
    token table (transformers keeps it, untied). Read in chunks, only when files hold it."""
    if tied is None or tied[0] not in weights.entries:
        return
    head_key, table_key, fix = tied[0], found[tied[1]][0], tied[2]
    head = weights.entries[head_key]
    n = int(np.prod(head.shape))
    same = head.shape == weights.entries[table_key].shape and all(
        np.array_equal(weights.read(head_key, a, min(chunk, n - a)),
                       weights.read(table_key, a, min(chunk, n - a)))
        for a in range(0, n, chunk))
    if not same:
        raise CheckpointError(weights.folder, "tied-head", f"config.json ties the output "
                              f"layer to the token table, but the files hold a {head_key} "
                              f"{list(head.shape)} that differs from {table_key}: {fix}")


def read_tensor(weights: HFWeights, key, t, runs) -> np.ndarray:
    """``runs`` of the flat index of mpishard tensor ``t``, from its file tensor ``key``, or
    from its ``parts`` (``key`` then their keys): each run cut at the parts' bounds."""
    if not t.parts:
        return weights.read_runs(key, runs, t.transposed)
    block = int(np.prod(t.part_shape))
    pieces = []
    for a, b in runs:
        while a < b:
            j, offset = divmod(a, block)
            n = min(b - a, block - offset)
            pieces.append(weights.read(key[j], offset, n))
            a += n
    return np.concatenate(pieces) if pieces else np.empty(0, np.float32)


def from_pretrained(path, dtype: str = "float32", backend=None, seed: int = 0):
    """A whole, materialised model (:class:`~mpishard.models.GPT`, :class:`~mpishard.models.Llama`,
    ...) from the Hugging Face folder ``path``, read tensor by tensor (one process).

    Args:
        path: a folder with ``config.json`` and ``model.safetensors`` (or shards and
            ``model.safetensors.index.json``).
        dtype: the parameters' dtype, ``"float32"`` or ``"float64"`` (weights are cast).
        backend: where the arrays live (default: NumPy).
        seed: seeds the dropout generators (the weights come from the files).

    Raises:
        ValueError: config.json names something mpishard cannot reproduce.
        CheckpointError: a missing file or tensor, a shape that does not fit.
    """
    path = Path(path)
    fields = model_fields(path)
    config = config_from_fields(fields)
    model = spec_of(config).model_class(config, seed=seed, dtype=dtype, backend=backend,
                                        materialize_now=False)
    backend = model.backend
    with HFWeights(path) as weights:
        found = match_tensors(weights, config)
        for name, p in model.named_parameters():
            key, t = found[name]
            full = read_tensor(weights, key, t, [(0, int(np.prod(t.shape)))])
            data = np.ascontiguousarray(full.reshape(t.shape), dtype=p.dtype)
            p.data = backend.ledger.track("params", backend.asarray(data), name)
    seed_dropout(model, seed, backend)
    return model


def load_pretrained(strategy, path, world=None) -> None:
    """Fill every piece ``strategy`` holds from a Hugging Face folder (collective over ``world``).

    Any layout: DDP, ZeRO-1/2/3, tensor and pipeline parallel, mixed precision
    (the masters are filled, then ``after_load`` makes the rest). Each rank reads
    only the byte ranges of its own runs; for GPT-2's transposed ``Conv1D``
    tensors that is one rectangle of its rows at a time (see [Note: reading a
    transposed tensor] in mpishard/hf/files.py), never the whole tensor unless
    the rank holds all of it.

    Args:
        strategy: the :class:`~mpishard.parallel.Strategy` wrapping a GPT or Llama
            (or one stage / tensor-parallel part of one).
        path: a Hugging Face folder; or a ``.safetensors`` file, taken as a
            consolidated mpishard export (:func:`mpishard.checkpoint.load_consolidated`).
        world: every rank taking part (default ``strategy.mesh.world``).

    Raises:
        CheckpointError: on every rank alike: config.json does not describe this
            model, a file or tensor is missing, a shape differs (naming the tensor
            and both shapes), the files hold tensors the model has not.
    """
    world = world if world is not None else strategy.mesh.world
    path = Path(path)
    if path.suffix == ".safetensors" and not path.is_dir():
        load_consolidated(path, strategy, world=world)
        return
    weights, found, err = None, None, None
    try:
        if not path.is_dir():
            raise CheckpointError(path, "missing-file", "is neither a Hugging Face model "
                                  "folder (config.json and safetensors files) nor a "
                                  "consolidated .safetensors file")
        config = strategy.module.config
        try:
            check_model_matches(config, _fields(path), str(path / CONFIG))
        except ValueError as exc:
            raise CheckpointError(path / CONFIG, "mismatch", str(exc)) from None
        weights = HFWeights(path)
        found = match_tensors(weights, config)
    except Exception as exc:  # noqa: BLE001 -- agreed, see [Note: checkpoint agreement]
        err = exc
    failure = None

    def read(name, kind, runs, dtype):
        nonlocal failure
        size = sum(b - a for a, b in runs)
        if failure is None:
            try:
                if name not in found:
                    raise CheckpointError(path, "missing-tensor", f"{name} has no tensor in "
                                          f"the Hugging Face form of this model")
                key, t = found[name]
                return read_tensor(weights, key, t, runs).astype(dtype, copy=False)
            except Exception as exc:  # noqa: BLE001 -- agreed after load_pieces
                failure = exc
        return np.zeros(size, dtype=dtype)

    try:
        agree(world, err, f"reading {path}")
        # A failed read is kept until every rank has finished load_pieces: it ends
        # in a collective for ZeRO-1/2 (re-gathering the parameters).
        load_pieces(strategy, None, read)
    finally:
        if weights is not None:
            weights.close()
    agree(world, failure, f"loading {path}")

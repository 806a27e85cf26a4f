"""Writing a Hugging Face model folder: streamed safetensors shards, the index, config.json.

[Note: writing a model folder]
The tensors and their order are known before any data is, so the shards are
planned up front: tensors in model order, a new file whenever the next tensor
would take the current one past ``max_shard_bytes`` (a tensor larger than the
limit gets a file of its own). One file is ``model.safetensors``; several are
``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json``
(``{"metadata": {"total_size"}, "weight_map": {tensor: file}}``), the names
transformers writes and reads. Each tensor is written as it arrives
(:class:`~mpishard.checkpoint.shards.SafetensorsWriter`), so the writer holds
no more than the tensor it is given.

Everything goes to a temporary folder next to the destination first; only a
complete folder is moved into place (renamed, when the destination does not
exist yet; otherwise file by file, config.json last, after removing the
weight files of an earlier export, so tokenizer files kept there stay). A
failure, or a refusal before the first byte, leaves the destination as it was.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from mpishard import __version__
from mpishard.checkpoint.errors import CheckpointError
from mpishard.checkpoint.format import ITEMSIZE, numel
from mpishard.checkpoint.shards import SafetensorsWriter, fsync_path
from mpishard.models.hf_mapping import CONFIG
from mpishard.hf.files import INDEX, SINGLE

__all__ = ["FolderWriter", "plan_shards"]

_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")


def plan_shards(specs: list, max_shard_bytes: int) -> list:
    """Split ``(key, dtype, shape)`` specs, in order, into files of at most
    ``max_shard_bytes`` (see [Note: writing a model folder])."""
    groups, size = [[]], 0
    for spec in specs:
        nbytes = numel(spec[2]) * ITEMSIZE[spec[1]]
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += nbytes
    return groups


class FolderWriter:
    """Write the tensors ``specs`` (``(key, dtype name, shape)``, in order) into a
    Hugging Face folder at ``out_dir``: :meth:`write` each, then :meth:`finish`
    with the config (or :meth:`abort`)."""

    def __init__(self, out_dir, specs: list, max_shard_bytes: int):
        if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be a positive integer, got "
                             f"{max_shard_bytes!r}")
        self.out = Path(out_dir)
        if self.out.exists() and not self.out.is_dir():
            raise CheckpointError(self.out, "exists", "is a file; a Hugging Face model is a "
                                  "folder: give a folder path")
        groups = plan_shards(specs, max_shard_bytes)
        n = len(groups)
        names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                         for i in range(n)]
        self.files = list(zip(names, groups))
        self.weight_map = {key: name for name, group in self.files for key, _, _ in group}
        self.total_size = sum(numel(s) * ITEMSIZE[d] for _, d, s in specs)
        self.tmp = self.out.parent / f".{self.out.name}.tmp-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self._next, self._writer, self._left = 0, None, 0

    def write(self, key: str, array) -> None:
        """The next tensor's data (``key`` must be the next of ``specs``)."""
        if self._writer is None:
            name, group = self.files[self._next]
            self._next += 1
            self._writer = SafetensorsWriter(self.tmp / name, group,
                                             {"format": "pt", "producer": f"mpishard "
                                                                           f"{__version__}"})
            self._left = len(group)
        self._writer.write(key, array)
        self._left -= 1
        if self._left == 0:
            writer, self._writer = self._writer, None
            writer.close()

    def finish(self, config: dict) -> Path:
        """Write the index (several files) and config.json, then move it all into place."""
        if self._writer is not None or self._next != len(self.files):
            raise ValueError("FolderWriter: not every tensor was written")
        if len(self.files) > 1:
            self._json(INDEX, {"metadata": {"total_size": self.total_size},
                               "weight_map": self.weight_map})
        self._json(CONFIG, config)
        if not self.out.exists():
            os.replace(self.tmp, self.out)
        else:
            ours = {name for name, _ in self.files} | ({INDEX} if len(self.files) > 1 else set())
            for old in self.out.iterdir():
                if _WEIGHT_FILE.fullmatch(old.name) and old.name not in ours:
                    old.unlink()
            for name in sorted(ours) + [CONFIG]:
                os.replace(self.tmp / name, self.out / name)
            self.tmp.rmdir()
        fsync_path(self.out)
        fsync_path(self.out.parent)
        return self.out

    def _json(self, name: str, value: dict) -> None:
        path = self.tmp / name
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(value, indent=2, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def abort(self) -> None:
        """Drop everything written so far; the destination is left as it was."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        shutil.rmtree(self.tmp, ignore_errors=True)

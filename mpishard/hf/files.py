"""The weights of a Hugging Face model folder, read byte range by byte range.

A folder holds ``model.safetensors``, or shards listed by
``model.safetensors.index.json`` (``{"weight_map": {tensor: file}}``). Only
safetensors is read (never a pickled ``pytorch_model.bin``). Every header is
validated before any data is read (its length bounded, each tensor's dtype,
shape and byte range checked against the file's size), as for checkpoint
shards (see [Note: reading only what is needed] in mpishard/checkpoint/shards.py);
unlike those, published weights may be bfloat16, which is widened to float32
exactly (a bfloat16 is the top half of a float32).

[Note: reading a transposed tensor]
GPT-2 stores its linear layers as ``Conv1D`` weights ``[in, out]``; mpishard's
are ``[out, in]``. A rank's runs of the ``[out, in]`` tensor are cut into
rectangles (rows ``r0:r1``, columns ``c0:c1``; consecutive runs with the same
columns merge), and rectangle ``W[r0:r1, c0:c1]`` is ``T[c0:c1, r0:r1]`` of the
file's tensor: ``c1 - c0`` contiguous reads of ``r1 - r0`` elements (one read
when the rows are all of them). So a rank reads only its own elements here
too, one rectangle at a time, and never the whole tensor unless it holds it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpishard.checkpoint.errors import CheckpointError
from mpishard.checkpoint.shards import read_exact_into, read_header_json

__all__ = ["HFWeights", "Entry", "SINGLE", "INDEX", "rectangles"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: safetensors code -> (NumPy dtype as stored, bytes per element)
_DTYPES = {"F16": ("<f2", 2), "BF16": ("<u2", 2), "F32": ("<f4", 4), "F64": ("<f8", 8)}
#: bytes per element of the other safetensors codes: their tensors are checked and
#: listed, and may be buffers the mapping ignores (GPT-2's boolean causal masks), but
#: reading one as a weight is refused
_OTHER_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
                "I32": 4, "U32": 4, "I64": 8, "U64": 8}
_MAX_INDEX_BYTES = 256 << 20


@dataclass(frozen=True)
class Entry:
    """One tensor of the folder: its file, safetensors dtype code, shape, absolute byte range."""

    file: str
    code: str
    shape: tuple
    start: int
    stop: int

    @property
    def dtype(self) -> np.dtype:
        """The dtype reads return (float32 for bfloat16)."""
        return np.dtype(np.float32 if self.code == "BF16" else _DTYPES[self.code][0])


def _refuse_dtype(path, key: str, code) -> None:
    raise CheckpointError(path, "dtype", f"tensor {key!r} has dtype {code!r}; mpishard reads "
                          f"F16, BF16, F32 and F64 weights (not quantised or integer ones)")


def _header(f, path, size: int, name: str) -> dict:
    """``{tensor: Entry}`` from a validated safetensors header."""
    header, n = read_header_json(f, path, size)
    header.pop("__metadata__", None)
    entries = {}
    for key, e in header.items():
        ok = isinstance(e, dict) and isinstance(e.get("shape"), list) and all(
            type(d) is int and d >= 0 for d in e["shape"]) and isinstance(
            e.get("data_offsets"), list) and len(e["data_offsets"]) == 2 and all(
            type(x) is int and x >= 0 for x in e["data_offsets"])
        if not ok:
            raise CheckpointError(path, "header-schema", f"tensor {key!r}: expected dtype, "
                                  f"a shape of integers >= 0 and data_offsets [start, stop]")
        code = e.get("dtype")
        itemsize = _DTYPES[code][1] if code in _DTYPES else _OTHER_SIZES.get(code)
        if itemsize is None:
            _refuse_dtype(path, key, code)
        start, stop = (8 + n + x for x in e["data_offsets"])
        need = int(np.prod(e["shape"], dtype=np.int64)) * itemsize
        if stop - start != need or stop > size:
            raise CheckpointError(path, "offsets", f"tensor {key!r}: bytes {start} to {stop} "
                                  f"of a {size}-byte file, its shape {e['shape']} of {code} "
                                  f"needs {need}")
        entries[key] = Entry(name, code, tuple(e["shape"]), start, stop)
    return entries


def rectangles(runs, width: int) -> list:
    """``[r0, r1, c0, c1]`` rectangles of a ``(rows, width)`` tensor whose row-major
    concatenation is ``runs`` (see [Note: reading a transposed tensor])."""
    rects: list = []
    for a, b in runs:
        while a < b:
            r, c = divmod(a, width)
            if c == 0 and b - a >= width:
                n = (b - a) // width
                rect, a = [r, r + n, 0, width], a + n * width
            else:
                end = min(b, (r + 1) * width)
                rect, a = [r, r + 1, c, end - r * width], end
            last = rects[-1] if rects else None
            if last and last[1] == rect[0] and last[2:] == rect[2:]:
                last[1] = rect[1]       # the next rows, same columns: one rectangle
            else:
                rects.append(rect)
    return rects


class HFWeights:
    """The tensors of a Hugging Face folder, opened for byte-range reads.

    Raises:
        CheckpointError: no safetensors weights, a damaged index or header.
    """

    def __init__(self, folder):
        self.folder = Path(folder)
        index = self.folder / INDEX
        if index.is_file():
            self.weight_map = self._index(index)
            names = sorted(set(self.weight_map.values()))
        elif (self.folder / SINGLE).is_file():
            self.weight_map, names = None, [SINGLE]
        else:
            pickled = sorted(p.name for p in self.folder.glob("*.bin"))
            hint = (f"; it has {', '.join(pickled)}: mpishard never unpickles, save the model "
                    f"with safe_serialization (transformers' default) to get safetensors"
                    if pickled else "")
            raise CheckpointError(self.folder, "missing-file", f"neither {SINGLE} nor {INDEX} "
                                  f"is here{hint}")
        self._files: dict = {}
        self._sizes: dict = {}
        self.entries: dict = {}
        self.bytes_read = 0
        try:
            for name in names:
                for key, entry in _header(self._file(name), self.folder / name,
                                          self._sizes[name], name).items():
                    if key in self.entries:
                        raise CheckpointError(self.folder / name, "duplicate", f"tensor {key!r} "
                                              f"is also in {self.entries[key].file}")
                    self.entries[key] = entry
            for key, name in (self.weight_map or {}).items():
                if self.entries.get(key) is None or self.entries[key].file != name:
                    raise CheckpointError(index, "index", f"the index puts {key!r} in {name}, "
                                          f"which does not hold it")
        except BaseException:
            self.close()
            raise

    def _index(self, index: Path) -> dict:
        try:
            if index.stat().st_size > _MAX_INDEX_BYTES:
                raise ValueError(f"larger than {_MAX_INDEX_BYTES} bytes")
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise ValueError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(index, "index", f"not a safetensors index "
                                  f"({{\"weight_map\": {{tensor: file}}}}): {err}") from None
        for key, name in weight_map.items():
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                raise CheckpointError(index, "index", f"{key!r} maps to {name!r}, not a file "
                                      f"name in this folder")
        return weight_map

    def _file(self, name: str):
        f = self._files.get(name)
        if f is None:
            path = self.folder / name
            try:
                f = open(path, "rb", buffering=0)
            except FileNotFoundError:
                raise CheckpointError(path, "missing-file", "the file does not exist (the "
                                      "index names it)") from None
            except OSError as err:
                raise CheckpointError(path, "io", f"cannot open: {err}") from None
            self._files[name] = f
            self._sizes[name] = os.fstat(f.fileno()).st_size
        return f

    def check_readable(self, key: str) -> None:
        """CheckpointError (rule ``dtype``) unless tensor ``key`` holds floats mpishard reads."""
        e = self.entries[key]
        if e.code not in _DTYPES:
            _refuse_dtype(self.folder / e.file, key, e.code)

    def read(self, key: str, first: int, count: int) -> np.ndarray:
        """Elements ``first .. first + count - 1`` of tensor ``key`` (flat, row-major)."""
        self.check_readable(key)
        e = self.entries[key]
        stored, itemsize = _DTYPES[e.code]
        out = np.empty(count, dtype=stored)
        start = e.start + first * itemsize
        if first < 0 or start + count * itemsize > e.stop:
            raise CheckpointError(self.folder / e.file, "offsets", f"elements {first} to "
                                  f"{first + count} are outside tensor {key!r}")
        read_exact_into(self._file(e.file), memoryview(out).cast("B"), start,
                        self.folder / e.file)
        self.bytes_read += out.nbytes
        if e.code == "BF16":
            return (out.astype(np.uint32) << 16).view(np.float32)
        return out

    def read_runs(self, key: str, runs, transposed: bool = False) -> np.ndarray:
        """``runs`` of tensor ``key``'s flat index, concatenated; with ``transposed``, runs
        of the ``[out, in]`` transpose of a stored ``[in, out]`` tensor (see
        [Note: reading a transposed tensor])."""
        e = self.entries[key]
        if not transposed:
            parts = [self.read(key, a, b - a) for a, b in runs]
            return np.concatenate(parts) if parts else np.empty(0, e.dtype)
        width, rows = e.shape                       # stored T is [in, out]; W = T.T
        out = np.empty(sum(b - a for a, b in runs), dtype=e.dtype)
        pos = 0
        for r0, r1, c0, c1 in rectangles(runs, width):
            if r0 == 0 and r1 == rows:              # whole rows of T: one read
                block = self.read(key, c0 * rows, (c1 - c0) * rows).reshape(c1 - c0, rows)
            else:
                block = np.empty((c1 - c0, r1 - r0), dtype=e.dtype)
                for c in range(c0, c1):
                    block[c - c0] = self.read(key, c * rows + r0, r1 - r0)
            n = block.size
            out[pos:pos + n] = block.T.reshape(-1)
            pos += n
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> "HFWeights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

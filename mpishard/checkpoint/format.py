"""The on-disk format: directory layout, the manifest and its schema.

[Note: checkpoint layout]
A checkpoint directory holds one sub-directory per saved step::

    DIR/
      latest                   "step-N": the step committed last (tmp file + rename)
      step-N/                  complete: renamed into place after everything in it
        rank-R.safetensors     rank R's owned pieces (see [Note: pieces]), one 1-D
                               tensor per piece, keyed "{name}::{kind}::{i}"
        manifest.json          written last, by rank 0
      step-N.tmp/              a save in progress, or one that was killed: never read
      step-N.old/              step-N while a save to the same step replaces it

Only a directory named exactly ``step-N`` (or ``step-N.old`` when no ``step-N``
exists; see :func:`~mpishard.checkpoint.resolve_checkpoint`) counts as a checkpoint, so whatever a
killed save leaves behind is never mistaken for one.

[Note: manifest]
``manifest.json`` is one line, ``{"sha256":"<hex>","manifest":<body>}``: the
SHA-256 is of the body's exact bytes, so a flipped byte anywhere in the file is
caught before the body is parsed. The body records the format version, the
mpishard version, the step, the mesh and strategy, the optimizer's type,
``step_count`` and ``lr``, the byte size and SHA-256 of every rank file, the
caller's JSON extra state (data position, RNG states, ...), tied-parameter
aliases, and for every global tensor -- a parameter (kind ``"param"``) or one
optimizer state of it (``"exp_avg"``, ...) -- its global shape, dtype and
pieces: which file, which key, and which runs of the global row-major flat
index the piece holds (``ShardSpec.global_runs``). Layout is read from these
runs alone, never from names, so any layout loads onto any other.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from mpishard.checkpoint.errors import CheckpointError

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MANIFEST", "LATEST", "DTYPES", "Manifest",
           "TensorEntry", "PieceEntry", "FileEntry", "seal_manifest", "read_manifest",
           "parse_manifest", "shard_file_name", "step_dir_name", "numel", "STEP_RE", "LATEST_RE"]

FORMAT_NAME = "mpishard-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
#: Refuse to read a manifest larger than this (a real one is ~100 bytes per piece).
MAX_MANIFEST_BYTES = 256 << 20

#: The dtypes a checkpoint may hold: NumPy name -> safetensors code.
DTYPES = {"float16": "F16", "float32": "F32", "float64": "F64", "int8": "I8",
          "int16": "I16", "int32": "I32", "int64": "I64", "uint8": "U8"}
ITEMSIZE = {"float16": 2, "float32": 4, "float64": 8, "int8": 1, "int16": 2, "int32": 4,
            "int64": 8, "uint8": 1}

_FILE_RE = re.compile(r"rank-(0|[1-9][0-9]{0,8})\.safetensors")
STEP_RE = re.compile(r"step-(0|[1-9][0-9]{0,17})(\.old)?")
LATEST_RE = re.compile(r"step-(0|[1-9][0-9]{0,17})")
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_SEALED = re.compile(rb'\{"sha256":"([0-9a-f]{64})","manifest":(.*)\}\n', re.DOTALL)
_SEAL_PREFIX = b'{"sha256":"'


def numel(shape) -> int:
    return math.prod(shape)


def shard_file_name(rank: int) -> str:
    return f"rank-{rank}.safetensors"


def step_dir_name(step: int) -> str:
    return f"step-{step}"


# -- the manifest, as validated objects -----------------------------------------
@dataclass(frozen=True)
class PieceEntry:
    """One saved piece: ``key`` in ``file`` holds these runs of the global flat index."""

    file: str
    key: str
    runs: tuple

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.runs)


@dataclass(frozen=True)
class TensorEntry:
    """One global tensor: a parameter (``kind="param"``) or one optimizer state of it."""

    name: str
    kind: str
    shape: tuple
    dtype: str
    pieces: tuple

    @property
    def numel(self) -> int:
        return numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class FileEntry:
    name: str
    rank: int
    bytes: int
    sha256: str


@dataclass
class Manifest:
    """A parsed and validated manifest (see [Note: manifest])."""

    path: str
    step: int
    world_size: int
    mesh: dict
    strategy: dict
    optimizer: dict | None
    files: dict
    tensors: dict
    aliases: dict
    extra: dict
    mpishard_version: str
    body: dict = field(repr=False)

    def pieces_in(self, file: str) -> list:
        """``(TensorEntry, PieceEntry)`` for every piece stored in ``file``."""
        return [(t, p) for t in self.tensors.values() for p in t.pieces if p.file == file]

    def kinds(self) -> list:
        """The tensor kinds present, ``"param"`` first."""
        seen = dict.fromkeys(["param"] if any(k == "param" for _, k in self.tensors) else [])
        seen.update(dict.fromkeys(k for _, k in self.tensors))
        return list(seen)


def seal_manifest(body: dict) -> bytes:
    """The bytes of ``manifest.json`` for ``body`` (see [Note: manifest])."""
    payload = json.dumps(body, separators=(",", ":")).encode("utf-8")
    digest = hashlib.sha256(payload).hexdigest().encode("ascii")
    return _SEAL_PREFIX + digest + b'","manifest":' + payload + b"}\n"


def read_manifest(step_dir) -> Manifest:
    """Read, check the checksum of, parse and validate ``step_dir/manifest.json``.

    Raises:
        CheckpointError: naming the manifest and the rule that failed.
    """
    path = Path(step_dir) / MANIFEST
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointError(path, "missing-file", "there is no manifest; the directory is "
                              "not a complete checkpoint") from None
    except OSError as err:
        raise CheckpointError(path, "io", f"cannot read the manifest: {err}") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointError(path, "manifest-size", f"larger than the {MAX_MANIFEST_BYTES} "
                              f"bytes a manifest may have")
    return parse_manifest(data, str(path))


def parse_manifest(data: bytes, path: str) -> Manifest:
    """Check the seal of manifest bytes, then parse and validate the body."""
    match = _SEALED.fullmatch(data)
    if match is None:
        if data.startswith(_SEAL_PREFIX) and not data.endswith(b"}\n"):
            raise CheckpointError(path, "truncated", f"the manifest ({len(data)} bytes) does "
                                  f"not end with '}}\\n'; the file was cut short")
        raise CheckpointError(path, "manifest-format", 'not a sealed manifest: expected '
                              '{"sha256":"<64 hex digits>","manifest":{...}} and a newline')
    digest, payload = match.group(1).decode("ascii"), match.group(2)
    actual = hashlib.sha256(payload).hexdigest()
    if actual != digest:
        raise CheckpointError(path, "manifest-checksum", f"the body's SHA-256 is {actual}, "
                              f"the manifest records {digest}; the file was modified or "
                              f"damaged")
    try:
        body = json.loads(payload.decode("utf-8"))
    except (ValueError, RecursionError) as err:
        raise CheckpointError(path, "manifest-json", f"the body is not JSON: {err}") from None
    return _Validator(path).manifest(body)


class _Validator:
    """Schema checks of a manifest body; every failure is a CheckpointError."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, rule: str, detail: str):
        raise CheckpointError(self.path, rule, detail)

    def schema(self, where: str, expected: str, value):
        text = repr(value)
        text = text if len(text) <= 60 else text[:57] + "..."
        self.fail("manifest-schema", f"{where}: expected {expected}, got {text}")

    def obj(self, value, where: str) -> dict:
        if not isinstance(value, dict):
            self.schema(where, "an object", value)
        return value

    def array(self, value, where: str) -> list:
        if not isinstance(value, list):
            self.schema(where, "a list", value)
        return value

    def text(self, value, where: str) -> str:
        if not isinstance(value, str) or not value:
            self.schema(where, "a non-empty string", value)
        return value

    def integer(self, value, where: str, lo: int = 0) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < lo:
            self.schema(where, f"an integer >= {lo}", value)
        return value

    def number(self, value, where: str) -> float:
        try:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value)
        except OverflowError:  # an int beyond float's range
            ok = False
        if not ok:
            self.schema(where, "a finite number", value)
        return float(value)

    def manifest(self, body) -> Manifest:
        d = self.obj(body, "manifest")
        if d.get("format") != FORMAT_NAME:
            self.schema("format", repr(FORMAT_NAME), d.get("format"))
        version = d.get("format_version")
        if type(version) is not int or version != FORMAT_VERSION:
            self.fail("format-version", f"format version {version!r}; this "
                      f"mpishard reads version {FORMAT_VERSION}")
        step = self.integer(d.get("step"), "step")
        world_size = self.integer(d.get("world_size"), "world_size", 1)
        mesh = self.obj(d.get("mesh"), "mesh")
        for axis in ("dp", "tp", "pp"):
            self.integer(mesh.get(axis), f"mesh.{axis}", 1)
        for axis in ("cp", "ep", "dp_replicate", "dp_shard"):   # written when the mesh has them
            if axis in mesh:
                self.integer(mesh[axis], f"mesh.{axis}", 1)
        if ("dp_replicate" in mesh) != ("dp_shard" in mesh):  # hybrid sharding: both
            missing = "dp_shard" if "dp_replicate" in mesh else "dp_replicate"
            self.schema(f"mesh.{missing}", "present beside its hybrid twin", None)
        strategy = self.obj(d.get("strategy"), "strategy")
        self.text(strategy.get("name"), "strategy.name")
        for key in ("steps", "skipped_steps"):
            self.integer(strategy.get(key), f"strategy.{key}")
        optimizer = d.get("optimizer")
        if optimizer is not None:
            self.obj(optimizer, "optimizer")
            self.text(optimizer.get("type"), "optimizer.type")
            self.integer(optimizer.get("step_count"), "optimizer.step_count")
            self.number(optimizer.get("lr"), "optimizer.lr")
            for i, name in enumerate(self.array(optimizer.get("state_names"),
                                               "optimizer.state_names")):
                self.text(name, f"optimizer.state_names[{i}]")
        writer = self.text(d.get("mpishard_version"), "mpishard_version")
        files = self.files(d.get("files"), world_size)
        tensors = self.tensors(d.get("tensors"), files)
        aliases = self.aliases(d.get("aliases"), tensors)
        extra = self.obj(d.get("extra"), "extra")
        return Manifest(self.path, step, world_size, mesh, strategy, optimizer, files, tensors,
                        aliases, extra, writer, d)

    def files(self, value, world_size: int) -> dict:
        files = {}
        for name, entry in self.obj(value, "files").items():
            match = _FILE_RE.fullmatch(name)
            if match is None:  # also keeps every path inside the step directory
                self.schema("files", "names like 'rank-3.safetensors'", name)
            entry = self.obj(entry, f"files[{name!r}]")
            rank = self.integer(entry.get("rank"), f"files[{name!r}].rank")
            if rank != int(match.group(1)):
                self.schema(f"files[{name!r}].rank", f"{match.group(1)} (the file's rank)",
                            rank)
            if rank >= world_size:
                self.schema(f"files[{name!r}].rank", f"a rank below world_size {world_size}",
                            rank)
            size = self.integer(entry.get("bytes"), f"files[{name!r}].bytes", 8)
            digest = entry.get("sha256")
            if not isinstance(digest, str) or not _SHA_RE.fullmatch(digest):
                self.schema(f"files[{name!r}].sha256", "64 lower-case hex digits", digest)
            files[name] = FileEntry(name, rank, size, digest)
        return files

    def tensors(self, value, files: dict) -> dict:
        tensors, keys = {}, set()
        for i, t in enumerate(self.array(value, "tensors")):
            t = self.obj(t, f"tensors[{i}]")
            name = self.text(t.get("name"), f"tensors[{i}].name")
            kind = self.text(t.get("kind"), f"tensors[{i}].kind")
            where = f"tensor {name} ({kind})"
            if (name, kind) in tensors:
                self.schema(where, "each (name, kind) once", "a second entry")
            shape = tuple(self.integer(n, f"{where}.shape")
                          for n in self.array(t.get("shape"), f"{where}.shape"))
            dtype = t.get("dtype")
            if not isinstance(dtype, str) or dtype not in DTYPES:
                self.fail("dtype", f"{where}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
            total = numel(shape)
            pieces = [self.piece(p, f"{where}.pieces[{j}]", files, keys, total)
                      for j, p in enumerate(self.array(t.get("pieces"), f"{where}.pieces"))]
            self.coverage(where, total, pieces)
            tensors[(name, kind)] = TensorEntry(name, kind, shape, dtype, tuple(pieces))
        return tensors

    def piece(self, p, where: str, files: dict, keys: set, total: int) -> PieceEntry:
        p = self.obj(p, where)
        file = p.get("file")
        if not isinstance(file, str) or file not in files:
            self.schema(f"{where}.file", "a file listed under 'files'", file)
        key = self.text(p.get("key"), f"{where}.key")
        if (file, key) in keys:
            self.fail("overlap", f"{where}: key {key!r} of {file} is used by two pieces")
        keys.add((file, key))
        runs = []
        for r in self.array(p.get("runs"), f"{where}.runs"):
            # the common, valid case without building messages (manifests have many runs)
            if type(r) is list and len(r) == 2 and type(r[0]) is int and type(r[1]) is int \
                    and 0 <= r[0] < r[1] <= total:
                runs.append((r[0], r[1]))
            else:
                self.bad_run(r, f"{where}.runs", total)
        if not runs:
            self.schema(f"{where}.runs", "at least one run", [])
        return PieceEntry(file, key, tuple(runs))

    def bad_run(self, value, where: str, total: int):
        if not isinstance(value, list) or len(value) != 2 or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in value):
            self.schema(where, "[start, stop] pairs of integers", value)
        self.fail("runs", f"{where}: run [{value[0]}, {value[1]}) is empty or outside the "
                  f"tensor's {total} elements")

    def coverage(self, where: str, total: int, pieces: list) -> None:
        """Every element of the global tensor in exactly one piece."""
        runs = sorted(r for p in pieces for r in p.runs)
        pos = 0
        for start, stop in runs:
            if start < pos:
                self.fail("coverage", f"{where}: elements [{start}, {min(stop, pos)}) are in "
                          f"two pieces")
            if start > pos:
                self.fail("coverage", f"{where}: elements [{pos}, {start}) are in no piece")
            pos = stop
        if pos != total:
            self.fail("coverage", f"{where}: elements [{pos}, {total}) are in no piece")

    def aliases(self, value, tensors: dict) -> dict:
        aliases = {}
        names = {name for name, _ in tensors}
        for alias, target in self.obj(value, "aliases").items():
            if not isinstance(target, str) or (target, "param") not in tensors \
                    or alias in names:
                self.schema(f"aliases[{alias!r}]", "the name of a saved parameter (and an "
                            "alias that is not one)", target)
            aliases[alias] = target
        return aliases

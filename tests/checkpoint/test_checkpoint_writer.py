"""SafetensorsWriter's ways of writing (per tensor, all at once, direct I/O, its
fallbacks) produce files that the safetensors package reads back as written, with
the SHA-256 of their bytes; and a background save's snapshot reuses its buffer."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from mpishard.checkpoint.shards import PAGE, SafetensorsWriter

safetensors_numpy = pytest.importorskip("safetensors.numpy")

SPECS = [("a", "float64", (3, 5)), ("b", "float32", (1000, 7)), ("c", "float16", (3,)),
         ("d", "int64", (0,))]


def _tensors(rng) -> dict:
    return {key: rng.standard_normal(shape).astype(dtype) for key, dtype, shape in SPECS}


def _aligned(nbytes: int, offset: int = 0) -> np.ndarray:
    raw = np.empty(nbytes + 2 * PAGE, np.uint8)
    start = -raw.ctypes.data % PAGE + offset
    return raw[start:start + nbytes]


def _check(path: Path, writer: SafetensorsWriter, tensors: dict) -> None:
    back = safetensors_numpy.load_file(str(path))
    assert sorted(back) == sorted(tensors)
    for key, value in tensors.items():
        assert back[key].dtype == value.dtype and np.array_equal(back[key], value), key
    assert writer.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("how", ["per tensor", "all", "all, direct", "all, direct, unaligned"])
def test_every_way_of_writing_reads_back(tmp_path, how):
    tensors = _tensors(np.random.default_rng(0))
    data = b"".join(t.tobytes() for t in tensors.values())
    path = tmp_path / "x.safetensors"
    writer = SafetensorsWriter(path, SPECS, {"format": "test"}, hash_sha256=True,
                               align=PAGE if "direct" in how else 8)
    if how == "per tensor":
        for key, value in tensors.items():
            writer.write(key, value)
    else:
        buffer = _aligned(len(data), offset=8 if "unaligned" in how else 0)
        buffer[:] = np.frombuffer(data, np.uint8)
        writer.write_all(buffer, direct="direct" in how)
    writer.close()
    _check(path, writer, tensors)
    if "direct" in how:
        size = path.stat().st_size
        assert (size - len(data)) % PAGE == 0       # the data start on a page


@pytest.mark.parametrize("refused", ["open", "pwrite"])
def test_direct_writes_fall_back_where_the_file_system_refuses_them(tmp_path, monkeypatch,
                                                                    refused):
    """A file system that refuses O_DIRECT at open (as some do) or at the first write (an
    alignment it does not accept): the same call writes the same bytes with plain writes."""
    import errno

    from mpishard.checkpoint import shards

    real_open, real_pwrite, calls = os.open, os.pwrite, []

    def fake_open(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            calls.append("open")
            if refused == "open":
                raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def fake_pwrite(fd, data, offset):
        calls.append("pwrite")
        if refused == "pwrite":
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)
    tensors = _tensors(np.random.default_rng(1))
    data = b"".join(t.tobytes() for t in tensors.values())
    buffer = _aligned(len(data))
    buffer[:] = np.frombuffer(data, np.uint8)
    monkeypatch.setattr(shards.os, "open", fake_open)
    monkeypatch.setattr(shards.os, "pwrite", fake_pwrite)
    path = tmp_path / "x.safetensors"
    writer = SafetensorsWriter(path, SPECS, hash_sha256=True, align=PAGE)
    writer.write_all(buffer, direct=True)
    writer.close()
    monkeypatch.undo()
    assert calls[:1] == ["open"] and calls.count(refused) == 1, calls
    _check(path, writer, tensors)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this system")
def test_a_short_direct_write_says_the_disk_is_full(tmp_path, monkeypatch):
    """A full disk cuts a direct write short; it said only "wrote N of M bytes"."""
    from mpishard.checkpoint import shards

    real_open = os.open
    monkeypatch.setattr(shards.os, "open",       # any file system: the flag is dropped
                        lambda path, flags, *a: real_open(path, flags & ~os.O_DIRECT, *a))
    monkeypatch.setattr(shards.os, "pwrite", lambda fd, data, offset: len(data) // 2)
    data = b"".join(t.tobytes() for t in _tensors(np.random.default_rng(1)).values())
    buffer = _aligned(len(data))
    buffer[:] = np.frombuffer(data, np.uint8)
    writer = SafetensorsWriter(tmp_path / "x.safetensors", SPECS, align=PAGE)
    with pytest.raises(OSError, match=r"\[Errno 28\] No space left on device \(wrote "):
        writer.write_all(buffer, direct=True)


def test_write_all_refuses_the_wrong_number_of_bytes(tmp_path):
    writer = SafetensorsWriter(tmp_path / "x.safetensors", SPECS)
    with pytest.raises(ValueError, match="bytes after 0 tensors"):
        writer.write_all(np.zeros(5, np.uint8))
    writer.abort()
    assert not list(tmp_path.iterdir())

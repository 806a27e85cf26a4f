"""Damaged checkpoints: one test per rule, each a CheckpointError naming the file and the rule.

Structural damage (a header claiming 10**15 bytes, overlapping offsets, an
unknown dtype, runs that do not cover a tensor) is tested with the checksums
re-sealed, so the structural rule itself must catch it, not the SHA-256.
"""
import json
import shutil

import numpy as np
import pytest
from mpi4py import MPI

from ckpt_scripts.common import build
from mpishard.checkpoint import CheckpointError, save_checkpoint, verify_checkpoint
from mpishard.checkpoint.format import seal_manifest
from mpishard.checkpoint.shards import ShardFile, sha256_file
from mpishard.comm import Communicator
from parity import make_optimizer

pytestmark = pytest.mark.timeout(60)
SHARD = "rank-0.safetensors"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    comm = Communicator(MPI.COMM_SELF.Dup(), "self", _owned=True)
    strategy = build("zero3", comm, "float32")
    save_checkpoint(root, 1, strategy, make_optimizer(strategy.parameters()))
    return root / "step-1"


@pytest.fixture
def ckpt(pristine, tmp_path):
    path = tmp_path / "step-1"
    shutil.copytree(pristine, path)
    return path


def body_of(step_dir) -> dict:
    return json.loads((step_dir / "manifest.json").read_bytes())["manifest"]


def reseal(step_dir, body: dict) -> None:
    """Write ``body`` as the manifest with a correct seal, and each file's true size and hash."""
    for name, entry in body["files"].items():
        if (step_dir / name).exists():
            entry["bytes"] = (step_dir / name).stat().st_size
            entry["sha256"] = sha256_file(step_dir / name)
    (step_dir / "manifest.json").write_bytes(seal_manifest(body))


def rewrite_header(step_dir, mutate) -> None:
    """Apply ``mutate(header_dict)`` to the shard's header, keep its data, re-seal."""
    path = step_dir / SHARD
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    mutate(header)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    reseal(step_dir, body_of(step_dir))


def check(step_dir, rule: str, file: str):
    with pytest.raises(CheckpointError) as info:
        verify_checkpoint(step_dir)
    err = info.value
    assert (err.rule, err.path) == (rule, str(step_dir / file)), str(err)
    assert str(err).startswith(f"{step_dir / file}: {rule}: "), str(err)
    return err


def test_the_pristine_checkpoint_verifies(ckpt):
    assert verify_checkpoint(ckpt).step == 1


def test_flipped_byte_in_a_shard(ckpt):
    path = ckpt / SHARD
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    check(ckpt, "sha256", SHARD)


def test_flipped_byte_in_the_manifest(ckpt):
    path = ckpt / "manifest.json"
    original = path.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))
    check(ckpt, "manifest-checksum", "manifest.json")
    # and wherever the flip lands, it is caught
    rng = np.random.default_rng(0)
    for pos in sorted({0, len(original) - 1, *rng.integers(0, len(original), 150).tolist()}):
        for bit in (0x01, 0x20, 0x80):
            data = bytearray(original)
            data[pos] ^= bit
            path.write_bytes(bytes(data))
            with pytest.raises(CheckpointError) as info:
                verify_checkpoint(ckpt)
            assert info.value.path == str(path), (pos, bit)


def test_truncated_shard(ckpt):
    path = ckpt / SHARD
    path.write_bytes(path.read_bytes()[:-100])
    err = check(ckpt, "truncated", SHARD)
    assert "the manifest records" in err.detail


def test_truncated_manifest(ckpt):
    path = ckpt / "manifest.json"
    path.write_bytes(path.read_bytes()[:-40])
    check(ckpt, "truncated", "manifest.json")


def test_header_claiming_1e15_bytes(ckpt):
    path = ckpt / SHARD
    data = bytearray(path.read_bytes())
    data[:8] = (10**15).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    err = check(ckpt, "header-size", SHARD)
    assert "claims 1000000000000000 bytes" in err.detail
    with pytest.raises(CheckpointError, match="header-size"):
        ShardFile(path)  # without a manifest too


def test_overlapping_offsets(ckpt):
    def overlap(header):
        entries = sorted((v["data_offsets"], k) for k, v in header.items()
                         if k != "__metadata__")
        (_, first), (_, second) = entries[0], entries[1]
        header[second]["data_offsets"] = [x - 4 for x in header[second]["data_offsets"]]
        assert header[first]["data_offsets"][1] > header[second]["data_offsets"][0]
    rewrite_header(ckpt, overlap)
    err = check(ckpt, "overlap", SHARD)
    assert "overlap" in err.detail


def test_unknown_dtype_in_a_header(ckpt):
    def exotic(header):
        key = next(k for k in header if k != "__metadata__")
        header[key]["dtype"] = "F8_E4M3"
    rewrite_header(ckpt, exotic)
    err = check(ckpt, "dtype", SHARD)
    assert "'F8_E4M3'" in err.detail


def test_unknown_dtype_in_the_manifest(ckpt):
    body = body_of(ckpt)
    body["tensors"][0]["dtype"] = "object"
    reseal(ckpt, body)
    err = check(ckpt, "dtype", "manifest.json")
    assert "'object'" in err.detail


def test_header_dtype_disagreeing_with_the_manifest(ckpt):
    body = body_of(ckpt)
    body["tensors"][0]["dtype"] = "float64"
    reseal(ckpt, body)
    check(ckpt, "dtype", SHARD)


@pytest.mark.parametrize("change, rule", [
    (lambda runs, n: [[0, n // 2], [n // 2 + 1, n]], "coverage"),       # an element in no piece
    (lambda runs, n: [[0, n // 2 + 1], [n // 2, n]], "coverage"),       # one in two pieces
    (lambda runs, n: [[0, n + 1]], "runs"),                             # outside the tensor
    (lambda runs, n: [[3, 3]], "runs"),                                 # empty
])
def test_runs_must_cover_each_tensor_exactly_once(ckpt, change, rule):
    body = body_of(ckpt)
    tensor = body["tensors"][0]
    n = int(np.prod(tensor["shape"]))
    tensor["pieces"][0]["runs"] = change(tensor["pieces"][0]["runs"], n)
    reseal(ckpt, body)
    check(ckpt, rule, "manifest.json")


def test_missing_shard(ckpt):
    (ckpt / SHARD).unlink()
    check(ckpt, "missing-file", SHARD)


def test_file_names_cannot_leave_the_directory(ckpt):
    body = body_of(ckpt)
    body["files"]["../../etc/passwd"] = body["files"].pop(SHARD)
    reseal(ckpt, body)
    err = check(ckpt, "manifest-schema", "manifest.json")
    assert "../../etc/passwd" in err.detail


def test_a_file_of_a_rank_beyond_the_world_size_says_so(ckpt):
    """It read "expected 1 (< world_size 1), got 1", which contradicts itself."""
    body = body_of(ckpt)
    body["files"]["rank-1.safetensors"] = {**body["files"].pop(SHARD), "rank": 1}
    reseal(ckpt, body)
    err = check(ckpt, "manifest-schema", "manifest.json")
    assert "expected a rank below world_size 1, got 1" in err.detail, err.detail


def test_newer_format_version(ckpt):
    body = body_of(ckpt)
    body["format_version"] = 2
    reseal(ckpt, body)
    check(ckpt, "format-version", "manifest.json")


def test_header_and_manifest_must_list_the_same_tensors(ckpt):
    def rename(header):
        key = next(k for k in header if k != "__metadata__")
        header["renamed::param::0"] = header.pop(key)
    rewrite_header(ckpt, rename)
    err = check(ckpt, "header-schema", SHARD)
    assert "'renamed::param::0' is not in the manifest" in err.detail


def test_header_that_is_not_json(ckpt):
    path = ckpt / SHARD
    data = bytearray(path.read_bytes())
    data[8] = ord("[")
    data[9] = ord("[")
    path.write_bytes(bytes(data))
    check(ckpt, "header-json", SHARD)


def test_header_shape_disagreeing_with_the_runs(ckpt):
    body = body_of(ckpt)
    tensor = body["tensors"][0]
    n = int(np.prod(tensor["shape"]))
    tensor["shape"] = [n + 5]
    tensor["pieces"][0]["runs"].append([n, n + 5])
    reseal(ckpt, body)
    check(ckpt, "shape", SHARD)

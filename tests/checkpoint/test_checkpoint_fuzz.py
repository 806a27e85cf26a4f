"""Property: however a valid checkpoint is damaged, reading it raises CheckpointError or works.

Hypothesis mutates a 2-rank ZeRO-3 checkpoint -- flipped, overwritten, cut or
appended bytes in any file, a forged header length, JSON values replaced or
deleted anywhere in a shard header or the manifest body (re-sealed with correct
checksums, so the structural checks are what stands in the way) -- and runs the
whole read path: verification, reading every tensor, ``inspect``. Anything but
a CheckpointError (a MemoryError, KeyError, TypeError, ...) fails the test.
"""
import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_scripts.common import run_mpi
from mpishard.checkpoint import CheckpointError, ShardReader, inspect_checkpoint, verify_checkpoint
from mpishard.checkpoint.format import seal_manifest
from mpishard.checkpoint.shards import sha256_file

FILES = ["manifest.json", "rank-0.safetensors", "rank-1.safetensors"]
SHARDS = FILES[1:]
EXAMPLES = 2000


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    proc = run_mpi("make_checkpoint.py", root / "saved", np_=2, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shutil.copytree(root / "saved" / "step-1", root / "step-1")
    step_dir = root / "step-1"
    assert sorted(p.name for p in step_dir.iterdir()) == sorted(FILES)
    verify_checkpoint(step_dir)
    return Pristine(step_dir, {name: (step_dir / name).read_bytes() for name in FILES})


class Pristine:
    """The work directory and the original bytes of its files (with a short repr for reports)."""

    def __init__(self, step_dir, files):
        self.step_dir, self.files = step_dir, files

    def __repr__(self):
        return f"Pristine({self.step_dir})"


json_values = st.recursive(
    st.none() | st.booleans() | st.floats() | st.text(max_size=6)
    | st.integers(-2**66, 2**66)
    | st.sampled_from([0, 1, -1, 7, 10**15, 2**63, 10**400, 1e308, "F32", "float32"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=6)


def mutate_json(data, node):
    """Replace, delete or extend one node of the JSON tree ``node`` (chosen by drawing a path)."""
    parent, key = None, None
    while isinstance(node, (dict, list)) and node and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(node)) if isinstance(node, dict)
                        else st.integers(0, len(node) - 1))
        parent, node = node, node[key]
    if parent is None:
        return data.draw(json_values)
    action = data.draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "replace":
        parent[key] = data.draw(json_values)
    elif action == "delete":
        del parent[key]
    elif isinstance(parent, dict):
        parent[data.draw(st.text(max_size=5))] = data.draw(json_values)
    else:
        parent.append(data.draw(json_values))
    return None


def put(path, data: bytes) -> None:
    """Overwrite a file in place: truncating on open frees blocks, which is slow on some disks."""
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate(len(data))


def reseal(step_dir, body):
    for name, entry in body.get("files", {}).items() if isinstance(body, dict) and isinstance(
            body.get("files"), dict) else []:
        if isinstance(entry, dict) and name in SHARDS:
            entry["bytes"] = (step_dir / name).stat().st_size
            entry["sha256"] = sha256_file(step_dir / name)
    put(step_dir / "manifest.json", seal_manifest(body))


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), kind=st.sampled_from(["flip", "overwrite", "truncate", "append",
                                             "length", "header", "manifest"]),
       file=st.sampled_from(FILES))
def test_damage_is_always_a_checkpoint_error(work, data, kind, file):
    step_dir, pristine = work.step_dir, work.files
    if kind in ("length", "header"):
        file = data.draw(st.sampled_from(SHARDS))
    raw = bytearray(pristine[file])
    touched = {file, "manifest.json"} if kind in ("header", "manifest") else {file}
    try:
        if kind == "flip":
            pos = data.draw(st.integers(0, len(raw) - 1))
            raw[pos] ^= data.draw(st.integers(1, 255))
        elif kind == "overwrite":
            pos = data.draw(st.integers(0, len(raw) - 1))
            patch = data.draw(st.binary(min_size=1, max_size=12))
            raw[pos:pos + len(patch)] = patch
        elif kind == "truncate":
            del raw[data.draw(st.integers(0, len(raw) - 1)):]
        elif kind == "append":
            raw += data.draw(st.binary(min_size=1, max_size=16))
        elif kind == "length":
            raw[:8] = data.draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little")
        if kind == "header":
            n = int.from_bytes(raw[:8], "little")
            header = json.loads(raw[8:8 + n])
            header = mutate_json(data, header) or header
            text = json.dumps(header).encode()
            put(step_dir / file, len(text).to_bytes(8, "little") + text + raw[8 + n:])
            reseal(step_dir, json.loads(pristine["manifest.json"])["manifest"])
        elif kind == "manifest":
            body = json.loads(pristine["manifest.json"])["manifest"]
            body = mutate_json(data, body) or body
            reseal(step_dir, body)
        else:
            put(step_dir / file, bytes(raw))
        try:
            manifest = verify_checkpoint(step_dir)
            with ShardReader(step_dir, manifest) as reader:
                for (name, kind_), tensor in manifest.tensors.items():
                    runs = [(0, tensor.numel)] if tensor.numel else []
                    assert reader.read(name, kind_, runs, tensor.dtype).size == tensor.numel
            assert inspect_checkpoint(step_dir).ok
        except CheckpointError as err:
            assert err.rule and str(err)
    finally:
        for name in touched:
            put(step_dir / name, pristine[name])

"""Checkpoints written in the background (``--checkpoint-async``): the same losses and
the same bytes as synchronous saves, and a rank killed in each phase of a background
save (copy, write, commit) leaves the checkpoint before it the newest valid one:
``mpishard checkpoint inspect`` names it and ``--resume`` continues from it bit-exactly.
Failures are injected from tests/ckpt_scripts/inject (see its sitecustomize.py)."""
from __future__ import annotations

import json

import pytest

from ckpt_scripts.common import INJECT, ROOT
from test_cli import FAST, mpishard

N = 3                                     # odd: ZeRO-3 shards that do not divide evenly
ARGS = [*FAST, "--dtype", "float64", "--strategy", "zero3", "--steps", "12",
        "--eval-interval", "0", "--checkpoint-interval", "3", "--keep-last", "2"]


def _records(path) -> list:
    return [json.loads(line) for line in open(path)]


def _losses(path) -> list:
    return [(r["step"], r["loss"]) for r in _records(path) if "loss" in r]


def _train(folder, *extra, env=None):
    return mpishard("train", *ARGS, "--checkpoint-dir", folder / "ck", "--metrics",
                    folder / "m.jsonl", *extra, n=N, env=env, timeout=150)


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory):
    """The same run with synchronous checkpoints: its folder."""
    folder = tmp_path_factory.mktemp("synchronous")
    done = _train(folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


def test_background_checkpoints_hold_the_same_bytes_and_losses(tmp_path, synchronous):
    done = _train(tmp_path, "--checkpoint-async", "true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _losses(tmp_path / "m.jsonl") == _losses(synchronous / "m.jsonl")
    assert done.stdout.count("written in the background") == 4, done.stdout
    kept = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert kept == ["latest", "step-12", "step-9"], kept
    for step in ("step-9", "step-12"):
        for mine in sorted((tmp_path / "ck" / step).iterdir()):
            theirs = synchronous / "ck" / step / mine.name
            if mine.name == "manifest.json":   # records the configuration, which differs
                continue
            assert mine.read_bytes() == theirs.read_bytes(), mine


def test_asynchronous_checkpoints_need_a_checkpoint_dir():
    done = mpishard("train", *ARGS, "--checkpoint-async", "true", n=None)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "mpishard: error: checkpoint_async = true needs checkpoint_dir: where the checkpoints "
        "go (--checkpoint-dir DIR)"], done.stderr


@pytest.mark.parametrize("phase, rank", [("copy", 1), ("write", 2), ("commit", 0)])
def test_a_kill_in_each_phase_of_a_background_save_leaves_the_one_before(
        tmp_path, synchronous, phase, rank):
    """Rank ``rank`` is SIGKILLed in ``phase`` of step 6's background save: step 3 stays
    the newest valid checkpoint, inspect names it, and --resume from it ends with every
    loss bit-equal to the uninterrupted run's, each step logged once."""
    env = {"PYTHONPATH": f"{INJECT}:{ROOT}", "MPISHARD_TEST_KILL_IN_SAVE": f"{rank}:6:{phase}"}
    killed = _train(tmp_path, "--checkpoint-async", "true", env=env)
    assert killed.returncode != 0, killed.stdout[-2000:]
    assert f"test: rank {rank} killed" in killed.stderr, killed.stderr[-3000:]

    inspect = mpishard("checkpoint", "inspect", tmp_path / "ck")
    assert inspect.returncode == 0, inspect.stdout + inspect.stderr
    assert inspect.stdout.splitlines()[0] == f"checkpoint  {tmp_path / 'ck' / 'step-3'} (step 3)"
    assert "integrity   ok" in inspect.stdout
    if phase != "copy":            # the copy is killed before step-6.tmp is made
        assert "unfinished  step-6.tmp" in inspect.stdout, inspect.stdout

    resumed = _train(tmp_path, "--checkpoint-async", "true", "--resume", "true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 3" in resumed.stdout, resumed.stdout
    assert _losses(tmp_path / "m.jsonl") == _losses(synchronous / "m.jsonl")
    assert not (tmp_path / "ck" / "step-6.tmp").exists()

"""Exact resume: a run SIGKILLed mid-way, or stopped by SIGUSR1, and resumed, equals the
uninterrupted run bit for bit (losses and parameters), at the same world size, on CPU.

Each test launches tests/ckpt_scripts/train_loop.py under ``mpiexec -n 2`` with a
timeout (a hang is a failure, never a stuck job).
"""
import numpy as np
import pytest

from ckpt_scripts.common import MPIEXEC, reap_shared_memory, run_mpi
from mpishard.checkpoint import latest_checkpoint, verify_checkpoint

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec next to python")]
STEPS, INTERVAL = 10, 3


def losses(path) -> dict:
    """``{step: loss as float.hex()}`` from a train_loop.py log."""
    return {int(s): v for s, v in (line.split() for line in path.read_text().splitlines())}


def params(path) -> dict:
    with np.load(path) as f:  # allow_pickle is False by default: plain arrays only
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("uninterrupted")
    proc = run_mpi("train_loop.py", "--ckpt", d / "ckpt", "--log", d / "losses.txt",
                   "--steps", STEPS, "--interval", INTERVAL, "--params", d / "params.npz")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    full = losses(d / "losses.txt")
    assert sorted(full) == list(range(1, STEPS + 1))
    return full, params(d / "params.npz")


def assert_resumed_equals(uninterrupted, before: dict, after: dict, params_path, resumed_at):
    full, full_params = uninterrupted
    assert sorted(after) == list(range(resumed_at + 1, STEPS + 1))
    for step, value in {**before, **after}.items():
        assert value == full[step], f"step {step}: {value} != {full[step]}"
    resumed_params = params(params_path)
    assert resumed_params.keys() == full_params.keys()
    for name, value in full_params.items():
        assert np.array_equal(resumed_params[name], value), name


def test_sigkill_then_resume_is_bit_identical(uninterrupted, tmp_path):
    ckpt = tmp_path / "ckpt"
    with reap_shared_memory():
        killed = run_mpi("train_loop.py", "--ckpt", ckpt, "--log", tmp_path / "killed.txt",
                         "--steps", STEPS, "--interval", INTERVAL, "--kill-after", 7)
    assert killed.returncode != 0, killed.stdout + killed.stderr
    assert latest_checkpoint(ckpt) == ckpt / "step-6"   # steps 7 (and 8...) are lost
    assert verify_checkpoint(ckpt).step == 6
    resumed = run_mpi("train_loop.py", "--ckpt", ckpt, "--log", tmp_path / "resumed.txt",
                      "--steps", STEPS, "--interval", INTERVAL, "--resume",
                      "--params", tmp_path / "params.npz")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "rank 0: resumed at step 6" in resumed.stdout
    before = losses(tmp_path / "killed.txt")
    assert 6 <= max(before) <= 7   # the killed run got past its last checkpoint
    assert_resumed_equals(uninterrupted, before, losses(tmp_path / "resumed.txt"),
                          tmp_path / "params.npz", 6)


def test_sigusr1_on_one_rank_saves_and_exits_zero(uninterrupted, tmp_path):
    ckpt = tmp_path / "ckpt"
    stopped = run_mpi("train_loop.py", "--ckpt", ckpt, "--log", tmp_path / "stopped.txt",
                      "--steps", STEPS, "--interval", 100, "--signal-after", 4)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "rank 1: stopped by SIGUSR1 after step 4" in stopped.stdout
    assert "rank 0: stopped by a peer after step 4" in stopped.stdout
    assert latest_checkpoint(ckpt) == ckpt / "step-4"
    resumed = run_mpi("train_loop.py", "--ckpt", ckpt, "--log", tmp_path / "resumed.txt",
                      "--steps", STEPS, "--interval", 100, "--resume",
                      "--params", tmp_path / "params.npz")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_resumed_equals(uninterrupted, losses(tmp_path / "stopped.txt"),
                          losses(tmp_path / "resumed.txt"), tmp_path / "params.npz", 4)

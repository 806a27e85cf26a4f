"""mpishard train with checkpoints: exact resume, stop on SIGUSR1, sample from a checkpoint."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi4py import MPI

from ckpt_scripts.common import MPIEXEC, clean_env, ranks_stderr
from test_cli import FAST, ROOT, mpishard


def _losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, Path(path).read_text().splitlines())
            if "loss" in r}


@pytest.mark.parametrize("extra", [[], ["--precision", "float16",
                                         "--activation-checkpointing", "true"]])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, extra):
    run = tmp_path / "a"
    args = [*FAST, "--steps", "6", "--checkpoint-interval", "3", "--dropout", "0.1", *extra]
    out = mpishard("train", *args, "--checkpoint-dir", str(run), "--metrics",
                   str(run / "m.jsonl"), n=2)
    assert out.returncode == 0, out.stderr
    resumed = tmp_path / "b"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "step-6")               # as if killed after step 3's save
    out = mpishard("train", *args, "--checkpoint-dir", str(resumed), "--resume", "true",
                   "--metrics", str(resumed / "m2.jsonl"), n=2)
    assert out.returncode == 0, out.stderr
    assert "resumed from step 3" in out.stdout
    first, second = _losses(run / "m.jsonl"), _losses(resumed / "m2.jsonl")
    assert sorted(second) == [4, 5, 6]
    assert all(first[k] == second[k] for k in second)   # bit-identical


def test_sigusr1_checkpoints_and_exits_zero(tmp_path):
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "mpishard", "train", *FAST, "--steps", "500",
                             "--checkpoint-dir", str(ckpt), "--metrics", str(metrics)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT)
    deadline = time.time() + 60
    while time.time() < deadline and not (metrics.exists() and len(_losses(metrics)) >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "checkpoint saved, stopping" in out
    steps = sorted(_losses(metrics))
    assert 2 <= steps[-1] < 500
    assert (ckpt / f"step-{steps[-1]}").is_dir()
    sample = mpishard("sample", "--checkpoint", str(ckpt), "--prompt", "def ", "--tokens", "20")
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.startswith("def ") and len(sample.stdout.encode()) >= 20


def test_ctrl_c_saves_at_a_step_boundary_exits_130_and_resumes_bit_exact(tmp_path):
    """Ctrl-C at a terminal signals mpiexec and every rank (one process group): the run
    finishes its step, saves, says so in one line and exits 130, as a shell reports."""
    args = [*FAST, "--steps", "120"]
    whole = mpishard("train", *args, "--metrics", tmp_path / "whole.jsonl", n=4)
    assert whole.returncode == 0, whole.stderr
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = subprocess.Popen([str(MPIEXEC), "-n", "4", sys.executable, "-m", "mpi4py", "-m",
                             "mpishard", "train", *args, "--checkpoint-dir", str(ckpt),
                             "--metrics", str(metrics)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(), cwd=ROOT, start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline and not (metrics.exists() and len(_losses(metrics)) >= 2):
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)               # what the terminal's Ctrl-C does
    out, err = proc.communicate(timeout=60)
    step = max(_losses(metrics))
    assert 2 <= step < 120 and "Traceback" not in err, out + err
    if MPI.get_vendor()[0] == "Open MPI":    # its mpiexec ends the job on Ctrl-C: status 1,
        assert proc.returncode == 1, out + err   # the ranks' last lines unread; they saved
    else:
        assert proc.returncode == 130 and ranks_stderr(err) == "", out + err
        assert f"step {step}: Ctrl-C; checkpoint saved, stopping" in out
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", f"step-{step}"]
    resumed = mpishard("train", *args, "--checkpoint-dir", ckpt, "--resume", "true",
                       "--metrics", tmp_path / "rest.jsonl", n=4)
    assert resumed.returncode == 0, resumed.stderr
    first, rest = _losses(tmp_path / "whole.jsonl"), _losses(tmp_path / "rest.jsonl")
    assert sorted(rest) == list(range(step + 1, 121))
    assert all(first[k] == rest[k] for k in rest)      # bit-identical
    assert all(first[k] == v for k, v in _losses(metrics).items())


def test_resume_without_checkpoint_and_bad_path_are_one_line(tmp_path):
    out = mpishard("train", *FAST, "--steps", "1", "--checkpoint-dir", str(tmp_path / "none"),
                   "--resume", "true")
    assert out.returncode == 2 and "found no complete checkpoint" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "none").exists()
    out = mpishard("sample", "--checkpoint", str(tmp_path / "missing"))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1


def _records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _truncate_a_shard(step_dir):
    shard = sorted(Path(step_dir).glob("rank-*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) - 40])


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_one_before_resumes(tmp_path):
    """A truncated shard in the newest checkpoint: --resume continues bit-exactly from
    the one before, in one line naming the one it skipped; retention then keeps
    keep_last valid checkpoints and never counts or deletes the damaged one."""
    args = [*FAST, "--steps", "9", "--checkpoint-interval", "3", "--dropout", "0.1"]
    whole = tmp_path / "whole"
    out = mpishard("train", *args, "--checkpoint-dir", whole, "--keep-last", "3",
                   "--metrics", whole / "m.jsonl", n=4)
    assert out.returncode == 0, out.stderr
    ckpt = tmp_path / "ck"
    shutil.copytree(whole, ckpt)
    shutil.rmtree(ckpt / "step-9")                      # as if killed after step 6's save
    (ckpt / "latest").write_text("step-6\n")
    _truncate_a_shard(ckpt / "step-6")
    m = ckpt / "m.jsonl"
    m.write_text("".join(line + "\n" for line in m.read_text().splitlines()
                         if json.loads(line)["step"] <= 7) + '{"step": 8, "lo')   # killed
    out = mpishard("train", *args, "--checkpoint-dir", ckpt, "--keep-last", "2", "--resume",
                   "true", "--metrics", m, n=4)
    assert out.returncode == 0, out.stderr
    skipped = [line for line in out.stdout.splitlines() if line.startswith("skipped")]
    assert len(skipped) == 1 and f"skipped the damaged checkpoint {ckpt / 'step-6'}, set " \
        "aside as step-6.damaged:" in skipped[0] and "truncated" in skipped[0], out.stdout
    assert f"resumed from step 3 ({ckpt / 'step-3'})" in out.stdout
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == \
        ["step-6", "step-6.damaged", "step-9"]
    first, again = _records(whole / "m.jsonl"), _records(m)
    trained = [r["step"] for r in again if "loss" in r]
    assert trained == list(range(1, 10))                # each step once, in order
    assert [r["loss"] for r in again if "loss" in r] == [r["loss"] for r in first
                                                           if "loss" in r]   # bit-identical
    out = mpishard("train", *args, "--checkpoint-dir", ckpt, "--overwrite", "true", n=2)
    assert out.returncode == 0 and not (ckpt / "step-6.damaged").exists(), out.stderr


def test_resume_from_picks_a_checkpoint_and_refuses_one_that_is_not_there(tmp_path):
    args = [*FAST, "--steps", "6", "--checkpoint-interval", "2", "--keep-last", "3"]
    ckpt = tmp_path / "ck"
    out = mpishard("train", *args, "--checkpoint-dir", ckpt, "--metrics", tmp_path / "m.jsonl",
                   n=2)
    assert out.returncode == 0, out.stderr
    out = mpishard("train", *args, "--checkpoint-dir", ckpt, "--resume-from", "step-2",
                   "--metrics", tmp_path / "m.jsonl", n=2)
    assert out.returncode == 0 and "resumed from step 2" in out.stdout, out.stderr
    again = _records(tmp_path / "m.jsonl")
    assert [r["step"] for r in again if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in again if "val_loss" in r and "loss" not in r] == [0, 2, 6]
    for value, found in (("step-5", f"is neither a complete step-N in {ckpt}"),
                         (str(tmp_path), "nor a step directory with a manifest.json")):
        out = mpishard("train", *args, "--checkpoint-dir", ckpt, "--resume-from", value, n=2)
        assert out.returncode == 2 and found in out.stderr, out.stderr
        assert len(ranks_stderr(out.stderr).splitlines()) == 1, out.stderr
    out = mpishard("train", *args, "--resume-from", "step-2")
    assert out.returncode == 2 and "needs checkpoint_dir" in out.stderr, out.stderr

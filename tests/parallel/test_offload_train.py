"""``mpishard train --offload optimizer`` and ``--offload params``: the same losses as
without, the host memory in the metrics, a resume across offload on and off, and an
offload the strategy cannot do refused in one line."""
import json
import shutil
from pathlib import Path

from ckpt_scripts.common import run_mpishard as mpishard

FAST = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16",
        "--batch-size", "2", "--max-bytes", "20000", "--eval-batches", "1", "--progress",
        "false", "--eval-interval", "0"]


def _records(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _losses(path: Path) -> dict:
    return {r["step"]: r["loss"] for r in _records(path) if "loss" in r}


def test_train_with_offload_gives_the_same_losses_and_reports_host_memory(tmp_path):
    """2 ranks, ZeRO-3 in bfloat16, 4 steps: bit-identical losses; the device's peak
    optimizer bytes are 0 with offload, the host's are what the device held without;
    with the parameters offloaded too, the device's peak parameter bytes are 0."""
    args = [*FAST, "--steps", "4", "--strategy", "zero3", "--precision", "bfloat16"]
    runs = {}
    for offload in ("none", "optimizer", "params"):
        metrics = tmp_path / f"{offload}.jsonl"
        out = mpishard("train", *args, "--offload", offload, "--metrics", metrics, n=2)
        assert out.returncode == 0, out.stderr
        runs[offload] = (_records(metrics), out.stdout + out.stderr)
    (plain, _), (offloaded, log) = runs["none"], runs["optimizer"]
    assert "offload: float32 masters and optimizer state in host memory" in log
    losses = [r["loss"] for r in plain if "loss" in r]
    assert len(losses) == 4 and losses == [r["loss"] for r in offloaded if "loss" in r]
    last_plain = [r for r in plain if "memory" in r][-1]
    last = [r for r in offloaded if "memory" in r][-1]
    assert "host_memory" not in last_plain and len(last["host_memory"]) == 2
    for device, host, before in zip(last["memory"], last["host_memory"], last_plain["memory"]):
        assert device["optim"] == 0 and host["optim"] == before["optim"] > 0
        assert host["params"] == before["params"] - device["params"] > 0   # float32 masters
    params, log = runs["params"]
    assert "parameter shards too, copied in for each gather" in log
    assert losses == [r["loss"] for r in params if "loss" in r]
    last = [r for r in params if "memory" in r][-1]
    for device, host, before in zip(last["memory"], last["host_memory"], last_plain["memory"]):
        assert device["params"] == 0 and device["optim"] == 0
        assert host["params"] == before["params"] > 0     # masters and the 16-bit shards


def test_a_run_with_offload_resumes_without_it_bit_exact(tmp_path):
    """4 steps with offload, a checkpoint every 2; resumed from step 2 without offload,
    steps 3 and 4 give the first run's losses bit for bit."""
    args = [*FAST, "--steps", "4", "--checkpoint-interval", "2", "--strategy", "zero1"]
    run = tmp_path / "run"
    out = mpishard("train", *args, "--offload", "optimizer", "--checkpoint-dir", run,
                   "--metrics", run / "m.jsonl", n=2)
    assert out.returncode == 0, out.stderr
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "step-4")               # as if killed after step 2's save
    out = mpishard("train", *args, "--checkpoint-dir", resumed, "--resume", "true",
                   "--metrics", resumed / "m2.jsonl", n=2)
    assert out.returncode == 0, out.stderr
    assert "resumed from step 2" in out.stdout + out.stderr
    want, got = _losses(run / "m.jsonl"), _losses(resumed / "m2.jsonl")
    assert sorted(got) == [3, 4] and all(got[k] == want[k] for k in got)


def test_an_offload_it_cannot_do_is_one_line():
    out = mpishard("train", *FAST, "--steps", "1", "--offload", "params", "--strategy", "zero1")
    assert out.returncode != 0
    assert "offload = params: strategy = zero1 cannot offload its parameters (only ZeRO-3 " \
        "keeps them as shards between uses); use --strategy zero3, or --offload optimizer" \
        in out.stderr
    assert "Traceback" not in out.stderr
    out = mpishard("train", *FAST, "--steps", "1", "--offload", "disk")
    assert out.returncode != 0
    assert "offload = 'disk' is not one of none, optimizer, params" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_offload_line_names_the_masters_dtype():
    out = mpishard("train", *FAST, "--steps", "1", "--offload", "optimizer", "--dtype",
                   "float64", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "offload: float64 masters and optimizer state in host memory" in out.stdout

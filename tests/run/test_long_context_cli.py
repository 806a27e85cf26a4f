"""Context parallelism, sequence parallelism and hybrid sharding through ``mpishard train``.

Each layout trains the same float64 run (4 ranks' worth of data per step, two
micro-steps, clipping) and must log the losses one process logs, to 1e-10;
``--dry-run`` prints the five axes and every group's ranks; a sequence that
does not split is one line and exit status 2 on every rank.
"""
import json

import pytest

from test_cli import mpishard

RUN = ["--model", "llama", "--preset", "llama-tiny", "--block-size", "16", "--batch-size", "2",
       "--micro-steps", "2", "--dtype", "float64", "--max-bytes", "20000", "--eval-batches", "1",
       "--progress", "false", "--steps", "3", "--grad-clip", "0.05", "--eval-interval", "0"]


def losses(tmp_path, name, n, *flags):
    metrics = tmp_path / f"{name}.jsonl"
    out = mpishard("train", *RUN, *flags, "--metrics", str(metrics), n=n, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]


@pytest.mark.timeout(900)
def test_layouts_log_the_losses_of_one_process(tmp_path):
    one = losses(tmp_path, "one", None, "--global-batch", "8")
    layouts = {
        "cp4-ring": ["--cp", "4", "--strategy", "ddp"],
        "dp2-cp2-a2a": ["--cp", "2", "--cp-mode", "all-to-all", "--strategy", "zero3"],
        "hsdp2x2": ["--dp-replicate", "2", "--dp-shard", "2", "--strategy", "zero3"],
        "cp2-tp2-sp": ["--cp", "2", "--tp", "2", "--sequence-parallel", "true",
                       "--strategy", "zero2"],
    }
    for name, flags in layouts.items():
        got = losses(tmp_path, name, 4, *flags, "--global-batch", "8")
        assert len(got) == len(one) == 3
        assert max(abs(a - b) / b for a, b in zip(got, one)) <= 1e-10, (name, got, one)


@pytest.mark.timeout(900)
def test_eight_rank_layouts_log_the_losses_of_one_process(tmp_path):
    """Oversubscribed 8 ranks, tiny model: hybrid x tp and cp x tp x pp."""
    one = losses(tmp_path, "one", None, "--global-batch", "8")
    for name, flags in {"hsdp2x2-tp2-sp": ["--dp-replicate", "2", "--dp-shard", "2", "--tp", "2",
                                           "--sequence-parallel", "true"],
                        "cp2-tp2-pp2": ["--cp", "2", "--tp", "2", "--pp", "2",
                                        "--strategy", "ddp"]}.items():
        got = losses(tmp_path, name, 8, *flags, "--global-batch", "8")
        assert max(abs(a - b) / b for a, b in zip(got, one)) <= 1e-10, (name, got, one)


def test_dry_run_prints_the_five_axes_and_their_groups(tmp_path):
    out = mpishard("train", *RUN, "--dp-replicate", "2", "--cp", "2", "--dry-run", "true",
                   n=4, timeout=120)
    assert out.returncode == 0, out.stderr
    head = out.stdout.splitlines()
    assert "mesh pp=1 x dp_replicate=2 x dp_shard=1 x cp=2 x tp=1 (dp=2)" in head[0]
    groups = {line.split()[0]: line.split(None, 1)[1] for line in head[1:4]}
    assert groups == {"dp": "[0 2] [1 3]", "cp": "[0 1] [2 3]", "dp_cp": "[0 1 2 3]"}


@pytest.mark.parametrize("flags,message", [
    (["--cp", "4", "--block-size", "12"],
     "sequence length 12 does not divide by 2 x cp = 8"),
    (["--cp", "4", "--cp-mode", "all-to-all", "--n-head", "2", "--n-kv-head", "2"],
     "n_head = 2 does not divide by 4; use --cp-mode ring"),
    (["--tp", "4", "--sequence-parallel", "true", "--batch-size", "1", "--block-size", "6",
      "--n-head", "4", "--n-kv-head", "4", "--micro-steps", "1"],
     "sequence parallelism splits the 6 rows of each micro-batch"),
])
def test_a_split_that_cannot_work_is_refused_on_every_rank(flags, message):
    out = mpishard("train", *RUN, *flags, n=4, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count(message) >= 1, out.stderr
    assert "Traceback" not in out.stderr and "Abort" not in out.stderr


def test_sampling_after_a_context_parallel_run_is_skipped_not_a_crash():
    """``--sample-tokens`` with cp 2 trained, then raised on every rank (a prompt does not
    split into 2 x cp chunks); it is skipped as under tp and pp."""
    out = mpishard("train", *RUN[:-4], "--steps", "1", "--cp", "2", "--sample-tokens", "8",
                   n=2, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sample skipped: sampling during training needs tp=1 pp=1 cp=1" in out.stdout
    assert "val loss" in out.stdout and "Traceback" not in out.stderr

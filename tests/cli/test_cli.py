"""The mpishard command: each command runs; each bad input gives its message and exit code."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
FAST = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16",
        "--batch-size", "2", "--max-bytes", "20000", "--eval-batches", "1", "--progress", "false"]


from ckpt_scripts.common import run_mpishard as mpishard  # noqa: E402


def test_help_and_version():
    out = mpishard("--help")
    assert out.returncode == 0 and "train" in out.stdout and "estimate" in out.stdout
    assert mpishard("--version").stdout.startswith("mpishard ")
    train_help = mpishard("train", "--help").stdout
    assert "--strategy" in train_help and "--micro-steps" in train_help


def test_unknown_flag_is_an_argparse_error():
    out = mpishard("train", "--no-such-flag")
    assert out.returncode == 2 and "unrecognized arguments: --no-such-flag" in out.stderr


def test_info_single_rank():
    out = mpishard("info")
    assert out.returncode == 0, out.stderr
    from mpi4py import MPI

    vendor = MPI.get_vendor()[0]          # MPICH, or Open MPI under `make test MPI=openmpi`
    assert "mpi4py" in out.stdout and "world size 1" in out.stdout and vendor in out.stdout
    assert "kernels    cpu on NumPy" in out.stdout


def test_info_names_the_reference_kernels_when_chosen():
    out = mpishard("info", env={"MPISHARD_KERNELS": "reference"})
    assert out.returncode == 0, out.stderr
    assert "kernels    reference everywhere (MPISHARD_KERNELS=reference)" in out.stdout


def test_train_writes_metrics(tmp_path):
    metrics = tmp_path / "m.jsonl"
    out = mpishard("train", *FAST, "--steps", "3", "--metrics", str(metrics), "--strategy", "ddp")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(l) for l in metrics.read_text().splitlines()]
    steps = [l for l in lines if "loss" in l]
    assert [l["step"] for l in steps] == [1, 2, 3]
    assert {"lr", "grad_norm", "tokens_per_s", "memory", "comm"} <= set(steps[0])
    assert "val_loss" in lines[0] and "val_loss" in lines[-1]
    assert "val loss" in out.stdout.splitlines()[-1]


@pytest.mark.parametrize("args,message", [
    (["--data", "/no/such/path"], "data path '/no/such/path' does not exist"),
    (["--strategy", "zero9"], "strategy = 'zero9' is not one of ddp, zero1, zero2, zero3"),
    (["--dp", "3"], "mesh dp=3"),
    (["--steps", "0"], "steps must be >= 1"),
])
def test_bad_input_one_line_exit_2(args, message):
    out = mpishard("train", *FAST, *args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_corpus_problems(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = mpishard("train", *FAST, "--data", str(empty))
    assert out.returncode == 2 and "is empty" in out.stderr
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    out = mpishard("train", *FAST, "--data", str(short))
    assert out.returncode == 2 and "one block needs 17" in out.stderr


def test_unknown_config_key_suggests_the_closest(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("n_layers = 3\n")
    out = mpishard("train", "--config", str(cfg))
    assert out.returncode == 2 and "unknown config key 'n_layers'; did you mean 'n_layer'?" \
        in out.stderr


def test_estimate_prints_every_strategy():
    out = mpishard("estimate", "--dp", "4", "--n-layer", "4", "--n-embd", "256")
    assert out.returncode == 0, out.stderr
    for name in ("ddp on dp=4", "zero1", "zero2", "zero3"):
        assert name in out.stdout


def test_estimate_with_parameter_offload_prints_the_strategies_that_can():
    out = mpishard("estimate", "--dp", "2", "--n-layer", "2", "--n-embd", "32", "--offload",
                   "params")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("--offload params: zero3 only (ddp, zero1, zero2 cannot "
                                 "offload that)\nzero3 on dp=2")
    assert "ddp on" not in out.stdout


def test_offload_on_a_gpu_without_a_host_link_is_one_line(tmp_path):
    machine = json.loads((Path(__file__).parents[2] / "mpishard/machines/h100-sxm.json")
                         .read_text())
    del machine["host_link"], machine["host_memory_bandwidth"]
    path = tmp_path / "nolink.json"
    path.write_text(json.dumps({**machine, "name": "nolink"}))
    for command in (["plan", "--preset", "llama3.1-8b", "--ranks", "1"],
                    ["estimate", "--preset", "llama3.1-8b", "--strategy", "zero1"]):
        out = mpishard(*command, "--machine", path, "--offload", "optimizer")
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.startswith("mpishard: error: --offload optimizer: machine 'nolink' "
                                     "has no host_link or host_memory_bandwidth")
        assert len(out.stderr.splitlines()) == 1
    # ... and without --offload (a host link but no host bandwidth), the hint names both
    path.write_text(json.dumps({**machine, "name": "nolink", "host_link": {"bandwidth": 5e10}}))
    out = mpishard("plan", "--preset", "llama3.1-8b", "--ranks", "1", "--machine", path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1].endswith(
        "what would help: more ranks, a shorter --seq, or host_link and "
        "host_memory_bandwidth in the machine description, to try offload"), out.stdout


def test_dry_run_under_mpiexec_prints_the_plan():
    out = mpishard("train", *FAST, "--dry-run", n=4)
    assert out.returncode == 0, out.stderr
    assert "zero3 on dp=4" in out.stdout and "rank 3/4" in out.stdout
    assert "val loss" not in out.stdout


def test_bench_commands_run():
    out = mpishard("bench", "comm", "--sizes-mib", "0.25", "--iters", "2", "--warmup", "1",
                   n=2)
    assert out.returncode == 0, out.stderr
    assert "all_reduce" in out.stdout and "ratio" in out.stdout
    out = mpishard("bench", "step", "--rounds", "1", "--steps", "1", "--warmup", "0",
                   "--threads", "1", "--no-torch", timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["results"]["1_thread"]["mpishard"]["median_step_s"] > 0


def test_train_measures_activations_and_checkpointing_shrinks_them():
    """The first step's activations are measured and logged; checkpointing keeps fewer,
    selective recomputation and recomputation by op fewer than none and more than whole
    blocks."""
    mib = {}
    for on in ("false", "true", "selective", "op"):
        out = mpishard("train", *FAST, "--n-layer", "3", "--n-embd", "64", "--block-size", "64",
                       "--steps", "2", "--micro-steps", "2",
                       "--precision", "bfloat16", "--activation-checkpointing", on)
        assert out.returncode == 0, out.stderr
        line = next(l for l in (out.stdout + out.stderr).splitlines()
                    if "activations kept for backward" in l)
        mib[on] = float(line.split("backward: ")[1].split(" MiB")[0])
    assert mib["true"] > 0 and mib["false"] >= 2 * mib["true"], mib
    assert mib["true"] < mib["selective"] < mib["false"], mib
    assert mib["true"] < mib["op"] < mib["false"], mib


def test_train_refuses_recomputation_by_op_for_a_mixture_of_experts():
    out = mpishard("train", *FAST, "--moe-experts", "4", "--moe-aux-coef", "0",
                   "--moe-z-coef", "0", "--activation-checkpointing", "op")
    assert out.returncode != 0
    assert "activation checkpointing 'op' keeps the products of dense blocks; this model " \
        "has moe_experts = 4: use 'full' or 'selective'" in out.stderr
    assert "Traceback" not in out.stderr


def test_train_refuses_a_bad_kernel_switch_before_building_anything(tmp_path):
    """A bad MPISHARD_BLAS (or an MKL that does not load) stops every rank alike at the
    start, with the value and the fix, not at the first matrix product."""
    for env, text in (({"MPISHARD_BLAS": "acml"}, "MPISHARD_BLAS='acml'"),
                      ({"MPISHARD_BLAS": "mkl",
                        "MPISHARD_MKL_LIB": str(tmp_path / "libmkl_rt.so.3")}, "pip install mkl")):
        out = mpishard("train", *FAST, "--steps", "1", "--metrics", str(tmp_path / "m.jsonl"),
                       n=2, env=env)
        assert out.returncode != 0 and text in out.stderr, out.stderr[-2000:]
        assert not (tmp_path / "m.jsonl").exists()

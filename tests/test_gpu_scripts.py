"""The GPU check's runner, parts and benchmark, on a machine without a GPU.

What can be checked here is checked here: scripts/gpu_check.py --dry-run prints
the plan within 455 s and runs nothing; scripts/gpu_check.sh fails fast and
says why without CuPy; the rehearsal (NumPy) launches parts, records them and
writes one JSON; a part is ended at its hard limit even if it ignores SIGINT;
the collective check's comparison accepts what a float16 reduction can give;
benchmarks/gpu.py checks its losses and memory, and skips clearly without
CuPy. The GPU paths themselves run on a GPU machine (docs/gpu.md).
"""
import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ckpt_scripts.common import MPIEXEC as VENV_MPIEXEC
from ckpt_scripts.common import ROOT, clean_env
from mpishard.core.backend import cupy_or_none

pytestmark = pytest.mark.timeout(120)
MPIEXEC = str(VENV_MPIEXEC) if VENV_MPIEXEC.exists() else shutil.which("mpiexec")


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_check = _load("scripts/gpu_check.py", "gpu_check")
gpu_parts = _load("scripts/gpu_parts.py", "gpu_parts")
gpu_bench = _load("benchmarks/gpu.py", "gpu_bench")
PLAN_ORDER = ["env", "collectives_1rank", "gpt_vs_numpy", "float16_vs_float32", "tests_1rank",
              "staging_2ranks", "train_check", "bench_single", "attention", "bench_zero3_2ranks"]


def _check(tmp_path, *args, timeout=100):
    env = clean_env(PYTHON=sys.executable, GPU_CHECK_JSON=str(tmp_path / "gpu_check.json"),
                    INSTALL_WHEELS="no")
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    return proc, json.loads((tmp_path / "gpu_check.json").read_text())


def test_shell_scripts_parse():
    for script in ("gpu_check.sh", "fetch_gpu_wheels.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", *(str(p) for p in (ROOT / "scripts").glob("*.sh"))],
                       check=True)


@pytest.mark.skipif(cupy_or_none() is not None, reason="CuPy imports here")
def test_gpu_check_without_cupy_fails_fast_and_says_why(tmp_path):
    proc, report = _check(tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gpu_check: FAILED: CuPy does not import" in proc.stdout
    assert report["status"] == "failed" and report["mode"] == "gpu"
    assert "CuPy does not import" in report["reason"] and "--rehearse" in report["reason"]
    assert [p["name"] for p in report["parts"]] == ["env"]  # nothing else was started
    assert report["environment"]["cupy"] is None and report["environment"]["mpi4py"]


def test_dry_run_prints_the_plan_in_order_within_455_s(tmp_path):
    env = clean_env(OUT=str(tmp_path / "out"))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_check.py"), "--dry-run"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    names = [row[0] for row in rows]
    assert names == PLAN_ORDER + ["runner", "total"]
    limits = {row[0]: int(row[1 if row[0] in ("runner", "total") else 2].rstrip("s"))
              for row in rows}
    total = limits.pop("total")
    assert total == sum(limits.values()) <= 455
    assert not (tmp_path / "out").exists()  # nothing written, nothing run
    shell = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--dry-run"],
                           env=clean_env(PYTHON=sys.executable), capture_output=True,
                           text=True, timeout=30)
    assert shell.returncode == 0 and shell.stdout == proc.stdout
    parts = gpu_check.plan_parts("cupy")
    assert [p.name for p in parts] == PLAN_ORDER
    assert gpu_check.plan_total(parts) == total
    assert all(p.limit_s > gpu_check.KILL_GRACE_S + 5 for p in parts)


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
def test_rehearsal_launches_parts_and_writes_one_report(tmp_path):
    proc, report = _check(tmp_path, "--rehearse", "--mpiexec", MPIEXEC, "--only",
                          "collectives_1rank,staging_2ranks,bench_single,bench_zero3_2ranks")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "REHEARSAL: the GPU check itself is still owed" in proc.stdout
    assert report["status"] == "passed" and report["mode"].startswith("rehearsal")
    assert [p["name"] for p in report["plan"]] == PLAN_ORDER
    parts = {p["name"]: p for p in report["parts"]}
    assert list(parts) == ["env", "collectives_1rank", "staging_2ranks", "bench_single",
                           "bench_zero3_2ranks"]
    assert parts["staging_2ranks"]["status"] == "skipped" and "needs CuPy" in parts[
        "staging_2ranks"]["reason"]
    assert parts["env"]["result"]["mpi_float16_datatype"]  # a name, or why there is none
    assert set(parts["collectives_1rank"]["result"]["paths"]) == {"shortcut", "mpi_staged"}
    zero3 = parts["bench_zero3_2ranks"]
    assert zero3["status"] == "passed" and zero3["command"][:3] == [MPIEXEC, "-n", "2"]
    assert [r["rank"] for r in zero3["result"]["runs"][0]["ranks"]] == [0, 1]
    assert [r["precision"] for r in report["highlights"]["single"]] == ["float32", "float16"]
    # four parts ran; the skipped one left nothing in the log
    assert (tmp_path / "gpu_check.log").read_text().count("=====") == 4


def test_runner_records_failure_timeout_and_spent_budget(tmp_path):
    ctx = {"tmp": tmp_path, "mpiexec": None, "mpi_flags": []}
    log = open(tmp_path / "log", "w")
    fails = gpu_check.Part("fails", "exits 3", ["-c", "print('boom'); raise SystemExit(3)"], 30,
                           result=False)
    record = gpu_check.run_part(fails, ctx, 100, log)
    assert (record["status"], record["returncode"], record["log_tail"]) == ("failed", 3, ["boom"])
    # ignores SIGINT and SIGTERM: still ended by its own limit, so it cannot eat the next part's
    stubborn = gpu_check.Part("stubborn", "sleeps", ["-c", textwrap.dedent("""
        import signal, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)""")], 14, result=False)
    record = gpu_check.run_part(stubborn, ctx, 100, log)
    assert record["status"] == "timeout" and record["timeout_s"] == 14
    assert record["seconds"] <= 14.5
    assert gpu_check.run_part(stubborn, ctx, 10, log)["status"] == "not_run"
    two = gpu_check.Part("two", "needs mpiexec", ["-c", "pass"], 30, ranks=2, result=False)
    assert "no mpiexec" in gpu_check.run_part(two, ctx, 100, log)["reason"]


def _float16_sum_in_order(inputs):
    """What NCCL or an MPI with float16 arithmetic may return: float16 adds, in order."""
    total = inputs[0].copy()
    for x in inputs[1:]:
        total = (total + x).astype(np.float16)
    return total


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_collective_check_accepts_what_float16_reductions_give(n):
    count = 4096
    inputs = [gpu_parts.rank_values(r, count, np.float16) for r in range(n)]
    for dtype in ("float32", "float64"):
        wide = [x.astype(dtype) for x in inputs]
        gpu_parts.assert_reduced(np.sum(wide, axis=0).astype(dtype), wide, "sum")
    gpu_parts.assert_reduced(_float16_sum_in_order(inputs), inputs, "sum")
    gpu_parts.assert_reduced(_float16_sum_in_order(inputs[::-1]), inputs, "sum")
    gpu_parts.assert_reduced((np.sum(inputs, axis=0, dtype=np.float32) / n).astype(np.float16),
                             inputs, "avg")
    gpu_parts.assert_reduced(np.max(inputs, axis=0), inputs, "max")
    off = _float16_sum_in_order(inputs)
    off[100] = np.nextafter(np.nextafter(off[100], np.float16(np.inf)), np.float16(np.inf))
    with pytest.raises(AssertionError, match="sum wrong at 1 of 4096 elements, first 100"):
        gpu_parts.assert_reduced(off, inputs, "sum")


def test_the_old_float16_expectation_could_never_pass():
    """Inputs arange(4096) + r round above 2048, so an exact float16 cast of the
    exact sum is not what any float16 reduction of those inputs returns."""
    n, count = 2, 4096
    inputs = [(np.arange(count) + r).astype(np.float16) for r in range(n)]
    old_expected = (n * np.arange(count) + n * (n - 1) // 2).astype(np.float16)
    assert (_float16_sum_in_order(inputs) != old_expected).any()
    wide = (np.sum(inputs, axis=0, dtype=np.float32)).astype(np.float16)
    assert (wide != old_expected).any()   # float32 reduction too: the inputs already rounded


def test_junit_counts_add_up_ranks_and_name_failures(tmp_path):
    suite = """<testsuites><testsuite tests="3" failures="{f}" errors="0" skipped="1">
        <testcase classname="tests.test_a" name="test_x"/>
        <testcase classname="tests.test_a" name="test_y">{fail}</testcase>
        <testcase classname="tests.test_a" name="test_z"><skipped/></testcase>
        </testsuite></testsuites>"""
    (tmp_path / "t.rank0.xml").write_text(suite.format(f=0, fail=""))
    (tmp_path / "t.rank1.xml").write_text(
        suite.format(f=1, fail='<failure message="assert 1 == 2"/>'))
    counts = gpu_check.junit_counts(sorted(tmp_path.glob("t.rank*.xml")))
    assert counts["totals"] == {"tests": 6, "passed": 3, "failures": 1, "errors": 0,
                                "skipped": 2}
    assert counts["failed"] == [{"rank": 1, "test": "tests.test_a::test_y",
                                 "message": "assert 1 == 2"}]


def test_flops_per_token_is_nanogpts():
    # nanoGPT reports 123.69M parameters for GPT-2 small with vocabulary 50304
    fpt, n = gpu_bench.flops_per_token(gpu_bench.GPT2_SMALL, 1024)
    assert n == 123_689_472
    assert fpt == 6 * n + 12 * 12 * 12 * 64 * 1024


def test_benchmark_tiny_on_numpy_writes_every_field(tmp_path):
    out = tmp_path / "single.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu.py"), "--backend", "numpy",
                    "--tiny", "--peak-tflops", "1", "--json", str(out)],
                   check=True, env=clean_env(), timeout=60, capture_output=True)
    report = json.loads(out.read_text())
    assert report["part"] == "single" and report["tiny"] and report["device"]["name"] == "cpu"
    assert report["device"]["peak_source"] == "--peak-tflops"
    assert [r["precision"] for r in report["runs"]] == ["float32", "float16"]
    for run in report["runs"]:
        assert run["tokens_per_s"] > 0 and len(run["step_s"]) == report["steps"]
        assert run["mfu"] == pytest.approx(report["flops_per_token"] * run["tokens_per_s"] / 1e12)
        parts = run["breakdown"]["seconds"]
        assert set(parts) == {"matrix products", "attention", "elementwise and the rest",
                              "optimizer"} and min(parts.values()) > 0
        assert sum(run["breakdown"]["shares"].values()) == pytest.approx(1.0, rel=0.05)
        assert run["skipped_steps"] == 0 and run["pool_used_bytes"] is None
    assert report["runs"][1]["loss_scale"] == 2.0 ** 16
    assert report["status"] == "passed" and report["failures"] == []
    activations = report["activations"]
    assert activations["bytes_with_checkpointing"] < activations["bytes_without_checkpointing"]


def test_benchmark_checks_losses_skips_and_memory():
    good = {"precision": "float16", "losses": [4.0, 3.5, 3.0], "loss_first": 4.0,
            "loss_last": 3.0, "skipped_steps": 1}
    assert gpu_bench.training_failures("x", good) == []
    assert "not finite" in gpu_bench.training_failures(
        "x", {**good, "losses": [4.0, float("nan"), 3.0]})[0]
    assert "did not fall" in gpu_bench.training_failures(
        "x", {**good, "losses": [4.0, 4.1], "loss_last": 4.1})[0]
    assert "2 float16 steps skipped (at most 1" in gpu_bench.training_failures(
        "x", {**good, "skipped_steps": 2})[0]
    assert gpu_bench.training_failures("x", {**good, "precision": "float32",
                                             "skipped_steps": 2}) == []
    rank = {"rank": 1, "pool_used_bytes": 1100, "model_state_bytes": 1000}
    assert gpu_bench.memory_failures("zero3", dict(rank), 1050) == []  # the pool, 4.8% over
    (failure,) = gpu_bench.memory_failures("zero3", dict(rank), 900)
    assert "rank 1: CuPy pool bytes in use" in failure and "within 10%" in failure
    assert gpu_bench.memory_failures("zero3", {**rank, "pool_used_bytes": None}, 1000) == []


@pytest.mark.skipif(cupy_or_none() is not None, reason="CuPy imports here")
def test_benchmark_without_cupy_skips_and_says_why(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu.py"), "--json", str(out)],
                          env=clean_env(), timeout=60, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "benchmarks/gpu.py: SKIPPED: CuPy is not importable" in proc.stdout
    assert json.loads(out.read_text()) == {"part": "single", "backend": "cupy",
                                           "status": "skipped",
                                           "reason": "CuPy is not importable"}


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
def test_benchmark_zero3_memory_matches_the_planner_on_two_ranks(tmp_path):
    out = tmp_path / "zero3.json"
    subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py",
                    str(ROOT / "benchmarks/gpu.py"), "--part", "zero3", "--backend", "numpy",
                    "--tiny", "--json", str(out)],
                   check=True, env=clean_env(), timeout=60, capture_output=True)
    report = json.loads(out.read_text())
    assert report["part"] == "zero3" and report["world_size"] == 2
    for run in report["runs"]:
        assert run["plan"]["model_state_bytes"] > 0 and run["tokens_per_s_all_ranks"] > 0
        for rank in run["ranks"]:
            assert rank["model_state_over_plan"] == pytest.approx(1.0, abs=0.05), textwrap.shorten(
                json.dumps(rank), 300)
            assert rank["measured_over_plan"] == rank["model_state_over_plan"]  # the ledger's
    assert report["status"] == "passed" and report["failures"] == []


def test_dtype_probe_on_numpy_records_every_probe(tmp_path):
    out = tmp_path / "dtypes.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu.py"), "--part", "dtypes",
                    "--backend", "numpy", "--tiny", "--json", str(out)],
                   check=True, env=clean_env(), timeout=60, capture_output=True)
    probes = json.loads(out.read_text())["probes"]
    dtypes = ["float32", "float16"] + (["bfloat16"] if importlib.util.find_spec("ml_dtypes")
                                       else [])
    kinds = ["elementwise", "matmul_2d", "matmul_batched", "scatter_add"]
    assert sorted(probes) == sorted(f"{d}.{k}" for d in dtypes for k in kinds)
    assert all(p["ok"] for p in probes.values()), probes  # NumPy runs every 16-bit probe
    assert probes["float32.matmul_2d"]["max_rel_err_vs_float32"] == 0
    assert 0 < probes["float16.matmul_batched"]["max_rel_err_vs_float32"] < 1e-2
    assert probes["float16.scatter_add"]["sum"] == 12.0

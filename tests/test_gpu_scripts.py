"""The GPU check's runner and benchmark, on a machine without a GPU.

What can be checked here is checked here: scripts/gpu_check.sh fails fast and
says why without CuPy; its dry run (NumPy) launches parts, records them and
writes one JSON; the runner records timeouts and failures and goes on;
benchmarks/gpu.py's tiny NumPy run writes every field, and its ZeRO-3 memory
matches the planner. The GPU paths themselves run on a GPU machine (docs/gpu.md).
"""
import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from ckpt_scripts.common import MPIEXEC as VENV_MPIEXEC
from ckpt_scripts.common import ROOT, clean_env
from mpishard.backend import cupy_or_none

pytestmark = pytest.mark.timeout(120)
MPIEXEC = str(VENV_MPIEXEC) if VENV_MPIEXEC.exists() else shutil.which("mpiexec")


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_check = _load("scripts/gpu_check.py", "gpu_check")
gpu_bench = _load("benchmarks/gpu.py", "gpu_bench")


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
    assert "CuPy does not import" in report["reason"] and "--dry-run" in report["reason"]
    assert [p["name"] for p in report["parts"]] == ["env"]  # nothing else was started
    assert report["environment"]["cupy"] is None and report["environment"]["mpi4py"]


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
def test_dry_run_launches_parts_and_writes_one_report(tmp_path):
    proc, report = _check(tmp_path, "--dry-run", "--mpiexec", MPIEXEC,
                          "--only", "bench_single,comm_1rank,bench_zero3_2ranks")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "DRY RUN: the GPU check itself is still owed" in proc.stdout
    assert report["status"] == "passed" and report["mode"].startswith("dry-run")
    parts = {p["name"]: p for p in report["parts"]}
    assert list(parts) == ["env", "comm_1rank", "bench_single", "bench_zero3_2ranks"]
    assert parts["comm_1rank"]["status"] == "skipped" and "needs CuPy" in parts["comm_1rank"][
        "reason"]
    zero3 = parts["bench_zero3_2ranks"]
    assert zero3["status"] == "passed" and zero3["command"][:3] == [MPIEXEC, "-n", "2"]
    assert [r["rank"] for r in zero3["result"]["runs"][0]["ranks"]] == [0, 1]
    assert [r["precision"] for r in report["highlights"]["single"]] == ["float32", "float16"]
    # three parts ran; the skipped one left nothing in the log
    assert (tmp_path / "gpu_check.log").read_text().count("=====") == 3


def test_runner_records_failure_timeout_and_spent_budget(tmp_path):
    ctx = {"tmp": tmp_path, "mpiexec": None, "mpi_flags": []}
    log = open(tmp_path / "log", "w")
    fails = gpu_check.Part("fails", "exits 3", ["-c", "print('boom'); raise SystemExit(3)"], 30,
                           result=False)
    record = gpu_check.run_part(fails, ctx, 100, log)
    assert (record["status"], record["returncode"], record["log_tail"]) == ("failed", 3, ["boom"])
    sleeper = gpu_check.Part("sleeps", "sleeps", ["-c", "import time; time.sleep(60)"], 2,
                             result=False)
    record = gpu_check.run_part(sleeper, ctx, 100, log)
    assert record["status"] == "timeout" and record["timeout_s"] == 2 and record["seconds"] < 15
    assert gpu_check.run_part(sleeper, ctx, 10, log)["status"] == "not_run"
    two = gpu_check.Part("two", "needs mpiexec", ["-c", "pass"], 30, ranks=2, result=False)
    assert "no mpiexec" in gpu_check.run_part(two, ctx, 100, log)["reason"]


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
        assert run["skipped_steps"] == 0 and run["pool_used_bytes"] is None
    assert report["runs"][1]["loss_scale"] == 2.0 ** 16
    activations = report["activations"]
    assert activations["bytes_with_checkpointing"] < activations["bytes_without_checkpointing"]


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

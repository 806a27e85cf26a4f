"""The GPU check's runner, parts and benchmark, on a machine without a GPU.

What can be checked here is checked here: scripts/gpu_check.py --dry-run prints
the plan within 420 s, each part's expected seconds and margin, and runs nothing;
tests_1rank's counts are what its selection collects; the warm part runs its jobs
side by side into one kernel cache; scripts/gpu_check.sh fails fast and
says why without CuPy; the rehearsal (NumPy) launches parts, records them and
writes one JSON, every part with the same CUPY_CACHE_DIR; a part is ended at its
hard limit even if it ignores SIGINT;
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
import zlib

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
PLAN_ORDER = ["env", "collectives_1rank", "warm_kernels", "gpt_vs_numpy", "float16_vs_float32",
              "tests_1rank", "staging_2ranks", "train_check", "bench_single", "attention",
              "bench_zero3_2ranks", "bench_scaling"]


def _check(tmp_path, *args, timeout=100):
    env = clean_env(PYTHON=sys.executable, GPU_CHECK_JSON=str(tmp_path / "gpu_check.json"),
                    INSTALL_WHEELS="no")
    env.pop("OUT", None)
    env.pop("CUPY_CACHE_DIR", None)                     # the runner's default: beside the report
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


def test_dry_run_prints_the_plan_in_order_within_420_s(tmp_path):
    env = clean_env(OUT=str(tmp_path / "out"))
    env.pop("CUPY_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_check.py"), "--dry-run"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table, notes = proc.stdout.split("\n\n", 1)
    rows = [line.split() for line in table.splitlines()[1:]]
    names = [row[0] for row in rows]
    assert names == PLAN_ORDER + ["runner", "total"]
    seconds = {row[0]: [int(x.rstrip("s")) for x in row[1:5] if x.endswith("s")] for row in rows}
    runner, (expect, total, margin) = seconds.pop("runner"), seconds.pop("total")
    parts = gpu_check.plan_parts("cupy")
    assert [p.name for p in parts] == PLAN_ORDER
    for p in parts:                                      # expected, limit, margin as printed
        assert seconds[p.name] == [p.expect_s, p.limit_s, p.margin_s], p.name
        assert p.margin_s == p.limit_s - gpu_check.KILL_GRACE_S - p.expect_s >= 5, p.name
        assert p.expect_s > 0 and f"  {p.name}: {p.sizing}" in notes
    assert total == gpu_check.plan_total(parts) == sum(p.limit_s for p in parts) + runner[0]
    assert total <= 420 and expect == sum(p.expect_s for p in parts)
    assert margin == sum(p.margin_s for p in parts)
    assert f"every part: CUPY_CACHE_DIR={tmp_path / 'out' / 'cupy_kernel_cache'}" in notes
    assert not (tmp_path / "out").exists()  # nothing written, nothing run
    shell = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--dry-run"],
                           env={**env, "PYTHON": sys.executable}, cwd=tmp_path,
                           capture_output=True, text=True, timeout=30)
    assert shell.returncode == 0 and shell.stdout == proc.stdout


def test_the_docs_plan_table_is_the_plan():
    """docs/gpu.md's table of the parts says what the dry run says: each part's expected
    seconds, limit and margin, and the totals."""
    text = (ROOT / "docs/gpu.md").read_text()
    parts = gpu_check.plan_parts("cupy")
    for p in parts:
        assert f"| `{p.name}` | {p.expect_s} s | {p.limit_s} s | {p.margin_s} s |" in text, p.name
    total = (f"| total | {sum(p.expect_s for p in parts)} s | {gpu_check.plan_total(parts)} s "
             f"| {sum(p.margin_s for p in parts)} s |")
    assert total in text and f"### The plan: {gpu_check.plan_total(parts)} s" in text


_COUNT_SELECTION = textwrap.dedent("""
    import sys, pytest
    class Count:
        collected = one_rank = 0
        def pytest_collection_finish(self, session):
            for item in session.items:
                params = getattr(getattr(item, "callspec", None), "params", {})
                self.collected += 1
                self.one_rank += params.get("size", 1) == 1 and params.get("dp_size", 1) == 1
    count = Count()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "--with-mpi",
                        *sys.argv[1:]], plugins=[count])
    print("COUNTS", code, count.collected, count.one_rank)
    """)


def test_tests_1rank_is_sized_from_what_its_selection_collects():
    """The counts the plan sizes tests_1rank by are what its files and -k collect on CuPy
    (the tests that run at one rank: no sub-world of 2 to 4), and the finite-difference
    evaluations of the op cases it selects; each op it names exists."""
    proc = subprocess.run([sys.executable, "-c", _COUNT_SELECTION,
                           *gpu_check.test_selection("cupy"), *gpu_check.TEST_FILES],
                          cwd=ROOT, env=clean_env(MPISHARD_TEST_BACKENDS="cupy"),
                          capture_output=True, text=True, timeout=100)
    line = [x for x in proc.stdout.splitlines() if x.startswith("COUNTS")]
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    code, collected, one_rank = map(int, line[0].split()[1:])
    assert code == 0
    assert {"collected": collected, "tests": one_rank} == {
        k: gpu_check.TESTS_1RANK[k] for k in ("collected", "tests")}
    from test_autodiff_gradcheck import CASES

    assert set(gpu_check.DEVICE_OPS) <= set(CASES)
    evaluations = every = 0
    for name, cases in CASES.items():
        for index, case in enumerate(cases):
            _, inputs = case(np.random.default_rng(zlib.crc32(name.encode()) + index))
            count = 2 * sum(np.asarray(a).size for a in inputs)
            every += count
            if any(op in name for op in gpu_check.DEVICE_OPS) and "expert" not in name:
                evaluations += count
    assert evaluations == gpu_check.TESTS_1RANK["fd_evaluations"]
    tests_1rank = next(p for p in gpu_check.plan_parts("cupy") if p.name == "tests_1rank")
    assert tests_1rank.expect_s == gpu_check.tests_1rank_expect_s()
    n_cases = sum(len(cases) for cases in CASES.values())     # what its sizing compares
    assert f"all {n_cases} cases: {every:,})" in tests_1rank.sizing


def test_warm_part_runs_its_jobs_side_by_side_into_one_cache(tmp_path, monkeypatch):
    """Every job runs (as many at once as cores), sees the cache folder, and what it adds
    there is counted; a job that fails fails the part, naming it with its output."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("CUPY_CACHE_DIR", str(cache))
    write = ("import os, pathlib; d = pathlib.Path(os.environ['CUPY_CACHE_DIR']); "
             "d.mkdir(exist_ok=True); (d / '{0}').write_text('')")
    jobs = {f"job{i}": ["-c", write.format(i)] for i in range(3)}
    monkeypatch.setattr(gpu_parts, "warm_jobs", lambda backend, ops: jobs)
    found = gpu_parts.part_warm("numpy", [])
    assert found["files_before"] == 0 and found["kernels_compiled"] == 3
    assert set(found["jobs"]) == set(jobs) and all(
        j["returncode"] == 0 for j in found["jobs"].values())
    jobs["bad"] = ["-c", "print('no kernel here'); raise SystemExit(4)"]
    with pytest.raises(AssertionError, match=r"warm jobs failed.*'bad': \['no kernel here'\]"):
        gpu_parts.part_warm("numpy", [])


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
def test_rehearsal_launches_parts_and_writes_one_report(tmp_path):
    proc, report = _check(tmp_path, "--rehearse", "--mpiexec", MPIEXEC, "--only",
                          "collectives_1rank,staging_2ranks,bench_single,bench_zero3_2ranks")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "REHEARSAL: the GPU check itself is still owed" in proc.stdout
    assert report["status"] == "passed" and report["mode"].startswith("rehearsal")
    assert [p["name"] for p in report["plan"]] == PLAN_ORDER
    assert all(p["expect_s"] > 0 and p["margin_s"] >= 5 for p in report["plan"])
    parts = {p["name"]: p for p in report["parts"]}
    cache = tmp_path / "cupy_kernel_cache"                 # beside the report, every part's
    assert report["kernel_cache"]["dir"] == str(cache) and cache.is_dir()
    assert parts["env"]["result"]["CUPY_CACHE_DIR"] == str(cache)
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


def _tiny_benchmark(tmp_path, *args) -> dict:
    """``benchmarks/gpu.py --backend numpy --tiny ARGS``: its JSON report."""
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu.py"), "--backend", "numpy",
                    "--tiny", *args, "--json", str(out)],
                   check=True, env=clean_env(), timeout=60, capture_output=True)
    return json.loads(out.read_text())


def test_benchmark_tiny_on_numpy_writes_every_field(tmp_path):
    report = _tiny_benchmark(tmp_path, "--peak-tflops", "1")
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


def test_benchmark_scaling_times_each_batch_and_its_issue(tmp_path):
    report = _tiny_benchmark(tmp_path, "--part", "scaling", "--batch-sizes", "1,3",
                             "--peak-tflops", "1")
    assert report["part"] == "scaling" and report["batch_sizes"] == [1, 3]
    assert [(r["precision"], r["batch_size"]) for r in report["runs"]] == [
        ("float16", 1), ("float16", 3), ("bfloat16", 1), ("bfloat16", 3)]
    for run in report["runs"]:
        assert 0 < run["issue_s"] <= run["step_s"] and 0 < run["issue_share"] <= 1
        assert run["tokens_per_s"] == pytest.approx(
            run["batch_size"] * report["seq_len"] / run["step_s"])
        assert len(run["losses"]) == report["warmup"] + report["steps"]
    assert report["status"] == "passed" and report["attention"] in ("batched", "fused")


def test_attention_benchmark_times_both_paths_and_the_kernels_alone(tmp_path):
    out = tmp_path / "attention.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks/attention.py"), "--backend",
                    "strict", "--tiny", "--repeats", "2", "--dtypes", "float32,bfloat16",
                    "--json", str(out)], check=True, env=clean_env(), timeout=60,
                   capture_output=True)
    report = json.loads(out.read_text())
    assert [r["dtype"] for r in report["runs"]] == ["float32", "bfloat16"]
    for run in report["runs"]:
        for path in ("batched", "fused"):
            assert run[path]["forward_ms"] > 0 and run[path]["backward_ms"] > 0
        assert run["fused"]["kept_bytes"] < run["batched"]["kept_bytes"]
        kernels = run["kernels"]
        assert kernels["forward_ms"] > 0 and kernels["backward_ms"] > 0
        assert kernels["tensor_cores"] is False and "planned_forward_ms" not in kernels
    assert report["failures"] == []


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


def test_loss_part_on_numpy_times_both_sets_and_compares_them(tmp_path):
    report = _tiny_benchmark(tmp_path, "--part", "loss")
    assert report["status"] == "passed" and report["kernel_set"] == "cpu"
    assert [run["dtype"] for run in report["runs"]] == ["float32", "float16"]
    for run in report["runs"]:
        assert all(run[f"{s}_ms"][way] > 0 for s in ("kernels", "reference")
                   for way in ("forward", "backward"))
        assert run["loss_rel_diff"] < 1e-5 and run["speedup"] > 0


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

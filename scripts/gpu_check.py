"""The GPU check: mpishard's GPU paths, most valuable first, each under a hard limit, one JSON.

    python scripts/gpu_check.py --dry-run     # print the plan: parts, limits, total; runs nothing
    python scripts/gpu_check.py               # on the GPU machine (scripts/gpu_check.sh: wheels first)
    python scripts/gpu_check.py --rehearse    # the same runner with every part on NumPy (CPU)
    python scripts/gpu_check.py --only env,gpt --json runs/gpu_check.json

The runner never imports MPI or CuPy; each part is a subprocess (``mpiexec -n
N python -m mpi4py`` for several ranks, which share the visible GPUs) in its
own process group, killed at its limit (SIGINT, so pytest still writes what it
finished; then SIGTERM, SIGKILL). The limits add up to at most
:data:`TOTAL_LIMIT_S` seconds with the kill grace inside each, so no part can
eat another's time and the whole check fits one fresh machine.

Each part is sized from what it runs: its expected seconds (start-up, the
kernels it loads or compiles, its work; :attr:`Part.sizing` says how they were
counted) and a margin on top make its limit, and the dry run prints all three.
Every part runs with ``CUPY_CACHE_DIR`` set to one folder (``--kernel-cache``,
default ``cupy_kernel_cache`` beside the report): CuPy compiles each kernel once
per dtype and dimension count with NVRTC, about 0.2 s each, and keeps it there,
so the ``warm_kernels`` part compiles what the later parts meet, running their
code on tiny models side by side on the CPU cores, and the later parts (and a
rerun of any part) load the kernels from disk. A part that fails or times out is
recorded and the next one runs; the exit status is 0 only when every part passed
or was skipped for a stated reason, 1 when one failed, 2 when nothing could run
(no CuPy, no GPU).

The parts, in order of what they tell (checks in scripts/gpu_parts.py): the
environment (versions, whether MPI has a float16 datatype); every collective at
one rank on every path (the size-1 shortcut, MPI staged through pinned memory,
MPI CUDA-aware if it is, NCCL, ``auto``) with stream-race checks (a slow
producing kernel, then the collective at once, and a control that must see the
race); the kernels warmed; a GPT step at a real size (2 layers, T=1024, C=768)
on CuPy against NumPy; float16 against float32 (cosines > 0.999); the tests
that run on CuPy (those taking an array module) of a subset of the suite;
collectives over two ranks through host staging; training end to end; the
benchmark (GPT-2 small); fused attention against the batched products
(benchmarks/attention.py); ZeRO-3 memory at two ranks against the planner.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = str(ROOT / "scripts" / "gpu_parts.py")
TOTAL_LIMIT_S = 420      # the whole check, on a fresh machine
RUNNER_SLACK_S = 10      # the runner's own start, JSON writes, mpiexec start-up
KILL_GRACE_S = 8         # SIGINT 4 s, SIGTERM 2 s, SIGKILL 2 s: inside each part's limit

#: the test files ``tests_1rank`` runs, of which only the tests that take an array
#: module (``array_backend``: their ids name it) run, on CuPy; the others run on NumPy
#: in the CPU suite and prove nothing about a GPU (the staging and float16 collectives
#: tests run against a fake CuPy: the collectives parts run the real paths)
TEST_FILES = ["tests/testing/test_array_modules.py", "tests/kernels/test_kernels.py",
              "tests/kernels/test_gemm.py", "tests/kernels/test_cross_entropy_kernel.py",
              "tests/parallel/test_mixed_precision.py",
              "tests/kernels/test_fused_attention.py::test_fused_kernels_on_each_array_module",
              "tests/kernels/test_multi_tensor.py::test_multi_tensor_kernels_on_each_array_module",
              "tests/kernels/test_kernels_bfloat16.py::"
              "test_the_bfloat16_kernels_on_each_array_module"]
#: the autodiff ops whose float64 gradcheck and agreement with NumPy ``tests_1rank``
#: runs on CuPy: those with a device path of their own (a RawKernel, cuBLAS, a
#: scatter-add, the device attention). The others run the same array expressions
#: as on NumPy, which the CPU suite gradchecks; their kernels are CuPy's own.
DEVICE_OPS = ("cross_entropy", "softmax", "log_softmax", "causal_self_attention",
              "gqa_attention", "layer_norm", "rms_norm", "gelu", "swiglu", "dropout",
              "dropout_add", "embedding", "linear", "getitem", "masked_fill", "rope_qkv",
              "astype")
#: what ``tests_1rank`` runs on CuPy, counted (tests/test_gpu_scripts.py recounts it:
#: ``pytest --collect-only`` with TEST_FILES and :func:`test_selection`; ``tests`` are
#: those that run at one rank, the others wanting a sub-world of 2 to 4; and the
#: finite-difference evaluations, two per input element, of DEVICE_OPS' gradcheck
#: cases), and what it is expected to cost: start-up, each test's set-up and
#: compare, each evaluation (the op on the device, a host read)
TESTS_1RANK = {"collected": 100, "tests": 70, "fd_evaluations": 3204}
TEST_START_S, TEST_EACH_S, FD_EVALUATION_S = 10, 0.5, 0.002
PYTEST_FLAGS = ["-q", "-p", "no:cacheprovider", "--with-mpi", "--timeout=40",
                "--timeout-method=thread"]
ONE_GPU = ("one GPU: NCCL refuses two ranks on one GPU and the MPI wheel is not CUDA-aware, "
           "so NCCL and CUDA-aware MPI ran as groups of one rank only; beyond one rank they "
           "need two GPUs or a site MPI built with CUDA")


# == the plan ===================================================================

@dataclass
class Part:
    """One subprocess of the check: ``argv`` after the interpreter (and mpiexec)."""

    name: str
    what: str
    argv: list
    limit_s: int
    ranks: int = 1
    env: dict = field(default_factory=dict)
    skip: str | None = None      # why it does not run here
    pytest: bool = False         # counts come from its JUnit files
    result: bool = True          # writes JSON to TMP/NAME.json (--result or --json)
    gpu_only: bool = False       # needs CuPy (skipped in a rehearsal)
    expect_s: int = 0            # what it should take on a GPU, the kernels warmed
    sizing: str = ""             # how expect_s was counted

    @property
    def margin_s(self) -> int:
        """Seconds the part may overrun its expected ones before it is stopped: its limit
        less the expected seconds and the kill grace."""
        return self.limit_s - KILL_GRACE_S - self.expect_s


def test_selection(backend: str) -> list:
    """pytest's ``-k`` for ``tests_1rank``: the tests on ``backend`` (their ids name the
    array module), the op gradchecks only for :data:`DEVICE_OPS` (``expert_gelu`` and
    ``expert_swiglu`` contain two of the names and are left out)."""
    ops = " or ".join(DEVICE_OPS)
    return ["-k", f"{backend} and (not test_op_gradcheck or (({ops}) and not expert))"]


def tests_1rank_expect_s() -> int:
    """``tests_1rank``'s expected seconds from :data:`TESTS_1RANK`'s counts."""
    return round(TEST_START_S + TEST_EACH_S * TESTS_1RANK["tests"]
                 + FD_EVALUATION_S * TESTS_1RANK["fd_evaluations"])


def plan_parts(backend: str = "cupy") -> list:
    """The parts in the order they run (see the module docstring)."""
    me, tiny = PARTS, (["--tiny"] if backend == "numpy" else [])
    tests = {"MPISHARD_TEST_BACKENDS": backend}
    bench = [str(ROOT / "benchmarks/gpu.py"), "--backend", backend]
    bench += ["--tiny"] if backend == "numpy" else ["--warmup", "1", "--steps", "3",
                                                    "--batch-size", "4"]
    start = "5 s start (Python, CuPy, the CUDA context)"
    return [
        Part("env", "versions, MPI library and its float16 datatype, CuPy, CUDA, GPUs, NCCL",
             [me, "--part", "env"], 18, expect_s=5,
             sizing="imports and device queries, nothing compiled"),
        Part("collectives_1rank", "every collective at 1 rank on every path (shortcut, MPI "
             "staged, MPI CUDA-aware, NCCL, auto), float16 x4096, stream races",
             [me, "--part", "collectives", "--backend", backend], 30, expect_s=15,
             sizing=f"{start}; 4 paths x 3 dtypes x 2 sizes x 2 forms x 8 collectives "
             "(~400 small calls, ~3 s); NCCL's start ~3 s; 20 races of ~50 ms spins; "
             "~15 copy and fill kernels compiled, ~3 s (on an H100: 3.7 and 5.0 s)"),
        Part("warm_kernels", "the later parts' code on tiny models, side by side on the "
             "CPU cores: CuPy compiles their kernels once into CUPY_CACHE_DIR",
             [me, "--part", "warm", "--backend", backend, "--ops", ",".join(DEVICE_OPS)],
             49, expect_s=35,
             sizing="6 processes at once (GPT float32 against NumPy, float16 against "
             "float32, training, the benchmark's steps, the test ops in float64, fused "
             "attention at head size 64); the longest, the benchmark's float32 and float16 "
             "steps, compiles ~150 kernels at ~0.2 s: ~30 s and its start"),
        Part("gpt_vs_numpy", "a GPT step (2 layers, T=1024, C=768) on CuPy against NumPy",
             [me, "--part", "gpt", "--backend", backend, *tiny], 27, expect_s=14,
             env={"OMP_NUM_THREADS": "8", "OPENBLAS_NUM_THREADS": "8"},
             sizing=f"{start}; two 2-layer GPTs of 50304 x 768 built (~2 s); NumPy's two "
             "steps at 8 threads, ~0.3 TFLOP each (~5 s); the device's steps (< 1 s) with "
             "the kernels loaded from the cache (on an H100: 6.7 s)"),
        Part("float16_vs_float32", "float16 and bfloat16 mixed precision against float32: "
             "cosines > 0.999 (bfloat16's gradients > 0.99)",
             [me, "--part", "float16", "--backend", backend, *tiny], 25, expect_s=12,
             sizing=f"{start}; three GPTs built on the device, one float32 and one bfloat16 "
             "forward-backward and up to three float16 ones (< 4 s), kernels loaded"),
        Part("tests_1rank", f"the tests on {backend} of a subset of the suite, 1 rank",
             [*test_selection(backend), *TEST_FILES], 64, env=tests, pytest=True,
             result=False, expect_s=tests_1rank_expect_s(),
             sizing=f"{TESTS_1RANK['tests']} tests that run at 1 rank (of "
             f"{TESTS_1RANK['collected']}) x {TEST_EACH_S} s and "
             f"{TESTS_1RANK['fd_evaluations']:,} finite-difference evaluations x "
             f"{FD_EVALUATION_S * 1e3:.0f} ms (float64 gradchecks of {len(DEVICE_OPS)} ops "
             f"with a device path; all 79 cases: 5,492), {TEST_START_S} s start, kernels "
             "loaded"),
        Part("staging_2ranks", "collectives on CuPy arrays over 2 ranks through pinned staging, "
             "a producer race, what comm_backend='auto' picks", [me, "--part", "mpi"], 25, 2,
             {"MPISHARD_CUDA_AWARE": "0"}, gpu_only=True, expect_s=12,
             sizing=f"mpiexec's start and two ranks' {start}; the collectives of "
             "collectives_1rank staged through host memory (~5 s); 4 races (on an H100: "
             "1.7 s)"),
        Part("train_check", "training end to end: float32, float16, activation checkpointing",
             [str(ROOT / "scripts/gpu_train_check.py"), "--backend", backend], 20,
             expect_s=7, sizing=f"{start}; 3 runs x 30 steps of a 2-layer width-64 GPT, "
             "~15 ms a step, kernels loaded (on an H100: 2.8 s)"),
        Part("bench_single", "GPT-2 small, 1 rank: tokens/s, MFU; loss falls, <= 1 float16 skip",
             bench, 52, expect_s=35,
             sizing=f"{start}; GPT-2 small built twice (124M parameters, ~3 s each); per "
             "precision 4 steps at batch 4 x 1024 (~0.5 s each) and a profiled one; the "
             "activation measurement, twice; kernels loaded"),
        Part("attention", "fused attention (MPISHARD_ATTENTION=fused) against the batched "
             "products at GPT-2 small's shape: equal, ms each way, bytes kept",
             [str(ROOT / "benchmarks/attention.py"),
              *(["--backend", "strict", "--tiny"] if backend == "numpy" else [])], 25,
             expect_s=12, sizing=f"{start}; 2 dtypes x 5 runs x 2 paths, each well under "
             "a second at batch 8 x 12 heads x 1024; the fused kernels loaded (warmed at "
             "head size 64; on an H100: 4.4 s)"),
        Part("bench_zero3_2ranks", "ZeRO-3 at 2 ranks: CuPy pool bytes within 10% of the planner",
             bench + ["--part", "zero3"], 40, 2, expect_s=25,
             sizing=f"mpiexec's start and two ranks' {start}; GPT-2 small sharded twice; "
             "4 steps per precision with the gathers staged through host memory; ZeRO-3's "
             "own kernels (few) compiled here"),
        Part("bench_scaling", "GPT-2 small, 1 rank, fused attention: step and issue seconds "
             "at batch 1, 2, 4, 8 (host- or device-bound)",
             [str(ROOT / "benchmarks/gpu.py"), "--backend", backend, "--part", "scaling",
              *(["--tiny"] if backend == "numpy" else ["--warmup", "1", "--steps", "3"])],
             35, env={"MPISHARD_ATTENTION": "fused"}, expect_s=20,
             sizing=f"{start}; GPT-2 small built twice (float16, bfloat16; ~3 s each); per "
             "precision 4 batches x 4 steps of at most ~0.1 s; kernels loaded"),
    ]


def plan_total(parts: list) -> int:
    """Seconds the plan may take: its parts' limits and the runner's slack."""
    return sum(p.limit_s for p in parts) + RUNNER_SLACK_S


def format_plan(parts: list, kernel_cache: str | None = None) -> str:
    """The plan as the dry run prints it: a row per part (ranks, expected seconds,
    limit, margin), the runner, the total; then how each part was sized."""
    width = max(len(p.name) for p in parts)
    lines = [f"{'part':<{width}}  ranks  expect  limit  margin  what"]
    lines += [f"{p.name:<{width}}  {p.ranks:>5}  {p.expect_s:>5}s  {p.limit_s:>4}s  "
              f"{p.margin_s:>5}s  {p.what}" for p in parts]
    lines.append(f"{'runner':<{width}}  {'':>5}  {'':>6}  {RUNNER_SLACK_S:>4}s  {'':>6}  "
                 f"start, JSON, mpiexec")
    expect, total = sum(p.expect_s for p in parts), plan_total(parts)
    lines.append(f"{'total':<{width}}  {'':>5}  {expect:>5}s  {total:>4}s  "
                 f"{sum(p.margin_s for p in parts):>5}s  (at most {TOTAL_LIMIT_S} s; margin: "
                 f"the limit less the expected seconds and the {KILL_GRACE_S} s kill grace)")
    lines.append("")
    if kernel_cache:
        lines.append(f"every part: CUPY_CACHE_DIR={kernel_cache}")
    lines.append("how each part's expected seconds were counted:")
    lines += [f"  {p.name}: {p.sizing}" for p in parts]
    return "\n".join(lines)


# == running one part ============================================================

def junit_counts(files: list) -> dict:
    """Per-rank and total test counts from pytest's JUnit files; failed test ids."""
    per_rank, failed = {}, []
    for path in sorted(files):
        rank = path.name.rsplit(".rank", 1)[-1].split(".")[0]
        counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
        for suite in ET.parse(path).getroot().iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
        for case in ET.parse(path).getroot().iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                failed.append({"rank": int(rank),
                               "test": f"{case.get('classname')}::{case.get('name')}",
                               "message": (bad.get("message") or "")[:300]})
        counts["passed"] = (counts["tests"] - counts["failures"] - counts["errors"]
                            - counts["skipped"])
        per_rank[rank] = counts
    totals = {k: sum(c[k] for c in per_rank.values())
              for k in ("tests", "passed", "failures", "errors", "skipped")}
    return {"ranks": per_rank, "totals": totals, "failed": failed}


def _stop(proc) -> None:
    """End the part's process group: SIGINT, SIGTERM, SIGKILL (within KILL_GRACE_S)."""
    for sig, grace in ((signal.SIGINT, 4), (signal.SIGTERM, 2), (signal.SIGKILL, 2)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_part(part: Part, ctx: dict, remaining: float, log) -> dict:
    """Run one part within ``min(limit, remaining)`` seconds; the record for the JSON."""
    record = {"name": part.name, "what": part.what, "ranks": part.ranks,
              "limit_s": part.limit_s, "expect_s": part.expect_s}
    if part.skip:
        return {**record, "status": "skipped", "reason": part.skip}
    limit = int(min(part.limit_s, remaining))
    if limit < KILL_GRACE_S + 5:
        return {**record, "status": "not_run", "reason": "the time budget is spent"}
    if part.ranks > 1 and not ctx["mpiexec"]:
        return {**record, "status": "failed", "reason": "no mpiexec: bring the mpich wheel "
                "(scripts/fetch_gpu_wheels.sh) or put one on PATH"}
    tmp = ctx["tmp"]
    result_file = tmp / f"{part.name}.json"
    argv = list(part.argv)
    if part.pytest:
        argv = [PARTS, "--part", "pytest", "--junit", str(tmp / part.name), "--",
                *PYTEST_FLAGS, *argv]
    elif part.result:
        argv += ["--json" if "benchmarks" in argv[0] else "--result", str(result_file)]
    command = [sys.executable, *argv]
    if part.ranks > 1:
        command = [ctx["mpiexec"], "-n", str(part.ranks), *ctx["mpi_flags"], sys.executable,
                   "-m", "mpi4py", *argv]
    record.update(command=command, timeout_s=limit)
    print(f"gpu_check: {part.name} ({part.what}), up to {limit} s ...", flush=True)
    log.write(f"\n===== {part.name}: {' '.join(command)}\n")
    log.flush()
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1",
                                     **ctx.get("env", {}), **part.env},
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=max(limit - KILL_GRACE_S, 1))
            status = "passed" if returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            _stop(proc)
            returncode, status = None, "timeout"
        with contextlib.suppress(ProcessLookupError):  # ranks mpiexec left behind
            os.killpg(proc.pid, signal.SIGKILL)
        out.seek(0)
        text = out.read()
    log.write(text)
    log.flush()
    seconds = round(time.monotonic() - started, 1)
    record.update(status=status, returncode=returncode, seconds=seconds,
                  over_expected=seconds > part.expect_s, log_tail=text.splitlines()[-25:])
    if part.pytest:
        files = list(tmp.glob(f"{part.name}.rank*.xml"))
        record["tests"] = junit_counts(files) if files else None
        if status == "passed" and (not files or record["tests"]["totals"]["passed"] == 0):
            record["status"] = "failed"
            record["reason"] = "pytest exited 0 but no test passed"
    if result_file.exists():
        record["result"] = json.loads(result_file.read_text())
        if record["result"].get("status") == "skipped" and status == "passed":
            record.update(status="skipped", reason=record["result"].get("reason"))
    print(f"gpu_check: {part.name}: {record['status']} in {record['seconds']} s", flush=True)
    return record


def find_mpiexec(explicit: str | None) -> str | None:
    for candidate in (explicit, os.environ.get("MPIEXEC"),
                      str(Path(sys.executable).parent / "mpiexec"), shutil.which("mpiexec")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


# == the report ==================================================================

def highlights(parts: list) -> dict:
    """The figures a reader looks for first, pulled out of the parts' results."""
    found = {}
    for part in parts:
        result = part.get("result") or {}
        name = part["name"]
        if name == "env":
            found["mpi_float16_datatype"] = result.get("mpi_float16_datatype")
            found["tensor_core_attention"] = result.get("tensor_core_attention")
        elif name == "collectives_1rank":
            found["paths"] = {k: v.get("how") for k, v in result.get("paths", {}).items()}
            found["paths_skipped"] = result.get("skipped")
        elif name == "gpt_vs_numpy" or name == "float16_vs_float32":
            found[name] = {k: v for k, v in result.items() if k != "config"}
        elif name == "staging_2ranks":
            found["auto_on_2ranks"] = result.get("auto")
        elif name == "bench_single":
            found["single"] = [{k: run.get(k) for k in ("precision", "tokens_per_s", "mfu",
                                                        "step_s_median", "skipped_steps")}
                               for run in result.get("runs", [])]
        elif name == "attention":
            found[name] = [{k: v for k, v in run.items()} for run in result.get("runs", [])]
        elif name == "bench_scaling":
            found[name] = [{k: run.get(k) for k in ("precision", "batch_size", "step_s",
                                                    "issue_s", "mfu")}
                           for run in result.get("runs", [])]
        elif name == "bench_zero3_2ranks":
            found[name] = [{"precision": run["precision"],
                            "plan_model_state_bytes": run["plan"]["model_state_bytes"],
                            "measured_over_plan": [r.get("measured_over_plan")
                                                   for r in run["ranks"]]}
                           for run in result.get("runs", [])]
        elif part.get("tests"):
            found[name] = part["tests"]["totals"]
    return found


def _files(folder: Path) -> int:
    """Files in ``folder`` (CuPy's kernel cache keeps one per compiled kernel)."""
    return sum(1 for _ in folder.iterdir()) if folder.is_dir() else 0


def write_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(path)


def _stop_reason(env: dict, rehearse: bool) -> str | None:
    facts = env.get("result", {})
    if env["status"] != "passed":
        return "the environment probe failed (see parts[0].log_tail)"
    if rehearse:
        return None
    if not facts.get("cupy"):
        return (f"CuPy does not import ({facts.get('cupy_error')}); this check needs a GPU "
                f"machine with CuPy (pip install 'mpishard[cuda13]'), or --rehearse")
    if not facts.get("gpus"):
        return f"CuPy sees no GPU ({facts.get('gpu_error', 'getDeviceCount() == 0')})"
    return None


def run_all(args) -> int:
    started = time.monotonic()
    parts = plan_parts("numpy" if args.rehearse else "cupy")
    report = {"mode": "rehearsal (NumPy, no GPU): checks the runner and the parts' code, not "
              "the GPU" if args.rehearse else "gpu", "status": "running",
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "budget_s": args.budget,
              "plan": [{"name": p.name, "limit_s": p.limit_s, "expect_s": p.expect_s,
                        "margin_s": p.margin_s, "ranks": p.ranks} for p in parts],
              "wheels_installed": os.environ.get("GPU_CHECK_INSTALLED", "none"),
              "notes": [], "parts": []}
    log_path = args.json.with_suffix(".log")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp, open(log_path, "w") as log:
        ctx = {"tmp": Path(tmp), "mpiexec": find_mpiexec(args.mpiexec), "mpi_flags": [],
               "env": {"CUPY_CACHE_DIR": str(args.kernel_cache)}}
        args.kernel_cache.mkdir(parents=True, exist_ok=True)
        report["kernel_cache"] = {"dir": str(args.kernel_cache),
                                  "files_at_start": _files(args.kernel_cache)}
        env = run_part(parts[0], ctx, args.budget, log)
        facts = env.get("result", {})
        report.update(environment=facts, mpiexec=ctx["mpiexec"])
        report["parts"].append(env)
        if "Open MPI" in str(facts.get("mpi_vendor")):
            ctx["mpi_flags"] = ["--oversubscribe", "--allow-run-as-root"]
        reason = _stop_reason(env, args.rehearse)
        if reason:
            report.update(status="failed", reason=reason,
                          seconds=round(time.monotonic() - started, 1))
            write_report(args.json, report)
            print(f"gpu_check: FAILED: {reason}\ngpu_check: report in {args.json}", flush=True)
            return 2
        if args.rehearse:
            report["notes"].append("Rehearsal: every part ran on NumPy; no GPU path was checked.")
        elif facts["gpus"] < 2:
            report["notes"].append(f"{ONE_GPU}.")
        for part in parts[1:]:
            if args.only and part.name not in args.only:
                continue
            if args.rehearse and part.gpu_only:
                part.skip = "rehearsal: needs CuPy and a GPU"
            remaining = args.budget - (time.monotonic() - started)
            report["parts"].append(run_part(part, ctx, remaining, log))
            report["highlights"] = highlights(report["parts"])
            write_report(args.json, report)
    bad = [p["name"] for p in report["parts"] if p["status"] not in ("passed", "skipped")]
    report["kernel_cache"]["files_at_end"] = _files(args.kernel_cache)
    report.update(status="failed" if bad else "passed", failed_parts=bad,
                  seconds=round(time.monotonic() - started, 1))
    write_report(args.json, report)
    width = max(len(p["name"]) for p in report["parts"])
    for p in report["parts"]:
        counts = (p.get("tests") or {}).get("totals")
        extra = p.get("reason") or (f"tests {counts}" if counts else "")
        print(f"  {p['name']:<{width}}  {p['status']:<8} {p.get('seconds', ''):>6}  {extra}")
    print(f"gpu_check: {report['status'].upper()}"
          f"{' (REHEARSAL: the GPU check itself is still owed)' if args.rehearse else ''} in "
          f"{report['seconds']} s; report {args.json}, log {log_path}", flush=True)
    return 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan (parts, limits, total) and exit; runs nothing")
    parser.add_argument("--rehearse", action="store_true",
                        help="no GPU: run the runner and the parts on NumPy (tiny models)")
    parser.add_argument("--json", type=Path, default=None,
                        help="report path (default $OUT/gpu_check.json, else runs/gpu_check.json)")
    parser.add_argument("--budget", type=float, default=float(TOTAL_LIMIT_S),
                        help=f"seconds for all parts together (default {TOTAL_LIMIT_S})")
    parser.add_argument("--only", type=lambda s: s.split(","), default=None,
                        help="comma-separated part names (the environment probe always runs)")
    parser.add_argument("--mpiexec", default=None, help="default: $MPIEXEC, beside python, PATH")
    parser.add_argument("--kernel-cache", type=Path, default=None,
                        help="CUPY_CACHE_DIR of every part (default $CUPY_CACHE_DIR, else "
                             "cupy_kernel_cache beside the report): the warm part compiles "
                             "into it, the others and any rerun load from it")
    args = parser.parse_args(argv)
    if args.json is None:
        out = os.environ.get("OUT")
        args.json = Path(out) / "gpu_check.json" if out else ROOT / "runs" / "gpu_check.json"
    if args.kernel_cache is None:
        cache = os.environ.get("CUPY_CACHE_DIR")
        args.kernel_cache = Path(cache) if cache else args.json.parent / "cupy_kernel_cache"
    args.kernel_cache = args.kernel_cache.resolve()
    if args.dry_run:
        parts = plan_parts("numpy" if args.rehearse else "cupy")
        print(format_plan(parts, str(args.kernel_cache)), flush=True)
        return 0 if plan_total(parts) <= TOTAL_LIMIT_S else 1
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())

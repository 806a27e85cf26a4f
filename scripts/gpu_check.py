"""The GPU check: run every GPU path of mpishard, each part under a time limit, into one JSON.

    scripts/gpu_check.sh                      # the entry point: wheels, then this runner
    python scripts/gpu_check.py --json runs/gpu_check.json [--budget 440] [--only a,b]
    python scripts/gpu_check.py --dry-run     # no GPU: the runner itself, on NumPy

The runner never imports MPI; each part is a subprocess (``mpiexec -n N`` for
several ranks, which share the visible GPUs), killed with its process group at
its limit. A part that fails or times out is recorded and the next one runs;
the exit status is 0 only when every part passed or was skipped for a stated
reason (2 when CuPy or a GPU is missing: nothing ran). The parts, in order:
environment, the CuPy test suite at 1 rank, pinned staging and the CUDA-aware
branches, NCCL as a group of size 1 (NCCL refuses two ranks on one GPU), the
benchmark (benchmarks/gpu.py), its 16-bit dtype probe, the test suite at 2 and
4 ranks, ZeRO-3 memory at 2 and 4 ranks, MPI collectives on device arrays
through host staging at 2 ranks, training end to end (scripts/gpu_train_check.py
and ``mpishard train``).

The checks themselves are in scripts/gpu_parts.py (``--part``), one process each.
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

TEST_FILES = ["tests/test_array_modules.py", "tests/test_comm_gpu.py",
              "tests/test_comm_staging.py", "tests/test_backend.py",
              "tests/test_mixed_precision.py",
              "tests/test_activation_checkpointing.py::"
              "test_every_array_module_bit_identical_and_halved"]
PYTEST_FLAGS = ["-q", "-p", "no:cacheprovider", "--with-mpi", "--timeout=150",
                "--timeout-method=thread"]
sys.path.insert(0, str(ROOT / "scripts"))
from gpu_parts import ONE_GPU_NCCL  # noqa: E402  (the parts file imports no MPI at the top)


# == the runner =================================================================

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


def plan_parts(facts: dict, dry_run: bool) -> list:
    """The parts in the order they run (see the module docstring)."""
    me = PARTS
    backend = "numpy" if dry_run else "cupy"
    tests = {"MPISHARD_TEST_BACKENDS": backend}
    no_gpu = "dry run: needs CuPy and a GPU" if dry_run else None
    gpus = facts.get("gpus", 0)
    nccl_ok, nccl_why = facts.get("nccl", (False, "unknown"))
    aware, aware_how = facts.get("cuda_aware", (False, "unknown"))
    bench = [str(ROOT / "benchmarks/gpu.py"), "--backend", backend]
    bench += ["--tiny"] if dry_run else []
    train = [str(ROOT / "scripts/gpu_train_check.py"), "--backend", backend]
    cli = ["-m", "mpishard", "train", "--backend", backend, "--strategy", "zero3", "--steps", "5",
           "--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--block-size", "64",
           "--batch-size", "4", "--max-bytes", "200000", "--eval-batches", "1",
           "--progress", "false", "--precision", "float16", "--activation-checkpointing", "true"]
    return [
        Part("tests_1rank", f"the test suite on {backend}, 1 rank", TEST_FILES, 150, env=tests,
             pytest=True, result=False),
        Part("comm_1rank", "pinned staging, DevicePath branches, size-1 collectives",
             [me, "--part", "single"], 60, skip=no_gpu),
        Part("nccl_1rank", "NCCL group of size 1", [me, "--part", "nccl1"], 60,
             skip=no_gpu or (None if nccl_ok else f"NCCL unavailable: {nccl_why}")),
        Part("bench_single", "GPT-2 small, 1 rank: tokens/s, MFU, activations", bench, 150),
        Part("dtypes", "float16/bfloat16: what runs, matmul TFLOP/s", bench + ["--part", "dtypes"],
             60),
        Part("tests_2ranks", f"the test suite on {backend}, 2 ranks", TEST_FILES, 120, 2,
             tests, pytest=True, result=False),
        Part("tests_4ranks", f"the test suite on {backend}, 4 ranks", TEST_FILES, 150, 4,
             tests, pytest=True, result=False),
        Part("bench_zero3_2ranks", "ZeRO-3 memory per rank vs the planner, 2 ranks",
             bench + ["--part", "zero3"], 100, 2),
        Part("bench_zero3_4ranks", "ZeRO-3 memory per rank vs the planner, 4 ranks",
             bench + ["--part", "zero3"], 120, 4),
        Part("comm_mpi_staged_2ranks", "collectives on CuPy arrays through pinned host staging",
             [me, "--part", "mpi"], 60, 2, {"MPISHARD_CUDA_AWARE": "0"}, skip=no_gpu),
        Part("comm_mpi_aware_2ranks", "collectives on CuPy arrays handed to CUDA-aware MPI",
             [me, "--part", "mpi"], 60, 2, skip=no_gpu or (
                 None if aware else f"MPI is not CUDA-aware ({aware_how}): same as staged")),
        Part("nccl_2ranks", "collectives over NCCL, 2 ranks on 2 GPUs", [me, "--part", "nccl"],
             60, 2, skip=no_gpu or (None if gpus >= 2 and nccl_ok else ONE_GPU_NCCL)),
        Part("train_check", "training end to end: float32, float16, activation checkpointing",
             train, 90),
        Part("train_cli_zero3_2ranks", "mpishard train: ZeRO-3, float16, activation "
             "checkpointing, 2 ranks", cli, 90, 2,
             result=False),
    ]


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


def run_part(part: Part, ctx: dict, remaining: float, log) -> dict:
    """Run one part under ``min(limit, remaining)`` seconds; the record for the JSON."""
    record = {"name": part.name, "what": part.what, "ranks": part.ranks}
    if part.skip:
        return {**record, "status": "skipped", "reason": part.skip}
    if remaining < 30:
        return {**record, "status": "not_run", "reason": "the time budget is spent"}
    if part.ranks > 1 and not ctx["mpiexec"]:
        return {**record, "status": "failed", "reason": "no mpiexec: bring the mpich wheel "
                "(scripts/fetch_gpu_wheels.sh) or put one on PATH"}
    tmp = ctx["tmp"]
    result_file = tmp / f"{part.name}.json"
    argv = list(part.argv)
    if part.pytest:
        argv = [PARTS, "--part", "pytest", "--junit",
                str(tmp / part.name), "--", *PYTEST_FLAGS, *argv]
    elif part.result:
        argv += ["--json" if "benchmarks" in argv[0] else "--result", str(result_file)]
    command = [sys.executable, *argv]
    if part.ranks > 1:
        command = [ctx["mpiexec"], "-n", str(part.ranks), *ctx["mpi_flags"], sys.executable,
                   "-m", "mpi4py", *argv]
    limit = int(min(part.limit_s, remaining - 20))  # a timeout takes up to 15 s more to end
    record.update(command=command, timeout_s=limit)
    print(f"gpu_check: {part.name} ({part.what}), up to {limit} s ...", flush=True)
    log.write(f"\n===== {part.name}: {' '.join(command)}\n")
    log.flush()
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **part.env},
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=limit)
            status = "passed" if returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            # SIGINT first: pytest then still writes its JUnit file (the tests so far)
            for sig, grace in ((signal.SIGINT, 10), (signal.SIGTERM, 5), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)  # the process group this part started
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            returncode, status = None, "timeout"
        with contextlib.suppress(ProcessLookupError):  # ranks mpiexec left behind
            os.killpg(proc.pid, signal.SIGKILL)
        out.seek(0)
        text = out.read()
    log.write(text)
    log.flush()
    record.update(status=status, returncode=returncode,
                  seconds=round(time.monotonic() - started, 1),
                  log_tail=text.splitlines()[-25:])
    if part.pytest:
        files = list(tmp.glob(f"{part.name}.rank*.xml"))
        record["tests"] = junit_counts(files) if files else None
        if status == "passed" and (not files or record["tests"]["totals"]["passed"] == 0):
            record["status"] = "failed"
            record["reason"] = "pytest exited 0 but no test passed"
    if result_file.exists():
        record["result"] = json.loads(result_file.read_text())
    print(f"gpu_check: {part.name}: {record['status']} in {record['seconds']} s", flush=True)
    return record


def find_mpiexec(explicit: str | None) -> str | None:
    for candidate in (explicit, os.environ.get("MPIEXEC"),
                      str(Path(sys.executable).parent / "mpiexec"), shutil.which("mpiexec")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def highlights(parts: list) -> dict:
    """The figures a reader looks for first, pulled out of the parts' results."""
    found = {}
    for part in parts:
        result = part.get("result") or {}
        if part["name"] == "bench_single":
            found["single"] = [{k: run.get(k) for k in ("precision", "tokens_per_s", "mfu",
                                                        "step_s_median", "skipped_steps")}
                               for run in result.get("runs", [])]
            found["activations"] = result.get("activations")
        elif part["name"].startswith("bench_zero3"):
            found[part["name"]] = [{"precision": run["precision"],
                                    "plan_model_state_bytes": run["plan"]["model_state_bytes"],
                                    "ranks": [{k: r.get(k) for k in (
                                        "rank", "model_state_bytes", "model_state_over_plan",
                                        "pool_used_bytes", "pool_total_bytes")}
                                        for r in run["ranks"]]}
                                   for run in result.get("runs", [])]
        elif part.get("tests"):
            found[part["name"]] = part["tests"]["totals"]
    return found


def write_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(path)


def run_all(args) -> int:
    started = time.monotonic()
    report = {"mode": "dry-run (NumPy, no GPU): checks the runner, not the GPU paths"
              if args.dry_run else "gpu", "status": "running",
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "budget_s": args.budget,
              "wheels_installed": os.environ.get("GPU_CHECK_INSTALLED", "none"),
              "notes": [], "parts": []}
    log_path = args.json.with_suffix(".log")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp, open(log_path, "w") as log:
        ctx = {"tmp": Path(tmp), "mpiexec": find_mpiexec(args.mpiexec), "mpi_flags": []}
        env = run_part(Part("env", "what this machine has", [PARTS, "--part", "env"], 60),
                       ctx, args.budget, log)
        facts = env.get("result", {})
        report.update(environment=facts, mpiexec=ctx["mpiexec"])
        report["parts"].append(env)
        if "Open MPI" in str(facts.get("mpi_vendor")):
            ctx["mpi_flags"] = ["--oversubscribe", "--allow-run-as-root"]
        reason = None
        if env["status"] != "passed":
            reason = "the environment probe failed (see parts[0].log_tail)"
        elif not args.dry_run and not facts.get("cupy"):
            reason = (f"CuPy does not import ({facts.get('cupy_error')}); this check needs a "
                      f"GPU machine with CuPy (pip install 'mpishard[cuda13]'), or --dry-run")
        elif not args.dry_run and not facts.get("gpus"):
            reason = f"CuPy sees no GPU ({facts.get('gpu_error', 'getDeviceCount() == 0')})"
        if reason:
            report.update(status="failed", reason=reason,
                          seconds=round(time.monotonic() - started, 1))
            write_report(args.json, report)
            print(f"gpu_check: FAILED: {reason}\ngpu_check: report in {args.json}", flush=True)
            return 2
        if args.dry_run:
            report["notes"].append("Dry run: every part ran on NumPy; no GPU path was checked.")
        else:
            if facts["gpus"] < 2:
                report["notes"].append(f"NCCL: {ONE_GPU_NCCL}.")
            report["notes"].append(f"Ranks of the multi-rank parts share {facts['gpus']} "
                                   f"GPU(s). CUDA-aware MPI: {facts.get('cuda_aware')}.")
        for part in plan_parts(facts, args.dry_run):
            if args.only and part.name not in args.only:
                continue
            remaining = args.budget - (time.monotonic() - started)
            report["parts"].append(run_part(part, ctx, remaining, log))
            report["highlights"] = highlights(report["parts"])
            write_report(args.json, report)
    bad = [p["name"] for p in report["parts"] if p["status"] not in ("passed", "skipped")]
    report.update(status="failed" if bad else "passed", failed_parts=bad,
                  seconds=round(time.monotonic() - started, 1))
    write_report(args.json, report)
    width = max(len(p["name"]) for p in report["parts"])
    for p in report["parts"]:
        counts = (p.get("tests") or {}).get("totals")
        extra = p.get("reason") or (f"tests {counts}" if counts else "")
        print(f"  {p['name']:<{width}}  {p['status']:<8} {p.get('seconds', ''):>6}  {extra}")
    print(f"gpu_check: {report['status'].upper()}"
          f"{' (DRY RUN: the GPU check itself is still owed)' if args.dry_run else ''} in "
          f"{report['seconds']} s; report {args.json}, log {log_path}", flush=True)
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None,
                        help="report path (default $OUT/gpu_check.json, else runs/gpu_check.json)")
    parser.add_argument("--budget", type=float, default=440.0,
                        help="seconds for all parts together (default 440)")
    parser.add_argument("--only", type=lambda s: s.split(","), default=None,
                        help="comma-separated part names (the environment probe always runs)")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: run the runner on NumPy (tiny benchmark, NumPy tests)")
    parser.add_argument("--mpiexec", default=None, help="default: $MPIEXEC, beside python, PATH")
    args = parser.parse_args()
    if args.json is None:
        out = os.environ.get("OUT")
        args.json = Path(out) / "gpu_check.json" if out else ROOT / "runs" / "gpu_check.json"
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())

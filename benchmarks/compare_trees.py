"""The same benchmark workers from two source trees, interleaved: did a change slow it down?

    git worktree add /tmp/before HEAD~5        # or any checkout of the old code
    python benchmarks/compare_trees.py /tmp/before .                      # both benchmarks
    python benchmarks/compare_trees.py /tmp/before . --only step --rounds 6

Runs ``benchmarks/step.py``'s one-process worker (GPT config S, forward,
backward, AdamW, 1 BLAS thread) and ``benchmarks/strategies.py``'s mpishard
workers (DDP and ZeRO-1/2/3 at 2 and 4 ranks) from each tree's own copy of the
scripts, so each tree runs its own code. Rounds alternate the order of the trees
so machine load hits both alike; medians are over every timed step of every
round. Prints progress on stderr and one JSON line on stdout: per benchmark the
median step seconds of each tree and the ratio ``after / before`` (1.00: no
change; above: slower).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def _env(tree: Path) -> dict:
    # as a user runs it: no launcher variables, and OpenBLAS picks its own kernel
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "PMIX_", "HYDRA_", "MPI_"))
           and k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(tree))
    return env


def _times(cmd: list, tree: Path, marker: str | None) -> list:
    out = subprocess.run(cmd, env=_env(tree), cwd=tree, capture_output=True, text=True,
                         timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    if marker:
        lines = [ln[len(marker):] for ln in lines if ln.startswith(marker)]
    return json.loads(lines[-1])["times"]


def _blas_kernel(tree: Path) -> str:
    """The BLAS and the kernel it picked in a worker's environment (threadpoolctl's view)."""
    code = ("import numpy, threadpoolctl; print(', '.join(f\"{i['internal_api']} "
            "{i.get('architecture')}\" for i in threadpoolctl.threadpool_info()))")
    out = subprocess.run([sys.executable, "-c", code], env=_env(tree), capture_output=True,
                         text=True, timeout=120)
    return out.stdout.strip() or f"unknown ({out.stderr.strip()[-200:]})"


def _step_cmd(tree: Path, steps: int, warmup: int) -> tuple:
    return ([sys.executable, str(tree / "benchmarks" / "step.py"), "--worker", "mpishard",
             "--threads", "1", "--steps", str(steps), "--warmup", str(warmup)], None)


def _strategy_cmd(tree: Path, impl: str, ranks: int, steps: int, warmup: int) -> tuple:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    return ([str(mpiexec), "-n", str(ranks), sys.executable, "-m", "mpi4py",
             str(tree / "benchmarks" / "strategies.py"), "--worker", f"mpishard-{impl}",
             "--steps", str(steps), "--warmup", str(warmup)], "RESULT ")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, help="source tree of the old code")
    parser.add_argument("after", type=Path, help="source tree of the new code")
    parser.add_argument("--only", choices=["step", "strategies"], help="one benchmark only")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per worker")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--impls", default="ddp,zero1,zero2,zero3")
    args = parser.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}

    cases = {}
    if args.only in (None, "step"):
        cases["step (1 process, 1 thread)"] = lambda t: _step_cmd(t, args.steps, args.warmup)
    if args.only in (None, "strategies"):
        for ranks in (int(r) for r in args.ranks.split(",")):
            for impl in args.impls.split(","):
                cases[f"{impl} at {ranks} ranks"] = (
                    lambda t, impl=impl, ranks=ranks: _strategy_cmd(t, impl, ranks, args.steps,
                                                                    args.warmup))
    times = {case: {name: [] for name in trees} for case in cases}
    for rnd in range(args.rounds):
        order = list(trees) if rnd % 2 == 0 else list(trees)[::-1]
        for case, make in cases.items():
            for name in order:
                cmd, marker = make(trees[name])
                got = _times(cmd, trees[name], marker)
                times[case][name] += got
                print(f"round {rnd + 1}/{args.rounds} {case:<28} {name:<6} median "
                      f"{statistics.median(got):.3f} s", file=sys.stderr, flush=True)
    result = {"benchmark": "compare_trees", "before": str(trees["before"]),
              "after": str(trees["after"]), "load_avg_1min": round(os.getloadavg()[0], 2),
              "blas": _blas_kernel(trees["after"]),
              "cases": {}}
    for case, by_tree in times.items():
        med = {name: statistics.median(t) for name, t in by_tree.items()}
        result["cases"][case] = {"before_s": round(med["before"], 4),
                                 "after_s": round(med["after"], 4),
                                 "ratio_after_over_before": round(med["after"] / med["before"], 3),
                                 "steps_timed": len(by_tree["after"])}
        print(f"{case:<28} before {med['before']:.3f} s  after {med['after']:.3f} s  "
              f"ratio {med['after'] / med['before']:.3f}", file=sys.stderr)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""Checkpoints that do not stall training: step time with none, synchronous and
background (``--checkpoint-async``) checkpoints, side by side in one run.

    python benchmarks/checkpoint_async.py                  # 50 steps, a save every 5
    python benchmarks/checkpoint_async.py --rounds 3 --dir /scratch/me/bench

One rank with one BLAS thread, so that a second core is free for the writer, as
a GPU run leaves its host's cores free. The model (GPT, 8 layers of 768 wide,
float32, about 57M parameters, 0.65 GiB of parameters and AdamW state) is big
and its batch small (1 x 32 tokens), so that one save takes several steps' time.
Each of the three modes runs ``--steps`` steps in a fresh process of its own
(the modes alternate for ``--rounds`` rounds, so they share the machine's
load), through the same ``Trainer`` that ``mpishard train`` uses; the time of
a step is its wall time including any save made at its end. The background
mode's wait for its last write, after the last step, is printed apart. The
environment's ``OPENBLAS_CORETYPE`` / ``OPENBLAS_L2_SIZE`` are unset (as a
user's run would be) and the kernel OpenBLAS picks is printed. Prints a table
and one JSON line; the target is background <= 1.10 x none.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("none", "sync", "async")
MODEL = {"n_layer": 8, "n_embd": 768, "n_head": 12, "block_size": 32, "batch_size": 1}


def _child(mode: str, steps: int, interval: int, folder: str) -> dict:
    """One mode in this process: per-step wall times (s), save count, final wait (s)."""
    sys.path.insert(0, str(ROOT))
    from mpi4py import MPI

    from mpishard.comm import Communicator
    from mpishard.config.sections import load_config
    from mpishard.run.train import Trainer

    overrides = {**MODEL, "steps": steps, "max_bytes": 200_000, "eval_batches": 1,
                 "progress": False, "checkpoint_dir": "" if mode == "none" else folder,
                 "checkpoint_interval": interval, "checkpoint_async": mode == "async",
                 "keep_last": 2}
    world = Communicator(MPI.COMM_WORLD)
    trainer = Trainer(load_config(None, overrides), world)
    trainer.build()
    trainer.run_step()                       # the first step pays for first-touch memory
    times, saves = [], 0
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.run_step()
        if mode != "none" and trainer.steps_done % interval == 0:
            trainer.save()
            saves += 1
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    if trainer.saver is not None:
        trainer.saver.close()
    wait = time.perf_counter() - t0
    params = sum(p.size for p in trainer.strategy.pieces() if p.owner)
    return {"times": times, "saves": saves, "final_wait_s": wait, "params": params}


def _blas_kernel(env: dict) -> str:
    code = ("import numpy, threadpoolctl; print(', '.join(f\"{i['internal_api']} "
            "{i.get('architecture')}\" for i in threadpoolctl.threadpool_info()))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True)
    return out.stdout.strip() or "unknown (threadpoolctl missing)"


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--interval", type=int, default=5, help="steps between checkpoints")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a "
                        "temporary folder on the disk of /tmp)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        Path(args.out).write_text(json.dumps(_child(args.child, args.steps, args.interval,
                                                    args.dir)))
        return
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=str(ROOT))
    base = Path(tempfile.mkdtemp(prefix="mpishard-async-", dir=args.dir))
    results: dict = {mode: [] for mode in MODES}
    try:
        for r in range(args.rounds):
            for mode in MODES:
                folder = base / f"{mode}-{r}"
                out = base / f"{mode}-{r}.json"
                child = subprocess.run([sys.executable, __file__, "--child", mode, "--steps",
                                        str(args.steps), "--interval", str(args.interval),
                                        "--dir", str(folder), "--out", str(out)], env=env,
                                       capture_output=True, text=True)
                if child.returncode:
                    raise SystemExit(f"the {mode} run failed:\n{child.stderr[-3000:]}")
                results[mode].append(json.loads(out.read_text()))
                shutil.rmtree(folder, ignore_errors=True)
                print(f"round {r + 1}/{args.rounds}: {mode} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    mean = {m: statistics.median(statistics.fmean(x["times"]) for x in results[m])
            for m in MODES}
    worst = {m: max(max(x["times"]) for x in results[m]) for m in MODES}
    params = results["none"][0]["params"]
    print(f"CPU {_cpu()}; BLAS {_blas_kernel(env)}; 1 rank, 1 BLAS thread; GPT "
          f"{MODEL['n_layer']} x {MODEL['n_embd']}, {params / 1e6:.1f}M parameters (float32, "
          f"AdamW: {params * 12 / 2**30:.2f} GiB saved); {args.steps} steps, a save every "
          f"{args.interval}; median over {args.rounds} rounds of the mean step time")
    print(f"{'checkpoints':<12} {'mean step s':>12} {'x none':>8} {'slowest step s':>15}")
    for m in MODES:
        print(f"{m:<12} {mean[m]:>12.4f} {mean[m] / mean['none']:>8.3f} {worst[m]:>15.3f}")
    wait = statistics.median(x["final_wait_s"] for x in results["async"])
    print(f"background: the last write was waited for {wait:.2f} s after the last step")
    print(json.dumps({"benchmark": "checkpoint_async", "cpu": _cpu(), "params": params,
                      "steps": args.steps, "interval": args.interval,
                      "mean_step_s": mean, "ratio_to_none": {m: mean[m] / mean["none"]
                                                             for m in MODES},
                      "slowest_step_s": worst, "final_wait_s": wait}))


if __name__ == "__main__":
    main()

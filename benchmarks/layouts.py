"""Every way to lay GPT config S over 4 ranks: tokens/s, per-rank memory, pipeline bubble.

    mpiexec -n 4 python benchmarks/layouts.py            # as the issue asks (spawns nothing)
    python benchmarks/layouts.py --launch                # launches one mpiexec per layout

Layouts: dp4, tp4, pp4, dp2xtp2, dp2xpp2, tp2xpp2, with ZeRO-1 and ZeRO-3 on dp
where dp > 1. Every layout trains the same global batch (``--global-batch``
sequences of 128 bytes per step, split over dp ranks and then into
``--micro`` micro-batches), float32, AdamW. Printed per layout: median step
time, tokens/s, peak RSS and peak ledger bytes per rank (max over ranks), and
for pipelines the measured idle fraction (time a stage waited in receives over
the step, averaged over stages) next to the ideal bubble (p-1)/(m+p-1).

On this project's 2-core CI machine 4 ranks share 2 cores, so a waiting rank
still competes for a core: read the idle fraction as an upper bound.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LAYOUTS = [  # name, dp, tp, pp, strategy
    ("dp4-zero1", 4, 1, 1, "zero1"), ("dp4-zero3", 4, 1, 1, "zero3"),
    ("tp4", 1, 4, 1, "ddp"), ("pp4", 1, 1, 4, "ddp"),
    ("dp2xtp2-zero1", 2, 2, 1, "zero1"), ("dp2xtp2-zero3", 2, 2, 1, "zero3"),
    ("dp2xpp2-zero1", 2, 1, 2, "zero1"), ("dp2xpp2-zero3", 2, 1, 2, "zero3"),
    ("tp2xpp2", 1, 2, 2, "ddp"),
]
CONFIG_S = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256)


def run_layout(world, name, dp, tp, pp, strategy, args) -> dict | None:
    import numpy as np

    from mpishard.comm import Mesh
    from mpishard.models import GPT, GPTConfig
    from mpishard.optim import AdamW
    from mpishard.parallel import ParallelModel, bubble_fraction

    mesh = Mesh(world, dp=dp, tp=tp, pp=pp)
    per_rank = args.global_batch // dp
    micro = args.micro if pp > 1 else 1
    run = ParallelModel(GPT(GPTConfig(**CONFIG_S), materialize_now=False), mesh,
                        strategy=strategy, micro_batches=micro)
    opt = AdamW(run.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                ledger=run.ledger)
    r = np.random.default_rng(mesh.dp.rank)
    x = r.integers(0, 256, (per_rank, 128))
    times, idle = [], []
    for i in range(args.warmup + args.steps):
        world.barrier()
        t0 = time.perf_counter()
        run.train_step(x, x)
        run.step(opt, max_norm=1.0)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            idle.append(run.pipeline.idle_fraction)
    rss = world.all_gather_obj(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    ledger = world.all_gather_obj(run.ledger.peak_total)
    idle_mean = statistics.mean(world.all_gather_obj(statistics.mean(idle)))
    med = statistics.median(times)
    result = {"layout": name, "dp": dp, "tp": tp, "pp": pp, "strategy": strategy,
              "micro_batches": micro, "median_step_s": round(med, 4),
              "tokens_per_s": round(args.global_batch * 128 / med, 1),
              "peak_rss_mib_max": round(max(rss), 1),
              "peak_ledger_mib_max": round(max(ledger) / 2**20, 2)}
    if pp > 1:
        result["idle_fraction"] = round(idle_mean, 3)
        result["bubble_theory"] = round(bubble_fraction(pp, micro), 3)
    mesh.free()
    return result if world.rank == 0 else None


def _table(results) -> str:
    lines = [f"{'layout':<15}{'step s':>8}{'tokens/s':>10}{'RSS MiB':>9}{'ledger MiB':>11}"
             f"{'idle':>7}{'bubble':>8}"]
    for r in results:
        lines.append(f"{r['layout']:<15}{r['median_step_s']:>8.3f}{r['tokens_per_s']:>10.0f}"
                     f"{r['peak_rss_mib_max']:>9.0f}{r['peak_ledger_mib_max']:>11.1f}"
                     f"{r.get('idle_fraction', float('nan')):>7.3f}"
                     f"{r.get('bubble_theory', float('nan')):>8.3f}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(n for n, *_ in LAYOUTS))
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro", type=int, default=4, help="micro-batches for pipelines")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--launch", action="store_true",
                        help="start `mpiexec -n 4` once per layout (fresh memory per layout)")
    args = parser.parse_args(argv)
    wanted = args.layouts.split(",")
    chosen = [l for l in LAYOUTS if l[0] in wanted]
    if args.launch:
        mpiexec = str(Path(sys.executable).parent / "mpiexec")
        results = []
        for layout in chosen:
            cmd = [mpiexec, "-n", "4", sys.executable, "-m", "mpi4py", __file__,
                   "--layouts", layout[0], "--global-batch", str(args.global_batch),
                   "--micro", str(args.micro), "--warmup", str(args.warmup),
                   "--steps", str(args.steps)]
            env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            results += json.loads(out.stdout.strip().splitlines()[-1])["results"]
            print(f"{layout[0]}: done", file=sys.stderr)
    else:
        from mpi4py import MPI

        from mpishard.comm import Communicator

        world = Communicator(MPI.COMM_WORLD)
        if world.size != 4:
            raise SystemExit(f"run with 4 ranks (mpiexec -n 4 ...), not {world.size}")
        results = []
        for layout in chosen:
            r = run_layout(world, *layout, args)
            if r is not None:
                results.append(r)
                print(f"{layout[0]}: {r['median_step_s']:.3f} s/step", file=sys.stderr)
        if world.rank != 0:
            return
    print(_table(results), file=sys.stderr)
    print(json.dumps({"benchmark": "layouts", "world": 4, "config": "S",
                      "global_batch": args.global_batch, "results": results}))


if __name__ == "__main__":
    main()

"""The pipeline bubble measured: 1F1B against interleaved 1F1B on 2 pipeline ranks.

    python benchmarks/pipeline_bubble.py                       # m = 4 and 8, 3 rounds
    python benchmarks/pipeline_bubble.py --micro 4 --rounds 1 --steps 2   # a quick check

Launches ``mpiexec -n 2 python -m mpi4py benchmarks/pipeline_bubble.py --worker``
(the ``mpiexec`` next to ``sys.executable``) with one BLAS thread per rank
(``OMP_NUM_THREADS=1``), so on a machine with two cores each rank has a core
of its own and its waiting is real idle time. The worker trains a GPT of 8
blocks (vocab 256, block 128, width 256, 4 heads, float32; 4 sequences per
micro-batch) split over ``pp = 2`` with DDP, under 1F1B and under the
interleaved schedule with ``V = 2`` chunks per rank (stages of 2 blocks, rank
``r`` holding stages ``r`` and ``r + 2``), each for ``m`` micro-batches. Each
step starts at a barrier; a rank's bubble is its step time outside forwards
and backwards over the time in them (``Pipeline.bubble``: the receives it
waited for, the end of the step it spent waiting for the other rank, the
messages and the tied embedding's gradient sum), averaged over the two ranks;
the figure is its median over the timed steps of every round (and, beside
it, the least: the step least disturbed by other work). Rounds alternate the
schedules' order. Printed beside it: the ideal pipeline's
``(p - 1) / m`` (1F1B) and ``(p - 1) / (V m)`` (interleaved), and the ratio.
One JSON line on stdout holds every figure, the CPU model and the load average
before and after: other processes on the cores stretch a rank's work at
random, and the other rank's wait for it counts as bubble, so measure on a
quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

SCHEDULES = (("1f1b", 1), ("interleaved", 2))
PP = 2


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def worker(args) -> None:
    from mpi4py import MPI

    from mpishard.comm import Communicator, Mesh
    from mpishard.models import GPT, GPTConfig
    from mpishard.optim import AdamW
    from mpishard.parallel import ParallelModel

    world = Communicator(MPI.COMM_WORLD)
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=8, n_head=4, n_embd=256)
    results = {}
    for rnd in range(args.rounds):
        order = SCHEDULES if rnd % 2 == 0 else SCHEDULES[::-1]
        for m in args.micro:
            for schedule, v in order:
                mesh = Mesh(world, pp=PP)
                run = ParallelModel(GPT(cfg, materialize_now=False), mesh, "ddp",
                                    micro_batches=m, schedule=schedule, virtual_stages=v)
                opt = AdamW(run.parameters(), lr=3e-4, ledger=run.ledger)
                rng = np.random.default_rng(rnd)
                x = rng.integers(0, cfg.vocab_size, (4 * m, cfg.block_size))
                for step in range(args.warmup + args.steps):
                    world.barrier()
                    run.train_step(x, x)
                    bubble = np.array([run.pipeline.bubble])
                    world.all_reduce(bubble, op="avg")
                    run.step(opt)
                    if step >= args.warmup:
                        results.setdefault(f"{schedule} m={m}", []).append(float(bubble[0]))
    if world.rank == 0:
        print(json.dumps(results), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro", type=int, nargs="+", default=[4, 8],
                        help="micro-batches per step (multiples of 2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per round")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    load_before = os.getloadavg()
    mpiexec = Path(sys.executable).with_name("mpiexec")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    cmd = [str(mpiexec), "-n", str(PP), sys.executable, "-m", "mpi4py", __file__, "--worker",
           "--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--micro", *map(str, args.micro)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    measured = json.loads(out.strip().splitlines()[-1])
    rows, figures = [], {}
    print(f"pipeline bubble on pp = {PP} ranks ({_cpu_model()}, one core each), "
          f"median over {args.rounds} x {args.steps} steps", file=sys.stderr)
    print(f"{'schedule':<20} {'median':>9} {'least':>9} {'ideal':>9} {'ratio':>7}",
          file=sys.stderr)
    for m in args.micro:
        for schedule, v in SCHEDULES:
            key = f"{schedule} m={m}"
            got, least = float(np.median(measured[key])), float(np.min(measured[key]))
            ideal = (PP - 1) / (v * m)
            figures[key] = {"measured": got, "least": least, "ideal": ideal,
                            "ratio": got / ideal, "steps": measured[key],
                            "virtual_stages": v, "micro_batches": m}
            rows.append(f"{key + (f' V={v}' if v > 1 else ''):<20} {got:>9.4f} {least:>9.4f} "
                        f"{ideal:>9.4f} {got / ideal:>7.3f}")
    print("\n".join(rows), file=sys.stderr)
    print(json.dumps({"cpu": _cpu_model(), "pp": PP, "bubbles": figures,
                      "load_before": load_before, "load_after": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

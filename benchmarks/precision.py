"""Mixed precision on the CPU: step time, bytes moved and memory, float32 against 16 bits.

    OMP_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py benchmarks/precision.py
    mpiexec -n 4 python -m mpi4py benchmarks/precision.py --strategy ddp --steps 6

GPT config S (as benchmarks/step.py), batch 8 x 128 tokens per rank, wrapped
by one strategy three times: ``precision`` float32, float16 and bfloat16. The
three are stepped in turn, step by step, so they see the same machine load;
per precision it prints the median step time and its ratio to float32, the
bus bytes per step (the all-gathers move 16-bit units), the ledger's peak
model state and gathered bytes, and the activation bytes of one forward
(``MemoryLedger.measure_activations``). On NumPy the 16-bit runs compute in
float32 inside every op (NumPy has no 16-bit matrix product), so they pay the
casts; what they save is bytes. Prints a table on rank 0 and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpishard.comm import Communicator, Mesh  # noqa: E402
from mpishard.models import GPT, GPTConfig  # noqa: E402
from mpishard.optim import AdamW  # noqa: E402
from mpishard.parallel import PRECISIONS, wrap_model  # noqa: E402

CONFIG_S = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256)
MIB = 2**20


def setup(precision: str, strategy: str, mesh, batch: int):
    model = GPT(GPTConfig(**CONFIG_S), seed=0, materialize_now=False)
    run = wrap_model(model, mesh, strategy, precision=precision)
    opt = AdamW(run.parameters(), lr=3e-4, weight_decay=0.1, ledger=run.ledger)
    opt.allocate_state()
    r = np.random.default_rng(mesh.dp.rank)
    x = r.integers(0, CONFIG_S["vocab_size"], (batch, CONFIG_S["block_size"]))
    y = r.integers(0, CONFIG_S["vocab_size"], (batch, CONFIG_S["block_size"]))

    def step(measure: bool = False) -> tuple:
        """(seconds, bus bytes, activation bytes or 0); the runs share the mesh's
        communicators, so the bytes are read right after this run's step."""
        run.dp.stats.reset()
        t0 = time.perf_counter()
        if measure:
            with run.ledger.measure_activations() as m:
                _, loss = run(x, y)
        else:
            _, loss = run(x, y)
        run.scale_loss(loss).backward()
        run.step(opt, max_norm=1.0)
        seconds = time.perf_counter() - t0
        run.ledger.release_activations()
        return seconds, run.dp.stats.total_bus_bytes, m.nbytes if measure else 0
    return run, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategy", default="zero3", choices=["ddp", "zero1", "zero2", "zero3"])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per precision")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    args = ap.parse_args()
    world = Communicator(MPI.COMM_WORLD)
    mesh = Mesh(world, dp=world.size)
    runs = {p: setup(p, args.strategy, mesh, args.batch) for p in PRECISIONS}
    activations, bus = {}, {}
    for p, (run, step) in runs.items():              # warm-up, and one measured forward
        _, bus[p], activations[p] = step(measure=True)
        run.ledger.reset_peak()
    times: dict = {p: [] for p in PRECISIONS}
    for _ in range(args.steps):
        for p, (_, step) in runs.items():
            world.barrier()
            times[p].append(step()[0])
    result = {"strategy": args.strategy, "ranks": world.size, "batch": args.batch,
              "config": "S", "precisions": {}}
    for p, (run, _) in runs.items():
        peak = run.ledger.peak_by_category()
        result["precisions"][p] = {
            "step_s": statistics.median(times[p]),
            "bus_bytes_per_step": bus[p],
            "model_state_bytes": peak["params"] + peak["grads"] + peak["optim"],
            "gathered_peak_bytes": peak["gathered"],
            "activation_bytes": activations[p],
            "skipped_steps": run.skipped_steps,
        }
    if world.rank == 0:
        base = result["precisions"]["float32"]
        print(f"{args.strategy} on {world.size} ranks, GPT config S, batch {args.batch}x128 per "
              f"rank, median of {args.steps} steps", file=sys.stderr)
        print(f"{'precision':<10}{'step s':>9}{'ratio':>7}{'bus MiB':>9}{'ratio':>7}"
              f"{'state MiB':>11}{'gathered':>10}{'activ. MiB':>12}{'ratio':>7}", file=sys.stderr)
        for p, r in result["precisions"].items():
            print(f"{p:<10}{r['step_s']:9.3f}{r['step_s'] / base['step_s']:7.2f}"
                  f"{r['bus_bytes_per_step'] / MIB:9.2f}"
                  f"{r['bus_bytes_per_step'] / max(base['bus_bytes_per_step'], 1):7.2f}"
                  f"{r['model_state_bytes'] / MIB:11.2f}{r['gathered_peak_bytes'] / MIB:10.2f}"
                  f"{r['activation_bytes'] / MIB:12.2f}"
                  f"{r['activation_bytes'] / max(base['activation_bytes'], 1):7.2f}",
                  file=sys.stderr)
        print(json.dumps(result))


if __name__ == "__main__":
    main()

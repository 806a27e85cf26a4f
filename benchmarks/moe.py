"""Mixture of experts on 4 ranks: expert parallelism's memory, speed and exchange bytes.

    OMP_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py benchmarks/moe.py
    OMP_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py benchmarks/moe.py --rounds 5

A Llama with config S widths (4 layers, 4 heads, 2 key/value heads, width 256,
vocabulary 256, block 128, float32), every block a mixture of 8 SwiGLU experts
of width 384 with top-2 routing (dropless), batch 4 sequences per rank. Three
figures, each printed with its target:

1. Bytes of expert weights the busiest rank holds between steps (its pieces of
   them), DDP at ep4 vs ep1, and ZeRO-3 at ep4 vs ep1 with the bus bytes its
   all-gathers move per step (at ep4 no expert is gathered).
2. Tokens per second (forward, backward, AdamW) of the MoE at ep4 against a
   dense Llama with the same active parameters per token (a SwiGLU of width
   2 x 384 = 768, the two experts a token uses), both DDP on the same 4 ranks,
   and of the same MoE at ep1 (every rank all 8 experts, no exchange),
   measured side by side in interleaved rounds (medians; read the ratios).
3. The bytes the ep communicator's all-to-all-v moved in one step against the
   theory from that step's routing: per MoE layer the rows this rank sends to
   other ranks and receives from them, out and back, forward and backward, times
   width and itemsize.

Figures and PASS/FAIL go to stderr (rank 0), one JSON line to stdout.
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
from mpishard.models import Llama, LlamaConfig  # noqa: E402
from mpishard.optim import AdamW  # noqa: E402
from mpishard.parallel import ParallelModel  # noqa: E402

WORLD, BATCH, EXPERTS, TOP_K, WIDTH = 4, 4, 8, 2, 384
SHAPE = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_kv_head=2, n_embd=256)
MOE = LlamaConfig(**SHAPE, intermediate_size=WIDTH, moe_experts=EXPERTS, moe_top_k=TOP_K)
DENSE = LlamaConfig(**SHAPE, intermediate_size=TOP_K * WIDTH)


def _run(world, cfg, strategy: str, ep: int):
    run = ParallelModel(Llama(cfg, materialize_now=False), Mesh(world, ep=ep), strategy)
    opt = AdamW(run.parameters(), lr=1e-3, ledger=run.ledger)
    opt.allocate_state()
    return run, opt


def _batch(mesh, step: int):
    return np.random.default_rng(1000 * step + mesh.dp_rank).integers(
        0, SHAPE["vocab_size"], (BATCH, SHAPE["block_size"]))


def _step(run, opt, step: int) -> None:
    x = _batch(run.mesh, step)
    run.train_step(x, np.roll(x, -1, axis=1))
    run.step(opt, max_norm=1.0)


def _expert_bytes(run) -> int:
    """Bytes of expert weights this rank holds between steps (its pieces of them)."""
    return sum(p.array.nbytes for p in run.strategy.pieces()
               if p.kind == "param" and ".experts." in p.name)


def memory(world) -> dict:
    out = {}
    for strategy in ("ddp", "zero3"):
        held, gathered = {}, {}
        for ep in (1, 4):
            run, opt = _run(world, MOE, strategy, ep)
            for comm in run.mesh.active_axes().values():
                comm.stats.reset()
            _step(run, opt, 0)
            held[ep] = max(world.all_gather_obj(_expert_bytes(run)))     # the busiest rank
            gathered[ep] = sum(c.stats["all_gather"].bus_bytes
                               for c in run.mesh.active_axes().values()
                               if "all_gather" in c.stats.kinds())
            run.mesh.free()
        out[strategy] = {"expert_bytes_ep1": held[1], "expert_bytes_ep4": held[4],
                         "ratio": held[4] / held[1], "gather_bus_bytes_ep1": gathered[1],
                         "gather_bus_bytes_ep4": gathered[4]}
    return out


def speed(world, rounds: int, steps: int) -> dict:
    runs = {"moe_ep4": _run(world, MOE, "ddp", 4), "moe_ep1": _run(world, MOE, "ddp", 1),
            "dense": _run(world, DENSE, "ddp", 1)}
    for run, opt in runs.values():
        _step(run, opt, 0)                                   # warm up
    times = {name: [] for name in runs}
    for r in range(rounds):
        for name, (run, opt) in runs.items():
            world.barrier()
            start = time.perf_counter()
            for s in range(steps):
                _step(run, opt, 1 + r * steps + s)
            world.barrier()
            times[name].append((time.perf_counter() - start) / steps)
    tokens = WORLD * BATCH * SHAPE["block_size"]
    med = {name: statistics.median(t) for name, t in times.items()}
    active = {name: run.module.num_parameters() for name, (run, _) in runs.items()}
    return {"tokens_per_s_moe_ep4": tokens / med["moe_ep4"],
            "tokens_per_s_moe_ep1": tokens / med["moe_ep1"],
            "tokens_per_s_dense": tokens / med["dense"],
            "ratio": med["dense"] / med["moe_ep4"], "ep4_over_ep1": med["moe_ep1"] / med["moe_ep4"],
            "rounds": rounds, "steps": steps,
            "rank_params_moe_ep4": active["moe_ep4"], "rank_params_dense": active["dense"]}


def exchange(world) -> dict:
    run, opt = _run(world, MOE, "ddp", 4)
    ep = run.mesh.ep
    ep.stats.reset()
    _step(run, opt, 0)
    rows = 0
    for block in run.module.model.layers.values():
        sent, received = block.mlp.dispatch.last_counts
        rows += 2 * (sum(sent) - sent[ep.rank] + sum(received) - received[ep.rank])
    theory = rows * SHAPE["n_embd"] * 4
    measured = ep.stats["all_to_all_v"].bus_bytes
    totals = world.all_gather_obj((measured, theory))
    return {"measured_bytes": [m for m, _ in totals], "theory_bytes": [t for _, t in totals],
            "equal": all(m == t for m, t in totals)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--steps", type=int, default=3, help="steps per round")
    args = parser.parse_args(argv)
    world = Communicator(MPI.COMM_WORLD)
    if world.size != WORLD:
        raise SystemExit(f"benchmarks/moe.py compares layouts of {WORLD} ranks: run it with "
                         f"mpiexec -n {WORLD}, not {world.size} rank(s)")

    def say(text):
        if world.rank == 0:
            print(text, file=sys.stderr, flush=True)
    result = {"memory": memory(world)}
    for strategy, m in result["memory"].items():
        verdict = "PASS" if strategy != "ddp" or m["ratio"] <= 0.3 else "FAIL"
        say(f"expert weights per rank, {strategy}: ep4 {m['expert_bytes_ep4'] / 2**20:.2f} MiB "
            f"vs ep1 {m['expert_bytes_ep1'] / 2**20:.2f} MiB = {m['ratio']:.3f}x"
            + (f" (target <= 0.3) {verdict}" if strategy == "ddp" else
               f"; gathers move {m['gather_bus_bytes_ep4'] / 2**20:.2f} vs "
               f"{m['gather_bus_bytes_ep1'] / 2**20:.2f} MiB per step"))
    result["speed"] = speed(world, args.rounds, args.steps)
    s = result["speed"]
    say(f"tokens/s, MoE 8x top-2 at ep4 {s['tokens_per_s_moe_ep4']:.0f} vs dense of the same "
        f"active parameters {s['tokens_per_s_dense']:.0f}: {s['ratio']:.3f}x (reported); the "
        f"same MoE at ep1 {s['tokens_per_s_moe_ep1']:.0f} (ep4 / ep1 {s['ep4_over_ep1']:.3f}x)")
    result["exchange"] = exchange(world)
    e = result["exchange"]
    say(f"all-to-all-v bytes per rank, one step: measured {e['measured_bytes']} theory "
        f"{e['theory_bytes']} {'PASS' if e['equal'] else 'FAIL'}")
    if world.rank == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

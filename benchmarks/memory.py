"""Bigger than one rank: ZeRO-3 trains a GPT whose training state exceeds a rank's budget.

    OMP_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py benchmarks/memory.py
    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/memory.py         # works too
    mpiexec -n 4 python -m mpi4py benchmarks/memory.py --n-layer 8 --n-head 8 --n-embd 512

Every rank gets a memory budget: ``Backend.resolve("numpy", memory_budget=BYTES)``
is the model's backend, so its :class:`~mpishard.core.backend.MemoryLedger` raises
:class:`~mpishard.core.backend.OutOfMemoryBudget` before an allocation (parameters,
gradients, optimizer state, gathered units, communication buffers) would pass
it. The model, by default the nanoGPT Shakespeare-char size (6 layers, 6
heads, width 384, vocab 256: 10.8M parameters), needs 16 bytes per parameter
for parameters + gradients + AdamW state in float32 (165 MiB), far more than
the default budget of 1.25x the planner's ZeRO-3 per-rank peak
(:func:`mpishard.planning.memory.estimate_memory`; 95 MiB at 4 ranks). Three phases run in
one job, smallest first, each with a tiny batch (2 x 32 tokens per rank) so
that model state, not activations, dominates memory:

1. ZeRO-3 under the budget trains ``--steps`` AdamW steps;
2. DDP under the same budget fails with ``OutOfMemoryBudget`` on every rank
   (the message is reported);
3. DDP without a budget trains the same steps on the same data (same losses),
   to measure what DDP really needs.

For each phase every rank records its real peak resident set size
(``resource.getrusage``; before each phase freed heap goes back to the OS with
glibc's ``malloc_trim`` and the kernel's high-water mark is reset through
``/proc/self/clear_refs``, so each phase's peak is its own; where that fails
the peaks are cumulative and the phase order keeps them meaningful), the
ledger's peak and the model-state bytes. Rank 0 prints a table on stderr and
one JSON line on stdout; the exit status is 1 unless ZeRO-3 trained and DDP
failed on every rank. About 15 s on 2 cores.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpishard.core.backend import Backend, OutOfMemoryBudget  # noqa: E402
from mpishard.comm import Communicator, Mesh, check_launcher, install_abort_hook  # noqa: E402
from mpishard.models import GPT, GPTConfig  # noqa: E402
from mpishard.optim import AdamW  # noqa: E402
from mpishard.parallel import DataParallel, ZeRO
from mpishard.planning.memory import estimate_memory  # noqa: E402

MIB = 2**20


def _rss_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB."""
    current = 0.0
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * resource.getpagesize() / MIB
    except OSError:
        pass
    return current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak_rss() -> bool:
    """Hand freed heap back to the OS, then reset the kernel's RSS high-water mark
    to the current RSS (Linux >= 4.0); False where that is not possible."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)   # glibc: return free heap pages
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _batch(step: int, dp_rank: int, cfg: GPTConfig, batch: int, seq: int):
    r = np.random.default_rng(10_000 * step + dp_rank)
    return (r.integers(0, cfg.vocab_size, (batch, seq)),
            r.integers(0, cfg.vocab_size, (batch, seq)))


def _train(strategy_name: str, cfg: GPTConfig, mesh: Mesh, budget: int | None, args) -> dict:
    """Build, wrap and train; returns what happened (failure included) on this rank."""
    backend = Backend.resolve("numpy", memory_budget=budget)
    stage = "building the model"
    losses, step_s = [], []
    try:
        model = GPT(cfg, seed=0, backend=backend, materialize_now=strategy_name != "zero3")
        stage = "wrapping it"
        strategy = (DataParallel(model, mesh) if strategy_name == "ddp"
                    else ZeRO(model, mesh, stage=3))
        stage = "allocating the optimizer state"
        opt = AdamW(strategy.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                    ledger=strategy.ledger)
        opt.allocate_state()
        stage = "training"
        for step in range(args.steps):
            t0 = time.perf_counter()
            _, loss = strategy(*_batch(step, mesh.dp_rank, cfg, args.batch, args.seq))
            loss.backward()
            strategy.step(opt)
            step_s.append(time.perf_counter() - t0)
            losses.append(loss.item())
    except OutOfMemoryBudget as err:
        ledger = backend.ledger
        return {"ok": False, "failed_while": stage, "error": f"OutOfMemoryBudget: {err}",
                "ledger_peak_bytes": ledger.peak_total, "rss": _rss_mib()}
    ledger = strategy.ledger
    live = ledger.bytes_by_category()
    return {"ok": True, "losses": losses, "step_s": step_s,
            "model_state_bytes": live["params"] + live["grads"] + live["optim"],
            "ledger_peak_bytes": ledger.peak_total,
            "ledger_peak_by_category": ledger.peak_by_category(), "rss": _rss_mib()}


def _phase(name: str, strategy_name: str, cfg, mesh, world, budget, args) -> dict | None:
    reset = _reset_peak_rss()
    rss_before = _rss_mib()[0]
    mine = _train(strategy_name, cfg, mesh, budget, args)
    gc.collect()
    everyone = world.gather_obj({**mine, "rss_before": rss_before, "reset": reset})
    if everyone is None:
        return None
    first = everyone[0]
    out = {"strategy": strategy_name, "budget_bytes": budget,
           "ok_ranks": sum(r["ok"] for r in everyone), "ranks": len(everyone),
           "peak_rss_mib_per_rank": [round(r["rss"][1], 1) for r in everyone],
           "rss_before_mib_per_rank": [round(r["rss_before"], 1) for r in everyone],
           "peak_rss_reset": all(r["reset"] for r in everyone),
           "ledger_peak_mib_per_rank": [round(r["ledger_peak_bytes"] / MIB, 2)
                                        for r in everyone]}
    if first["ok"]:
        out.update(losses=[round(v, 4) for v in first["losses"]],
                   median_step_s=round(float(np.median(
                       [max(s) for s in zip(*(r["step_s"] for r in everyone))])), 3),
                   model_state_mib=round(first["model_state_bytes"] / MIB, 2),
                   ledger_peak_mib_by_category_rank0={
                       k: round(v / MIB, 2) for k, v in first["ledger_peak_by_category"].items()
                       if v})
    else:
        out.update(failed_while=first["failed_while"], error=first["error"])
        out["same_error_on_every_rank"] = all(
            not r["ok"] and r["error"] == first["error"] for r in everyone)
    out["name"] = name
    return out


def _table(result: dict) -> str:
    p = result["plan_mib"]
    lines = [f"memory.py: GPT {result['config']} = {result['n_params']:,} parameters, "
             f"{result['ranks']} ranks, budget {result['budget_mib']:.1f} MiB per rank",
             f"planner, per rank: params+grads+AdamW whole = {p['ddp_model_state']:.1f} MiB "
             f"(DDP peak {p['ddp_total_peak']:.1f}); ZeRO-3 model state "
             f"{p['zero3_model_state']:.1f} MiB, peak {p['zero3_total_peak']:.1f} MiB",
             f"{'phase':<22} {'outcome':<9} {'ledger peak':>12} {'RSS before':>11} "
             f"{'peak RSS (max over ranks)':>26}"]
    for ph in result["phases"]:
        outcome = "trained" if ph["ok_ranks"] == ph["ranks"] else (
            "OOM-budget" if ph["ok_ranks"] == 0 else "MIXED")
        lines.append(f"{ph['name']:<22} {outcome:<9} {max(ph['ledger_peak_mib_per_rank']):9.1f}"
                     f" MiB {max(ph['rss_before_mib_per_rank']):7.1f} MiB "
                     f"{max(ph['peak_rss_mib_per_rank']):22.1f} MiB")
        if "error" in ph:
            lines.append(f"    {ph['error']} (while {ph['failed_while']})")
    lines.append(f"ZeRO-3 / DDP: peak RSS {result['rss_ratio_zero3_over_ddp']:.2f}, "
                 f"peak RSS above the Python+NumPy baseline "
                 f"{result['rss_above_baseline_ratio']:.2f}, ledger peak "
                 f"{result['ledger_peak_ratio_zero3_over_ddp']:.2f}, model state "
                 f"{result['model_state_ratio_zero3_over_ddp']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-head", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=384)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=3, help="training steps per phase")
    parser.add_argument("--budget-mib", type=float, default=None,
                        help="per-rank budget (default: 1.25x the ZeRO-3 planned peak)")
    args = parser.parse_args(argv)

    world = Communicator(MPI.COMM_WORLD)
    install_abort_hook(world)
    check_launcher(world)
    mesh = Mesh(world, dp=world.size)
    cfg = GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size,
                    n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    ddp_plan = estimate_memory(GPT(cfg, materialize_now=False), "ddp", world.size)
    zero3_plan = estimate_memory(GPT(cfg, materialize_now=False), "zero3", world.size)
    budget = (int(args.budget_mib * MIB) if args.budget_mib is not None
              else int(math.ceil(1.25 * zero3_plan.total_peak_bytes / MIB)) * MIB)
    whole = ddp_plan.n_params * ddp_plan.itemsize * 4   # params + grads + 2 Adam moments
    if not zero3_plan.total_peak_bytes <= budget < whole:
        raise SystemExit(  # the same on every rank: every rank computed the same plan
            f"budget {budget / MIB:.1f} MiB must hold ZeRO-3's planned peak "
            f"({zero3_plan.total_peak_bytes / MIB:.1f} MiB on {world.size} ranks) and be "
            f"below the whole training state ({whole / MIB:.1f} MiB); pick --budget-mib "
            f"between them, or use more ranks")

    baseline = _rss_mib()
    phases = [_phase("zero3, budget", "zero3", cfg, mesh, world, budget, args),
              _phase("ddp, budget", "ddp", cfg, mesh, world, budget, args),
              _phase("ddp, no budget", "ddp", cfg, mesh, world, None, args)]
    baselines = world.gather_obj(round(baseline[0], 1))
    if world.rank != 0:
        return 0
    zero3, ddp_budget, ddp_free = phases
    rss_zero3 = max(zero3["peak_rss_mib_per_rank"])
    rss_ddp = max(ddp_free["peak_rss_mib_per_rank"])
    base = max(baselines)
    result = {
        "benchmark": "memory", "ranks": world.size,
        "config": f"{cfg.n_layer}L/{cfg.n_head}H/{cfg.n_embd}W/vocab {cfg.vocab_size}",
        "n_params": ddp_plan.n_params, "batch_per_rank": args.batch, "seq": args.seq,
        "steps": args.steps, "budget_mib": round(budget / MIB, 2),
        "training_state_whole_mib": round(whole / MIB, 2),
        "plan_mib": {"ddp_model_state": round(ddp_plan.model_state_bytes / MIB, 2),
                     "ddp_total_peak": round(ddp_plan.total_peak_bytes / MIB, 2),
                     "zero3_model_state": round(zero3_plan.model_state_bytes / MIB, 2),
                     "zero3_total_peak": round(zero3_plan.total_peak_bytes / MIB, 2)},
        "baseline_rss_mib_per_rank": baselines,
        "zero3_trained": zero3["ok_ranks"] == world.size,
        "ddp_failed_with_budget": ddp_budget["ok_ranks"] == 0
        and ddp_budget.get("same_error_on_every_rank", False),
        "rss_ratio_zero3_over_ddp": round(rss_zero3 / rss_ddp, 3),
        "rss_above_baseline_ratio": round((rss_zero3 - base) / max(rss_ddp - base, 1e-9), 3),
        "ledger_peak_ratio_zero3_over_ddp": round(
            max(zero3["ledger_peak_mib_per_rank"]) / max(ddp_free["ledger_peak_mib_per_rank"]), 3),
        "model_state_ratio_zero3_over_ddp": round(
            zero3["model_state_mib"] / ddp_free["model_state_mib"], 3)
        if "model_state_mib" in zero3 and "model_state_mib" in ddp_free else None,
        # same seed, same data: ZeRO-3 and DDP must see the same losses (float32 rounding)
        "loss_max_abs_diff": round(max(abs(a - b) for a, b in zip(zero3["losses"],
                                                                  ddp_free["losses"])), 6)
        if "losses" in zero3 and "losses" in ddp_free else None,
        "phases": phases,
    }
    print(_table(result), file=sys.stderr)
    print(json.dumps(result), flush=True)
    return 0 if result["zero3_trained"] and result["ddp_failed_with_budget"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

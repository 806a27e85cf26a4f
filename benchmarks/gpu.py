"""GPU benchmark: GPT-2 small (124M) tokens/s and MFU on one rank; ZeRO-3 memory per rank.

    python benchmarks/gpu.py --part single --json runs/gpu_single.json
    mpiexec -n 2 python -m mpi4py benchmarks/gpu.py --part zero3 --json runs/gpu_zero3_2.json
    mpiexec -n 4 python -m mpi4py benchmarks/gpu.py --part zero3 --json runs/gpu_zero3_4.json
    python benchmarks/gpu.py --part dtypes --json runs/gpu_dtypes.json
    python benchmarks/gpu.py --part loss --json runs/gpu_loss.json      # fused cross-entropy
    MPISHARD_ATTENTION=fused python benchmarks/gpu.py --part scaling   # host- or device-bound
    python benchmarks/gpu.py --backend numpy --tiny --json /tmp/gpu.json   # CPU smoke test

``single`` (one rank): the model wrapped at size 1 (``--strategy``, default
ZeRO-1, whose flat per-block float32 masters keep the optimizer's kernel
launches few), so that ``precision=`` applies, once per ``--precisions`` entry (float32, float16
mixed precision): warm-up steps, then timed steps (forward, scaled backward,
unscale + clip + AdamW) with the device synchronised around each. Reports
tokens/s and model FLOPs utilisation as nanoGPT's ``estimate_mfu`` counts it
(``6 N + 12 L H Q T`` FLOPs per token, N without the position embedding) over
the GPU's dense 16-bit peak, where one more step's time goes (``breakdown``:
matrix products, attention, the other ops, the optimizer; the device
synchronised at every op, see mpishard/autodiff/profile.py), the CuPy memory
pool's bytes, and the activation
bytes one forward keeps for backward with and without activation
checkpointing (``ledger.measure_activations``).

``zero3`` (every rank of the launch; ranks share the visible GPUs): ZeRO-3 at
dp = world size, per rank the ledger's bytes by category and the CuPy pool's
bytes after a few steps, against ``estimate_memory``'s prediction.

``dtypes`` (one rank): what the array module does with float16 and bfloat16
(``ml_dtypes``): elementwise work, a 2-D matrix product, an attention-shaped
batched product (TFLOP/s, and the error against float32 on the same rounded
inputs), scatter-add (the embedding's backward). A failure is recorded, not
raised: this part reports what the installed CuPy supports.

``loss`` (one rank): cross-entropy forward and backward on GPT-2 small's logits
(batch x 1024 rows of 50304 classes), float32 and float16: the kernel set's (on
CuPy one fused launch each way, mpishard/kernels/cuda/loss.py) against the
reference set's whole-array math (float32 copies of the logits, a launch per
operation), milliseconds each way (median, the device synchronised around each),
and that the two agree. Not in the GPU check's plan; run it by hand.

``scaling`` (one rank): whether a step waits on the GPU or on the host that issues
its kernels. The ``single`` model (``--precisions``, default float16 and bfloat16)
at batch 1, 2, 4 and 8 (``--batch-sizes``): per batch the step's seconds and the
seconds the host took to issue it (until the step's last call returned, before the
closing synchronisation). A step the host bounds takes about as long at every
batch, and about as long as it took to issue; one the device bounds grows with the
batch. The planner's GPU kernel model counts the device alone.

Prints readable lines and, with ``--json``, writes everything to one file
(rank 0). scripts/gpu_check.py runs ``single`` and ``zero3`` at 2 ranks (and
``single --tiny`` in its warm_kernels part, to compile the kernels first).

``single`` and ``zero3`` also check what they measure, and exit 1 naming each
failure (``failures`` in the JSON): every loss finite and the last below the
first, at most one float16 step skipped by the loss scale, and under ZeRO-3 each
rank's model state -- the CuPy pool's bytes in use on a GPU, the ledger's on
NumPy -- within 10% of ``estimate_memory``. With ``--backend cupy`` where CuPy does
not import or sees no GPU, the benchmark says so, writes ``{"status":
"skipped", "reason": ...}`` and exits 0.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mpi4py import MPI  # noqa: E402

from mpishard.autodiff.profile import op_profile  # noqa: E402
from mpishard.core.backend import Backend, cupy_or_none  # noqa: E402
from mpishard.comm import Communicator, Mesh, node_local_rank  # noqa: E402
from mpishard.models import GPT, GPTConfig  # noqa: E402
from mpishard.kernels import attention_choice  # noqa: E402
from mpishard.optim import AdamW  # noqa: E402
from mpishard.parallel import ZeRO, wrap_model
from mpishard.planning.memory import estimate_memory  # noqa: E402

GPT2_SMALL = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
TINY = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
#: Dense (no sparsity) peak FLOP/s by device-name substring, first match wins:
#: (16-bit tensor cores, float32 without TF32). From NVIDIA's data sheets (SXM
#: parts where the name does not say PCIe).
PEAKS = (
    ("H200", 989.4e12, 66.9e12),
    ("H100 PCIe", 756.5e12, 51.2e12),
    ("H100", 989.4e12, 66.9e12),
    ("A100", 312.0e12, 19.5e12),
)


def device_facts(backend: Backend, peak_tflops: float | None) -> dict:
    """The device's name and peak FLOP/s (``None`` where unknown)."""
    if backend.name == "numpy":
        name = "cpu"
    else:
        props = backend.xp.cuda.runtime.getDeviceProperties(backend.device)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    facts = {"name": name, "peak_flops_16bit": None, "peak_flops_float32": None,
             "peak_source": "unknown device: pass --peak-tflops"}
    for key, peak16, peak32 in PEAKS:
        if key in name:
            facts.update(peak_flops_16bit=peak16, peak_flops_float32=peak32,
                         peak_source=f"table entry {key!r} (dense)")
            break
    if peak_tflops is not None:
        facts.update(peak_flops_16bit=peak_tflops * 1e12, peak_source="--peak-tflops")
    return facts


def flops_per_token(cfg: GPTConfig, seq_len: int) -> tuple[int, int]:
    """nanoGPT's estimate: ``(6 N + 12 L H Q T, N)``, N without the position embedding."""
    model = GPT(cfg, materialize_now=False)
    n = sum(p.size for p in model.parameters()) - model.transformer.wpe.weight.size
    head = cfg.n_embd // cfg.n_head
    return 6 * n + 12 * cfg.n_layer * cfg.n_head * head * seq_len, n


def synchronize(backend: Backend) -> None:
    if backend.name == "cupy":
        backend.xp.cuda.Device(backend.device).synchronize()


def pool_bytes(backend: Backend) -> dict:
    """CuPy pool bytes in use and held (held: about the high-water mark; the pool keeps
    freed blocks)."""
    pool = backend.ledger.cupy_pool
    if pool is None:
        return {"pool_used_bytes": None, "pool_total_bytes": None}
    return {"pool_used_bytes": int(pool.used_bytes()), "pool_total_bytes": int(pool.total_bytes())}


def fresh_backend(name: str, local_rank: int) -> Backend:
    """A new Backend (fresh ledger) after freeing what the last run left in the pool."""
    gc.collect()
    backend = Backend.resolve(name, local_rank=local_rank)
    if backend.ledger.cupy_pool is not None:
        backend.ledger.cupy_pool.free_all_blocks()
    return backend


def make_batch(backend: Backend, cfg: GPTConfig, batch_size: int, seq_len: int, seed: int):
    r = np.random.default_rng(seed)
    tokens = r.integers(0, cfg.vocab_size, (batch_size, seq_len + 1))
    return backend.asarray(tokens[:, :-1]), backend.asarray(tokens[:, 1:])


def train_steps(strategy, opt, backend, x, y, warmup: int, steps: int) -> dict:
    """Run ``warmup + steps`` steps; time the last ``steps`` with the device synchronised,
    and the host's seconds to issue each (until its last call returned, before the
    closing synchronisation)."""
    times, issued, losses = [], [], []
    for i in range(warmup + steps):
        synchronize(backend)
        start = time.perf_counter()
        _, loss = strategy(x, y)
        strategy.scale_loss(loss).backward()
        strategy.step(opt, max_norm=1.0)
        issue = time.perf_counter() - start
        synchronize(backend)
        if i >= warmup:
            times.append(time.perf_counter() - start)
            issued.append(issue)
        losses.append(loss.item())
    return {"step_s_median": statistics.median(times), "step_s_mean": statistics.fmean(times),
            "step_s": times, "issue_s_median": statistics.median(issued),
            "losses": losses, "loss_first": losses[0], "loss_last": losses[-1],
            "skipped_steps": strategy.skipped_steps, "loss_scale": strategy.scaler.scale}


#: op -> the part of a step it is counted in (every other op: "elementwise and the rest")
OP_CLASSES = {"linear": "matrix products", "causal_self_attention": "attention",
              "gqa_attention": "attention"}


def profiled_step(strategy, opt, backend, x, y) -> dict:
    """One more step with the device synchronised at every op: seconds per part (see
    ``OP_CLASSES``; ``optimizer``: unscale, clip and AdamW), their shares of it, and
    the profiled step's own seconds (longer than a plain one: every op waits)."""
    sync = lambda: synchronize(backend)            # noqa: E731
    sync()
    start = time.perf_counter()
    with op_profile(sync) as prof:
        _, loss = strategy(x, y)
        strategy.scale_loss(loss).backward()
    sync()
    middle = time.perf_counter()
    strategy.step(opt, max_norm=1.0)
    sync()
    end = time.perf_counter()
    parts = {"matrix products": 0.0, "attention": 0.0, "elementwise and the rest": 0.0,
             **prof.by_class(OP_CLASSES, default="elementwise and the rest")}
    parts["elementwise and the rest"] += max(0.0, (middle - start) - prof.total)
    parts["optimizer"] = end - middle
    return {"seconds": parts, "shares": {k: v / (end - start) for k, v in parts.items()},
            "profiled_step_s": end - start}


#: What the runs must show (see the module docstring).
MAX_FLOAT16_SKIPS = 1
POOL_OVER_PLAN_TOLERANCE = 0.10


def training_failures(label: str, run: dict) -> list:
    """Why a run's losses or skipped steps are wrong (empty when right)."""
    failures = []
    if not all(math.isfinite(x) for x in run["losses"]):
        failures.append(f"{label}: a loss is not finite: {run['losses']}")
    elif not run["loss_last"] < run["loss_first"]:
        failures.append(f"{label}: the loss did not fall ({run['loss_first']:.4f} -> "
                        f"{run['loss_last']:.4f})")
    if run["precision"] == "float16" and run["skipped_steps"] > MAX_FLOAT16_SKIPS:
        failures.append(f"{label}: {run['skipped_steps']} float16 steps skipped (at most "
                        f"{MAX_FLOAT16_SKIPS} allowed)")
    return failures


def memory_failures(label: str, rank: dict, plan_bytes: int) -> list:
    """Why a rank's model state is not within 10% of the planner's (empty when it is):
    the CuPy pool's bytes in use where there is a pool, else the ledger's."""
    measured, what = ((rank["pool_used_bytes"], "CuPy pool bytes in use")
                      if rank["pool_used_bytes"] is not None
                      else (rank["model_state_bytes"], "ledger model state"))
    ratio = measured / plan_bytes
    rank["measured_over_plan"] = ratio
    if abs(ratio - 1) > POOL_OVER_PLAN_TOLERANCE:
        return [f"{label} rank {rank['rank']}: {what} {_mib(measured)} is {ratio:.3f} x the "
                f"planner's {_mib(plan_bytes)} (allowed: within "
                f"{POOL_OVER_PLAN_TOLERANCE:.0%})"]
    return []


def activation_bytes(strategy, backend, x, y) -> int:
    """Bytes one forward keeps alive for backward (the ledger's measurement)."""
    with backend.ledger.measure_activations() as measured:
        _, loss = strategy(x, y)
    strategy.scale_loss(loss).backward()
    strategy.zero_grad()
    backend.ledger.release_activations()
    return measured.nbytes


def single_rank_model(args, cfg: GPTConfig, self_comm, precision: str) -> tuple:
    """``(backend, strategy, opt)``: GPT ``cfg`` on a fresh backend, wrapped at size 1 by
    ``--strategy`` in ``precision``, and its AdamW."""
    backend = fresh_backend(args.backend, 0)
    strategy = wrap_model(GPT(cfg, seed=0, backend=backend, materialize_now=False),
                          Mesh(self_comm, dp=1), args.strategy, precision=precision)
    opt = AdamW(strategy.parameters(), lr=3e-4, weight_decay=0.1, ledger=strategy.ledger)
    return backend, strategy, opt


def single_rank_setup(args, cfg: GPTConfig) -> tuple:
    """``(self communicator, backend, device facts, sequence length, FLOPs per token,
    parameters without the position embedding)`` of a one-rank part."""
    self_comm = Communicator(MPI.COMM_SELF.Dup(), "self", _owned=True)
    backend = fresh_backend(args.backend, 0)
    seq_len = args.seq_len or cfg.block_size
    return (self_comm, backend, device_facts(backend, args.peak_tflops), seq_len,
            *flops_per_token(cfg, seq_len))


def run_single(args, cfg: GPTConfig) -> dict:
    self_comm, backend, device, seq_len, fpt, n_params = single_rank_setup(args, cfg)
    tokens = args.batch_size * seq_len
    report = {"part": "single", "backend": args.backend, "device": device,
              "config": vars(cfg), "n_params_non_embedding": n_params,
              "strategy": args.strategy,
              "batch_size": args.batch_size, "seq_len": seq_len, "tokens_per_step": tokens,
              "flops_per_token": fpt, "warmup": args.warmup, "steps": args.steps, "runs": [],
              "failures": []}
    print(f"single: GPT of {n_params:,} parameters (no position embedding), batch "
          f"{args.batch_size} x {seq_len} tokens, {fpt:,} FLOPs per token, on {device['name']} "
          f"({backend.describe()}; 16-bit peak {device['peak_flops_16bit']} FLOP/s from "
          f"{device['peak_source']})", flush=True)
    for precision in args.precisions:
        strategy = opt = None  # the last run's model goes before the next is built
        backend, strategy, opt = single_rank_model(args, cfg, self_comm, precision)
        x, y = make_batch(backend, cfg, args.batch_size, seq_len, args.seed)
        run = {"precision": precision, **train_steps(strategy, opt, backend, x, y,
                                                     args.warmup, args.steps)}
        run["tokens_per_s"] = tokens / run["step_s_median"]
        achieved = fpt * run["tokens_per_s"]
        run["flops_per_s"] = achieved
        peak16, peak32 = device["peak_flops_16bit"], device["peak_flops_float32"]
        run["mfu"] = achieved / peak16 if peak16 else None
        if precision == "float32":
            run["mfu_vs_float32_peak"] = achieved / peak32 if peak32 else None
        run["breakdown"] = profiled_step(strategy, opt, backend, x, y)
        run.update(pool_bytes(backend), ledger_peak_bytes=backend.ledger.peak_total)
        report["runs"].append(run)
        report["failures"] += training_failures(f"single {precision}", run)
        mfu = (f"{100 * run['mfu']:.1f}% MFU (of the 16-bit peak)" if run["mfu"] is not None
               else "MFU n/a (no peak)")
        print(f"  {precision:<8} {run['step_s_median'] * 1e3:9.1f} ms/step  "
              f"{run['tokens_per_s']:12,.0f} tokens/s  {mfu}  loss {run['loss_first']:.3f} -> "
              f"{run['loss_last']:.3f}  skipped {run['skipped_steps']}  "
              f"pool {_mib(run['pool_total_bytes'])} held", flush=True)
        shares = ", ".join(f"{k} {v:.0%}" for k, v in run["breakdown"]["shares"].items())
        print(f"           where a step goes (profiled, "
              f"{run['breakdown']['profiled_step_s'] * 1e3:.1f} ms): {shares}", flush=True)
    if args.activations:
        precision = args.precisions[-1]
        without = activation_bytes(strategy, backend, x, y)
        strategy.module.set_activation_checkpointing(True)
        with_ckpt = activation_bytes(strategy, backend, x, y)
        strategy.module.set_activation_checkpointing(False)
        report["activations"] = {"precision": precision, "bytes_without_checkpointing": without,
                                 "bytes_with_checkpointing": with_ckpt,
                                 "ratio": without / with_ckpt if with_ckpt else None}
        print(f"  activations kept by one forward ({precision}): {_mib(without)} without, "
              f"{_mib(with_ckpt)} with activation checkpointing", flush=True)
    self_comm.free()
    return report


def run_scaling(args, cfg: GPTConfig) -> dict:
    self_comm, _, device, seq_len, fpt, _ = single_rank_setup(args, cfg)
    report = {"part": "scaling", "backend": args.backend, "device": device,
              "config": vars(cfg), "strategy": args.strategy, "seq_len": seq_len,
              "batch_sizes": args.batch_sizes, "warmup": args.warmup, "steps": args.steps,
              "attention": attention_choice(), "runs": [], "failures": []}
    print(f"scaling: step and issue seconds by batch on {device['name']} "
          f"(MPISHARD_ATTENTION={report['attention']})", flush=True)
    for precision in args.precisions:
        try:
            scaling_runs(args, cfg, self_comm, precision, fpt, device, seq_len, report)
        except Exception as err:  # noqa: BLE001 (one precision's fault, kept in the report)
            report["failures"].append(f"scaling {precision}: {type(err).__name__}: {err}")
            print(f"  {precision:<8} FAILED: {type(err).__name__}: {err}", flush=True)
    self_comm.free()
    return report


def scaling_runs(args, cfg, self_comm, precision, fpt, device, seq_len, report) -> None:
    """``run_scaling``'s runs of one precision, appended to ``report`` (the model is
    dropped on return, before the next precision's is built)."""
    backend, strategy, opt = single_rank_model(args, cfg, self_comm, precision)
    for batch in args.batch_sizes:
        x, y = make_batch(backend, cfg, batch, seq_len, args.seed)
        timed = train_steps(strategy, opt, backend, x, y, args.warmup, args.steps)
        run = {"precision": precision, "batch_size": batch, "step_s": timed["step_s_median"],
               "issue_s": timed["issue_s_median"], "losses": timed["losses"]}
        tokens_per_s = batch * seq_len / run["step_s"]
        peak16 = device["peak_flops_16bit"]
        run.update(tokens_per_s=tokens_per_s,
                   mfu=fpt * tokens_per_s / peak16 if peak16 else None,
                   issue_share=run["issue_s"] / run["step_s"])
        report["runs"].append(run)
        if not all(math.isfinite(v) for v in run["losses"]):
            report["failures"].append(f"scaling {precision} batch {batch}: a loss is "
                                      f"not finite: {run['losses']}")
        mfu = "" if run["mfu"] is None else f"  {100 * run['mfu']:.1f}% MFU"
        print(f"  {precision:<8} batch {batch:<3} {run['step_s'] * 1e3:9.1f} ms/step, "
              f"issued in {run['issue_s'] * 1e3:8.1f} ms ({run['issue_share']:.0%})"
              f"{mfu}", flush=True)


def run_zero3(args, cfg: GPTConfig) -> dict:
    world = Communicator.from_env(MPI.COMM_WORLD.Dup())
    local_rank = node_local_rank(world)
    seq_len = args.seq_len or cfg.block_size
    report = {"part": "zero3", "backend": args.backend, "world_size": world.size,
              "batch_size_per_rank": args.batch_size, "seq_len": seq_len,
              "warmup": args.warmup, "steps": args.steps, "runs": [], "failures": []}
    for precision in args.precisions:
        backend = fresh_backend(args.backend, local_rank)
        if backend.name == "cupy":
            report["gpus_visible"] = int(backend.xp.cuda.runtime.getDeviceCount())
        plan = estimate_memory(GPT(cfg, materialize_now=False), "zero3", world.size,
                           precision=precision)
        model = GPT(cfg, seed=0, backend=backend, materialize_now=False)
        strategy = ZeRO(model, Mesh(world, dp=world.size), stage=3, precision=precision)
        opt = AdamW(strategy.parameters(), lr=3e-4, weight_decay=0.1, ledger=strategy.ledger)
        x, y = make_batch(backend, cfg, args.batch_size, seq_len, args.seed + world.rank)
        timing = train_steps(strategy, opt, backend, x, y, args.warmup, args.steps)
        del x, y
        gc.collect()
        live = backend.ledger.bytes_by_category()
        mine = {"rank": world.rank, "device": backend.describe(), "ledger_live": live,
                "ledger_peak": backend.ledger.peak_by_category(),
                "ledger_peak_total": backend.ledger.peak_total,
                "model_state_bytes": live["params"] + live["grads"] + live["optim"],
                "step_s_median": timing["step_s_median"], **pool_bytes(backend),
                "comm_stats": world.stats.snapshot()}
        ranks = world.all_gather_obj(mine)
        slowest = max(r["step_s_median"] for r in ranks)
        run = {"precision": precision, "losses": timing["losses"],
               "loss_first": timing["loss_first"],
               "loss_last": timing["loss_last"], "skipped_steps": timing["skipped_steps"],
               "tokens_per_s_all_ranks": world.size * args.batch_size * seq_len / slowest,
               "plan": {"steady": plan.steady, "peak": plan.peak,
                        "model_state_bytes": plan.model_state_bytes,
                        "total_peak_bytes": plan.total_peak_bytes},
               "ranks": ranks}
        for r in ranks:
            r["model_state_over_plan"] = r["model_state_bytes"] / plan.model_state_bytes
            if r["pool_used_bytes"] is not None:
                r["pool_used_over_plan"] = r["pool_used_bytes"] / plan.model_state_bytes
                r["pool_total_over_plan_peak"] = r["pool_total_bytes"] / plan.total_peak_bytes
            report["failures"] += memory_failures(f"zero3 {precision}", r,
                                                  plan.model_state_bytes)
        report["failures"] += training_failures(f"zero3 {precision} rank {world.rank}", run)
        report["runs"].append(run)
        if world.rank == 0:
            print(f"zero3 {precision} on {world.size} ranks: plan per rank: model state "
                  f"{_mib(plan.model_state_bytes)}, peak {_mib(plan.total_peak_bytes)} "
                  f"(gathered {_mib(plan.peak['gathered'])}, comm {_mib(plan.peak['comm'])}); "
                  f"{run['tokens_per_s_all_ranks']:,.0f} tokens/s over all ranks", flush=True)
            for r in ranks:
                print(f"  rank {r['rank']} {r['device']}: ledger model state "
                      f"{_mib(r['model_state_bytes'])} ({r['model_state_over_plan']:.3f} x plan), "
                      f"ledger peak {_mib(r['ledger_peak_total'])}, pool used "
                      f"{_mib(r['pool_used_bytes'])}, held {_mib(r['pool_total_bytes'])}",
                      flush=True)
        del strategy, opt, model
    world.free()
    return report


def run_dtypes(args) -> dict:
    """Probe 16-bit dtypes on the array module: what runs, how fast, how accurate."""
    backend = fresh_backend(args.backend, 0)
    xp = backend.xp
    dtypes = {"float32": np.float32, "float16": np.float16}
    report = {"part": "dtypes", "backend": args.backend, "probes": {}}
    try:
        import ml_dtypes  # noqa: PLC0415 (optional)
        dtypes["bfloat16"] = ml_dtypes.bfloat16
    except ImportError:
        report["probes"]["bfloat16"] = {"ok": False, "error": "ml_dtypes is not installed"}
    n, batch, t, head = (64, 4, 32, 16) if args.tiny else (4096, 96, 1024, 64)
    r = np.random.default_rng(0)
    shapes = {"matmul_2d": ((n, n), (n, n)),
              # attention's q k^T: (B * heads, T, head) x (B * heads, head, T)
              "matmul_batched": ((batch, t, head), (batch, head, t))}
    operands = {k: [r.standard_normal(s, dtype=np.float32) for s in v] for k, v in shapes.items()}

    def matmul(kind, dtype):
        a, b = (backend.asarray(x).astype(dtype) for x in operands[kind])
        exact = a.astype(np.float32) @ b.astype(np.float32)  # same rounded inputs
        got = a @ b
        synchronize(backend)
        start = time.perf_counter()
        for _ in range(args.steps):
            a @ b
        synchronize(backend)
        seconds = (time.perf_counter() - start) / args.steps
        err = float(abs(got.astype(np.float32) - exact).max() / abs(exact).max())
        flops = 2 * a.size // a.shape[-1] * b.shape[-1] * a.shape[-1]
        return {"tflops": flops / seconds / 1e12, "max_rel_err_vs_float32": err}

    def scatter_add(dtype):
        out = xp.zeros((10, 4), dtype)
        index, ones = xp.asarray([1, 1, 3]), xp.ones((3, 4), dtype)
        if xp is np:
            np.add.at(out, index, ones)
        else:
            import cupyx  # noqa: PLC0415

            cupyx.scatter_add(out, index, ones)
        return {"sum": float(out.astype(np.float32).sum())}

    probes = {
        "elementwise": lambda d: {"sum": float(xp.exp(backend.asarray(
            operands["matmul_2d"][0][:4]).astype(d) * 0.1).astype(np.float32).sum())},
        "matmul_2d": lambda d: matmul("matmul_2d", d),
        "matmul_batched": lambda d: matmul("matmul_batched", d),
        "scatter_add": scatter_add}
    for name, dtype in dtypes.items():
        for probe, fn in probes.items():
            try:
                found = {"ok": True, **fn(dtype)}
            except Exception as exc:  # noqa: BLE001 (record what the module cannot do)
                found = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
            report["probes"][f"{name}.{probe}"] = found
            print(f"dtypes {name:<8} {probe:<15} " + (
                f"ok {', '.join(f'{k} {v:.4g}' for k, v in found.items() if k != 'ok')}"
                if found["ok"] else f"FAILS {found['error']}"), flush=True)
    return report


def run_loss(args) -> dict:
    """Cross-entropy each way: the kernel set's against the reference's (see the module
    docstring)."""
    from mpishard.kernels import kernels_for, reference

    backend = fresh_backend(args.backend, 0)
    xp = backend.xp
    rows, classes = (64, 100) if args.tiny else (args.batch_size * 1024, GPT2_SMALL.vocab_size)
    r = np.random.default_rng(args.seed)
    targets = r.integers(0, classes, rows)
    targets[::10] = -100                                 # some rows ignored
    targets = backend.asarray(targets)
    kernels = kernels_for(xp)
    report = {"part": "loss", "backend": args.backend, "rows": rows, "classes": classes,
              "kernel_set": kernels.NAME, "warmup": args.warmup, "steps": args.steps,
              "runs": [], "failures": []}
    for dtype in ("float32", "float16"):
        logits = backend.asarray((3 * r.standard_normal((rows, classes), dtype=np.float32))
                                 .astype(dtype))
        g = xp.ones((), dtype=np.float32)
        run, results = {"dtype": dtype, "logits_bytes": int(logits.nbytes)}, {}
        for label, kernel_set in (("kernels", kernels), ("reference", reference)):
            times = {"forward": [], "backward": []}
            for i in range(args.warmup + args.steps):
                synchronize(backend)
                t0 = time.perf_counter()
                loss, maxima, sums, count = kernel_set.cross_entropy_forward(logits, targets,
                                                                             -100)
                synchronize(backend)
                t1 = time.perf_counter()
                grad = kernel_set.cross_entropy_backward(logits, targets, -100, maxima, sums,
                                                         count, g)
                synchronize(backend)
                if i >= args.warmup:
                    times["forward"].append(t1 - t0)
                    times["backward"].append(time.perf_counter() - t1)
            run[f"{label}_ms"] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            results[label] = (float(loss), grad)
            del maxima, sums, count, grad
        (loss, grad), (want_loss, want_grad) = results["kernels"], results["reference"]
        run["loss_rel_diff"] = abs(loss - want_loss) / abs(want_loss)
        run["grad_max_abs_diff"] = float(abs(grad.astype(np.float32)
                                             - want_grad.astype(np.float32)).max())
        run["speedup"] = (sum(run["reference_ms"].values())
                          / max(sum(run["kernels_ms"].values()), 1e-9))
        tol = 1e-5 if dtype == "float32" else 1e-3
        if not (run["loss_rel_diff"] <= tol and run["grad_max_abs_diff"] <= tol / rows * 10):
            report["failures"].append(f"loss {dtype}: the kernel set and the reference differ "
                                      f"(loss {run['loss_rel_diff']:.2e} relative, gradient "
                                      f"{run['grad_max_abs_diff']:.2e})")
        report["runs"].append(run)
        print(f"loss {dtype} {rows} x {classes}: {kernels.NAME} "
              f"{run['kernels_ms']['forward']:.2f} + {run['kernels_ms']['backward']:.2f} ms, "
              f"reference {run['reference_ms']['forward']:.2f} + "
              f"{run['reference_ms']['backward']:.2f} ms ({run['speedup']:.1f}x)", flush=True)
        del logits, results, grad, want_grad
    return report


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("single", "zero3", "dtypes", "loss", "scaling"),
                        default="single")
    parser.add_argument("--backend", choices=("cupy", "numpy"), default="cupy")
    parser.add_argument("--tiny", action="store_true",
                        help="a 2-layer width-32 GPT (tests; the numbers mean nothing)")
    parser.add_argument("--strategy", choices=("ddp", "zero1", "zero2", "zero3"),
                        default="zero1",
                        help="single: the wrapper at size 1 (default zero1: one flat float32 "
                             "master per block, so the optimizer runs ~13 updates, not ~150)")
    parser.add_argument("--precisions", default=None,
                        help="comma-separated (default float32,float16)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="sequences per step per rank (default: single 8, zero3 4; tiny 2)")
    parser.add_argument("--batch-sizes", default="1,2,4,8",
                        help="scaling: the batches, comma-separated (tiny: 1,2)")
    parser.add_argument("--seq-len", type=int, default=None, help="default: block size")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps, or products under --part dtypes (default 5)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense 16-bit peak, for MFU on a GPU not in the table")
    parser.add_argument("--no-activations", dest="activations", action="store_false",
                        help="skip the activation-bytes measurement (single)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the results here (rank 0)")
    args = parser.parse_args(argv)
    cfg = TINY if args.tiny else GPT2_SMALL
    args.precisions = (args.precisions or ("float16,bfloat16" if args.part == "scaling"
                                           else "float32,float16")).split(",")
    args.batch_sizes = [int(b) for b in ("1,2" if args.tiny and args.batch_sizes == "1,2,4,8"
                                         else args.batch_sizes).split(",")]
    args.batch_size = args.batch_size or (2 if args.tiny else 8 if args.part == "single" else 4)
    args.warmup = 1 if args.tiny and args.warmup is None else (
        2 if args.warmup is None else args.warmup)
    args.steps = 2 if args.tiny and args.steps is None else (
        5 if args.steps is None else args.steps)
    if args.part != "zero3" and MPI.COMM_WORLD.size > 1:
        parser.error(f"--part {args.part} runs on one rank, not {MPI.COMM_WORLD.size}; "
                     f"launch it without mpiexec, or use --part zero3")
    unavailable = cupy_unavailable() if args.backend == "cupy" else None
    if unavailable:
        report = {"part": args.part, "backend": "cupy", "status": "skipped",
                  "reason": unavailable}
        if MPI.COMM_WORLD.rank == 0:
            print(f"benchmarks/gpu.py: SKIPPED: {unavailable}; this benchmark needs a GPU "
                  f"(--backend numpy --tiny runs it on the CPU, the numbers meaning nothing)",
                  flush=True)
        _write(args.json, report)
        return 0
    parts = {"single": lambda: run_single(args, cfg), "zero3": lambda: run_zero3(args, cfg),
             "dtypes": lambda: run_dtypes(args), "loss": lambda: run_loss(args),
             "scaling": lambda: run_scaling(args, cfg)}
    report = parts[args.part]()
    report["tiny"] = args.tiny
    failures = report.get("failures", [])
    report["status"] = "failed" if failures else "passed"
    _write(args.json, report)
    for failure in failures:
        print(f"FAIL {failure}", flush=True)
    return 1 if failures else 0


def cupy_unavailable() -> str | None:
    """Why ``--backend cupy`` cannot run here, or ``None``."""
    cupy = cupy_or_none()
    if cupy is None:
        return "CuPy is not importable"
    try:
        if int(cupy.cuda.runtime.getDeviceCount()) == 0:
            return "CuPy sees no GPU"
    except Exception as exc:  # noqa: BLE001 (no driver)
        return f"CuPy sees no GPU ({type(exc).__name__}: {exc})"
    return None


def _write(path, report: dict) -> None:
    if path is not None and MPI.COMM_WORLD.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())

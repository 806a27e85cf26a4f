"""Host syncs (and kernel launches) per training step, counted on the CuPy-strict module.

    python benchmarks/syncs.py                       # launches mpiexec -n 4 itself
    mpiexec -n 4 python -m mpi4py benchmarks/syncs.py --steps 3
    python benchmarks/syncs.py --launches-only       # the launch figure alone, one process
    python benchmarks/syncs.py --launches-only --llama   # and a Llama block's

A GPU runs a step's kernels asynchronously; each read of a value on the host
(``float(x)``, ``x.item()``, ``int(mask.sum())``, a ``.get()``) waits for all
of them. This counts those reads on every rank, with the model built on the
strict module (NumPy memory behind CuPy's rules, which counts every read), for
GPT training steps as ``mpishard train`` runs them (a :class:`ParallelModel`
driving a :class:`Pipeline`: ``train_step`` then ``step`` with clipping, two
micro-batches, dropout on) under DDP and ZeRO-3 (float32, and float16 with loss
scaling), ZeRO-1/2 and tensor x pipeline parallelism (tp2 x pp2, 1F1B; tp2 and pp2 on
two ranks), at world sizes 1, 2 and 4 (sub-communicators of one 4-rank run).

A step reads nothing back between its first launch and its last: the gradient
norm, the clipping factor, the overflow flag (skip / loss scale) and the dynamic
loss scale stay on the device and reach the optimizer's kernel as device scalars
(see [Note: device step decisions] in mpishard/parallel/strategy.py), and the loss
(:meth:`ParallelModel.forward_backward`) is read once after ``step``, on the last
pipeline stage: ``reads_after_step``. ``BUDGET`` is the reads inside the step (0;
it was 2, the loss and the norm: ``BEFORE``). Copies through host buffers for MPI (an
MPI library that is not CUDA-aware) are counted apart, as ``staged_per_step``: they
move buffers, they decide nothing. ``pageable_per_step`` counts copies of host data
onto the device inside the step: here only the batch's, its micro-batches' tokens
and targets that the model uploads from the host arrays a loader gives (the strict
test tests/testing/test_strict_captured_step.py passes device batches: 0).

The strict module also counts kernel launches (each operation a GPU would run
as a kernel: see :mod:`mpishard.testing.strict`); their number per step is what kernel
fusion has to bring down. ``launches_per_block`` is one transformer block's
share of ``train_step`` (forward, backward, gradient reduction), measured
rather than estimated: the launches (one rank, DDP, float32, one micro-batch,
after a warm-up step) for the same GPT with ``LAUNCH_LAYERS`` = (2, 4) blocks,
differenced and divided by the blocks added; ``launches_per_block_optimizer``
the block's share of ``step`` (clipping and the optimizer on its parameters);
``launches_outside_blocks`` the rest of the 4-block step (embeddings, head,
loss), and ``launches_per_block_by_op`` the 15 operations that launch most per
block, both parts; ``planned_launches_per_block`` what the planner's GPU kernel model
counts of a block's forward and backward (its launch costs and the ops it leaves
out are there). ``LAUNCH_TARGET`` is the goal
per block. The target is reported, not enforced: the exit status is about host
syncs only.

Prints one JSON line: ``host_syncs_per_step[layout][world size]`` (reads inside
the step, the most on any rank, per step, after a warm-up step), the same per rank,
``reads_after_step`` (the loss), the staged and the pageable copies, for any count
over the budget the lines that read, the launch figures (``launches_per_step``,
``launches_per_block``, ``launches_outside_blocks``, ``launches_per_block_by_op``)
and ``before``, the figures before the step's decisions moved to the device; the
launches also go to stderr as a line of text, beside ``before``'s.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np  # noqa: E402

#: host reads inside one training step (the loss is read after it; see the docstring)
BUDGET = 0
#: the figures before the step's decisions moved to the device (this script's output
#: then): reads per step (the loss and the norm), launches per block and per step
BEFORE = {"host_syncs_per_step": 2, "launches_per_block": 40,
          "launches_per_block_optimizer": 0, "launches_per_step": 205,
          "launches_outside_blocks": 45}
#: kernel launches per transformer block (forward + backward) that fusion aims for: 40,
#: and 3 more since the norms and GELU run their forward kernels again in backward rather
#: than keep float32 normalised rows and tanh (see [Note: what ops keep] in
#: mpishard/autodiff/rows.py)
LAUNCH_TARGET = 43
#: the two depths whose steps are differenced for the per-block launch figure
LAUNCH_LAYERS = (2, 4)
SIZES = (1, 2, 4)
#: layout -> (mesh axes for a world of n ranks, strategy, precision); None: does not fit
LAYOUTS = {
    "ddp": (lambda n: {"dp": n}, "ddp", None),
    "ddp-float16": (lambda n: {"dp": n}, "ddp", "float16"),
    "zero1": (lambda n: {"dp": n}, "zero1", None),
    "zero2": (lambda n: {"dp": n}, "zero2", None),
    "zero3": (lambda n: {"dp": n}, "zero3", None),
    "zero3-float16": (lambda n: {"dp": n}, "zero3", "float16"),
    "tp2": (lambda n: {"dp": n // 2, "tp": 2} if n % 2 == 0 else None, "ddp", None),
    "pp2-1f1b": (lambda n: {"dp": n // 2, "pp": 2} if n % 2 == 0 else None, "ddp", None),
    "tp2xpp2-1f1b": (lambda n: {"dp": n // 4, "tp": 2, "pp": 2} if n % 4 == 0 else None,
                     "ddp", None),
}


def _config():
    from mpishard.models import GPTConfig

    return GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, dropout=0.1)


@contextlib.contextmanager
def _attention(choice):
    """``MPISHARD_ATTENTION=choice`` inside (``None``: as it is), the caller's after."""
    previous = os.environ.get("MPISHARD_ATTENTION")
    if choice is not None:
        os.environ["MPISHARD_ATTENTION"] = choice
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("MPISHARD_ATTENTION", None)
        else:
            os.environ["MPISHARD_ATTENTION"] = previous


def _batch(step: int, dp_rank: int, cfg, size: int = 4):
    r = np.random.default_rng(1000 * step + dp_rank)
    return (r.integers(0, cfg.vocab_size, (size, cfg.block_size)),
            r.integers(0, cfg.vocab_size, (size, cfg.block_size)))


def measure(comm, layout: str, steps: int = 2, warmup: int = 1) -> dict | None:
    """Host syncs per step on this rank of ``comm`` for ``layout`` (``None``: does not fit).

    Returns ``{"syncs": [reads inside each step], "after": [reads after it: the loss],
    "staged": [per step], "pageable": [per step], "sites": {line: reads inside}}``.
    Collective over ``comm``.
    """
    from mpishard.testing import strict
    from mpishard.core.backend import Backend
    from mpishard.comm import Mesh
    from mpishard.models import GPT
    from mpishard.optim import AdamW
    from mpishard.parallel import ParallelModel

    axes_of, strategy, precision = LAYOUTS[layout]
    axes = axes_of(comm.size)
    if axes is None:
        return None
    cfg = _config()
    mesh = Mesh(comm, **axes)
    model = GPT(cfg, seed=0, backend=Backend.resolve("strict"), materialize_now=False)
    run = ParallelModel(model, mesh, strategy=strategy, micro_batches=2, schedule="1f1b",
                        precision=precision)
    opt = AdamW(run.parameters(), lr=1e-3, weight_decay=0.1, ledger=run.ledger)
    counts, after, staged, pageable, sites = [], [], [], [], {}
    for step in range(warmup + steps):
        strict.syncs.reset()
        loss = run.forward_backward(*_batch(step, mesh.dp.rank, cfg))
        run.step(opt, max_norm=1.0)
        inside = strict.syncs.count
        if step >= warmup:
            counts.append(inside)
            staged.append(strict.syncs.staged)
            pageable.append(strict.syncs.pageable)
            for site, n in strict.syncs.sites.items():
                sites[site] = sites.get(site, 0) + n
        float(loss)                                   # after the step, on every rank
        if step >= warmup:
            after.append(strict.syncs.count - inside)
    strict.syncs.reset()
    return {"syncs": counts, "after": after, "staged": staged, "pageable": pageable,
            "sites": sites}


def _llama_config(n_layer: int):
    """A Llama with Llama 3 8B's heads (32 query heads on 8 key/value heads), narrow."""
    from mpishard.models import LlamaConfig

    return LlamaConfig(vocab_size=64, block_size=16, n_layer=n_layer, n_head=32,
                       n_kv_head=8, n_embd=32 * 16, intermediate_size=64)


def measure_launches(n_layer: int, steps: int = 2, warmup: int = 1, llama: bool = False) -> dict:
    """Kernel launches per training step for :func:`_config`'s GPT with ``n_layer``
    blocks, alone on this process (world size 1, DDP, float32, one micro-batch); with
    ``llama``, :func:`_llama_config`'s Llama in bfloat16 mixed precision with
    ``MPISHARD_ATTENTION=fused`` (its per-projection path: the rotary kernels, flash
    attention).

    Returns ``{"launches": [per step], "train_step": [of those, in ``train_step``:
    forward, backward, gradient reduction], "by_op": {op: launches}}`` (``by_op``
    of the last measured step; the rest of a step is ``step``: clipping and the
    optimizer).
    """
    from mpishard.testing import strict
    from mpishard.core.backend import Backend
    from mpishard.comm import Mesh
    from mpishard.testing.fake_cupy import make_test_comm
    from mpishard.models import GPT, Llama
    from mpishard.optim import AdamW
    from mpishard.parallel import ParallelModel

    cfg = _llama_config(n_layer) if llama else dataclasses.replace(_config(), n_layer=n_layer)
    comm = make_test_comm("self")
    try:
        with _attention("fused" if llama else None):
            mesh = Mesh(comm, dp=1)
            model = (Llama if llama else GPT)(cfg, seed=0, backend=Backend.resolve("strict"),
                                              materialize_now=False)
            run = ParallelModel(model, mesh, strategy="ddp", micro_batches=1,
                                precision="bfloat16" if llama else None)
            opt = AdamW(run.parameters(), lr=1e-3, weight_decay=0.1, ledger=run.ledger)
            counts, train, by_op = [], [], {}
            for step in range(warmup + steps):
                strict.syncs.reset()
                run.train_step(*_batch(step, 0, cfg))
                in_train_step = strict.syncs.launches
                run.step(opt, max_norm=1.0)
                if step >= warmup:
                    counts.append(strict.syncs.launches)
                    train.append(in_train_step)
                    by_op = dict(strict.syncs.launches_by_op)
            strict.syncs.reset()
    finally:
        comm.free()
    return {"launches": counts, "train_step": train, "by_op": by_op}


def _whole(x: float):
    return int(x) if float(x).is_integer() else round(x, 2)


def _top_ops_per_block(small: dict, big: dict) -> dict:
    """The 15 operations that launch most per block: ``by_op`` of the deeper step less
    the shallower's, over the blocks added."""
    l1, l2 = LAUNCH_LAYERS
    by_op = {op: (big["by_op"].get(op, 0) - small["by_op"].get(op, 0)) / (l2 - l1)
             for op in set(big["by_op"]) | set(small["by_op"])}
    top = sorted((item for item in by_op.items() if item[1]), key=lambda i: (-i[1], i[0]))
    return {op: _whole(n) for op, n in top[:15]}


def planned_launches_per_block(llama: bool = False) -> int:
    """The launches of one block (forward and backward) that the planner's GPU kernel
    model counts for the same model (mpishard/planning/gpu_time.py, ``MPISHARD_KERNELS``,
    on the ``h100-sxm`` description's device build): beside the strict module's
    count, what that model leaves out."""
    from mpishard.cli.plan import plan_backend
    from mpishard.models import GPT, Llama
    from mpishard.planning import load_machine
    from mpishard.planning.gpu_time import MPISHARD_KERNELS, stage_ops
    from mpishard.planning.layout import Layout

    backend = plan_backend(load_machine("h100-sxm"))
    with _attention("fused" if llama else None):
        cfg = _llama_config(1) if llama else dataclasses.replace(_config(), n_layer=1)
        model = (Llama if llama else GPT)(cfg, materialize_now=False, backend=backend)
        layout = Layout(1, 1, 1, "ddp", "bfloat16" if llama else None, batch_size=4,
                        seq_len=cfg.block_size)
        ops = stage_ops(model, layout, 2 if llama else 4, MPISHARD_KERNELS)
    return sum(op.fw_kernels + op.bw_kernels for op in ops if op.block)


def llama_launch_figures(steps: int = 2) -> dict:
    """``llama_launches_per_block`` (forward, backward and the gradient reduction) and
    its 15 largest operations, from :func:`_llama_config`'s Llama at two depths, and
    what the planner counts of them."""
    l1, l2 = LAUNCH_LAYERS
    small, big = (measure_launches(n, steps, llama=True) for n in (l1, l2))
    return {"llama_launches_per_block": _whole(
                (max(big["train_step"]) - max(small["train_step"])) / (l2 - l1)),
            "llama_launches_per_block_by_op": _top_ops_per_block(small, big),
            "llama_planned_launches_per_block": planned_launches_per_block(llama=True)}


def launch_figures(steps: int = 2) -> dict:
    """The launch keys of the JSON line (see the docstring), from two depths."""
    l1, l2 = LAUNCH_LAYERS
    small, big = measure_launches(l1, steps), measure_launches(l2, steps)
    per_step = max(big["launches"])
    per_block = (per_step - max(small["launches"])) / (l2 - l1)
    in_train_step = (max(big["train_step"]) - max(small["train_step"])) / (l2 - l1)
    return {"launches_per_step": per_step,
            # forward, backward and the gradient reduction (train_step): what the
            # target is about
            "launches_per_block": _whole(in_train_step),
            # the block's share of step(): clipping and the optimizer on its parameters
            "launches_per_block_optimizer": _whole(per_block - in_train_step),
            "launches_outside_blocks": _whole(per_step - l2 * per_block),
            "launches_per_block_by_op": _top_ops_per_block(small, big),
            "planned_launches_per_block": planned_launches_per_block(),
            "launch_target": LAUNCH_TARGET,
            "launch_layers": list(LAUNCH_LAYERS),
            "before": BEFORE}


def _report_launches(figures: dict) -> None:
    was = BEFORE
    print(f"launches per GPT block (forward + backward): {figures['launches_per_block']} "
          f"(target <= {LAUNCH_TARGET}; before {was['launches_per_block']}), and "
          f"{figures['launches_per_block_optimizer']} in clipping and the optimizer "
          f"(before {was['launches_per_block_optimizer']}); "
          f"{figures['launches_per_step']} per step (before {was['launches_per_step']}), "
          f"{figures['launches_outside_blocks']} outside the blocks (before "
          f"{was['launches_outside_blocks']}); the planner's GPU kernel model counts "
          f"{figures['planned_launches_per_block']} a block", file=sys.stderr, flush=True)


def _worker(steps: int) -> dict:
    from mpi4py import MPI

    from mpishard.testing.fake_cupy import make_test_comm

    world = MPI.COMM_WORLD
    out: dict = {"host_syncs_per_step": {}, "per_rank": {}, "reads_after_step": {},
                 "staged_per_step": {}, "pageable_per_step": {}, "over_budget_sites": {}}
    for size in SIZES:
        if size > world.size:
            continue
        comm = make_test_comm("self" if size == 1 else ("world" if size == world.size
                                                          else f"split{size}"))
        for layout in LAYOUTS:
            mine = measure(comm, layout, steps) if comm is not None and (
                size > 1 or world.rank == 0) else None
            everyone = world.gather(mine if comm is not None else None, root=0)
            if world.rank != 0:
                continue
            got = [r for r in everyone[:size] if r is not None]
            if not got:
                continue
            worst = max(max(r["syncs"]) for r in got)
            out["host_syncs_per_step"].setdefault(layout, {})[size] = worst
            out["per_rank"].setdefault(layout, {})[size] = [max(r["syncs"]) for r in got]
            out["reads_after_step"].setdefault(layout, {})[size] = max(max(r["after"])
                                                                       for r in got)
            out["staged_per_step"].setdefault(layout, {})[size] = max(max(r["staged"])
                                                                      for r in got)
            out["pageable_per_step"].setdefault(layout, {})[size] = max(max(r["pageable"])
                                                                        for r in got)
            if worst > BUDGET:
                sites: dict = {}
                for r in got:
                    for site, n in r["sites"].items():
                        sites[site] = sites.get(site, 0) + n
                out["over_budget_sites"].setdefault(layout, {})[size] = sites
        if comm is not None:
            comm.free()
        world.Barrier()
    if world.rank == 0:
        out.update(launch_figures(steps))
    world.Barrier()
    out.update(budget=BUDGET, steps=steps, world_size=world.size,
               within_budget=all(v <= BUDGET for per in out["host_syncs_per_step"].values()
                                 for v in per.values()))
    return out


def _report_syncs(result: dict) -> None:
    """The host reads per step as lines of text on stderr, layout by layout."""
    print(f"host reads inside a step (most on any rank; budget {result['budget']}, before "
          f"{BEFORE['host_syncs_per_step']}), after it, and copies through host buffers, "
          f"per world size:", file=sys.stderr)
    for layout, per in result["host_syncs_per_step"].items():
        cells = ", ".join(f"{size}: {n} in, {result['reads_after_step'][layout][size]} after, "
                          f"{result['staged_per_step'][layout][size]} staged"
                          for size, n in per.items())
        print(f"  {layout:14s} {cells}", file=sys.stderr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="measured steps (after 1 warm-up)")
    parser.add_argument("--ranks", type=int, default=4, help="ranks to launch (when not "
                        "already under mpiexec)")
    parser.add_argument("--launches-only", action="store_true", help="only the kernel "
                        "launch figures, on this one process (no mpiexec)")
    parser.add_argument("--llama", action="store_true", help="with --launches-only, also a "
                        "Llama block's launches (bfloat16, fused attention)")
    args = parser.parse_args(argv)
    from mpi4py import MPI

    if args.launches_only:
        figures = launch_figures(args.steps)
        if args.llama:
            figures.update(llama_launch_figures(args.steps))
        print(json.dumps({"bench": "syncs", **figures}), flush=True)
        _report_launches(figures)
        if args.llama:
            print(f"launches per Llama block (bfloat16, 32 query heads on 8 key/value heads, "
                  f"MPISHARD_ATTENTION=fused): {figures['llama_launches_per_block']}; the "
                  f"planner counts {figures['llama_planned_launches_per_block']}",
                  file=sys.stderr, flush=True)
        return 0

    if MPI.COMM_WORLD.size == 1 and args.ranks > 1 and not os.environ.get("MPISHARD_SYNCS_WORKER"):
        mpiexec = Path(sys.executable).with_name("mpiexec")
        env = dict(os.environ, MPISHARD_SYNCS_WORKER="1", OMP_NUM_THREADS="1")
        cmd = [str(mpiexec), "-n", str(args.ranks), sys.executable, "-m", "mpi4py",
               str(Path(__file__).resolve()), "--steps", str(args.steps)]
        return subprocess.run(cmd, env=env, check=False).returncode
    result = _worker(args.steps)
    if MPI.COMM_WORLD.rank == 0:
        print(json.dumps({"bench": "syncs", **result}), flush=True)
        _report_syncs(result)
        _report_launches(result)
        return 0 if result["within_budget"] else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

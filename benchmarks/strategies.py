"""Training strategies side by side: mpishard DDP and ZeRO-1/2/3 vs PyTorch DDP and FSDP2.

    python benchmarks/strategies.py                          # 2 and 4 ranks, the full run
    python benchmarks/strategies.py --ranks 4 --rounds 3     # 4 ranks only
    python benchmarks/strategies.py --rounds 1 --steps 2 --warmup 1   # a quick check
    python benchmarks/strategies.py --no-torch               # mpishard columns only
    mpishard bench strategies --ranks 2                      # the same, through the CLI

Times a full training step (forward, backward, gradient communication, AdamW
with lr 3e-4, betas (0.9, 0.95), weight decay 0.1 on matrices only) of GPT
config S (vocab 256, block 128, 4 layers, 4 heads, width 256, float32) with 16
sequences per rank, so the global batch grows with the ranks. Six
implementations, each launched as a fresh job of N ranks with one BLAS thread
per rank (``OMP_NUM_THREADS=1``, ``OPENBLAS_NUM_THREADS=1``):

* mpishard ``DataParallel`` and ``ZeRO(stage=1|2|3)``:
  ``mpiexec -n N python -m mpi4py benchmarks/strategies.py --worker mpishard-zero3``,
  with the ``mpiexec`` next to ``sys.executable``;
* PyTorch ``DistributedDataParallel`` and FSDP2 (``fully_shard`` on each block,
  then on the root) over gloo, on the same nanoGPT (benchmarks/torch_nanogpt.py):
  ``python -m torch.distributed.run --standalone --nproc-per-node N ...``.

Rounds interleave everything: each round runs every rank count and, within
it, every implementation (in order in even rounds, reversed in odd ones), each
job doing ``--warmup`` untimed and ``--steps`` timed steps, so a change in
machine load hits all implementations alike. Before each step the ranks meet
at a barrier; a step's time is the slowest rank's. Medians are over all timed
steps of all rounds.

Prints progress and a table on stderr and one JSON line on stdout with, per
rank count and implementation: the median step seconds, global tokens/s, peak
RSS per rank (``ru_maxrss``; torch's own libraries add ~300 MiB), the median
split of a step into forward, backward and update (for mpishard the update
includes waiting for the gradient collectives and the global-norm all-reduce;
torch DDP waits for its all-reduce at the end of backward), ``cores`` (CPU
seconds of all ranks per wall second: MPICH waits by busy polling, gloo
sleeps), and for mpishard rank 0's collectives per step and its ledger's peak
bytes by category next to the planner's prediction; then the ratios of
median step times mpishard / torch: DDP / DDP and ZeRO-3 / FSDP2, and for
reference ZeRO-1 and ZeRO-2 / torch DDP. The JSON also records the machine's
load average before and after: other processes' load skews every figure.

The defaults (ranks 2,4; 5 rounds; 2 warm-up + 4 timed steps, so 20 timed
steps per figure; 60 jobs) should take 10-15 minutes on a quiet 2-core machine,
where 4 ranks oversubscribe the cores (an estimate: under a load average of 3-7
from other users one round took ~6 minutes). Much of a torch job is start-up,
importing torch in N + 1 processes (~30 s under that load, ~2 s for an
mpishard job). Settings such as
``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` (MPICH: sleep instead of spinning while
waiting) pass through to the workers, and so does ``MPISHARD_BLAS`` (``mkl``: the
mpishard ranks' products on MKL, recorded as ``machine.blas``). Without torch the torch columns are
skipped (``pip install torch==2.13.0`` adds them).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG_S = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256)
BATCH = 16  # sequences per rank
LR, BETAS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 0.1
MPISHARD_IMPLS = ("mpishard-ddp", "mpishard-zero1", "mpishard-zero2", "mpishard-zero3")
TORCH_IMPLS = ("torch-ddp", "torch-fsdp2")
IMPLS = MPISHARD_IMPLS + TORCH_IMPLS
#: (numerator, denominator) pairs reported as ratios of median step time
RATIOS = (("mpishard-ddp", "torch-ddp"), ("mpishard-zero3", "torch-fsdp2"),
          ("mpishard-zero1", "torch-ddp"), ("mpishard-zero2", "torch-ddp"))
# Launcher and scheduler variables a worker job must not inherit.
# (MPIR_CVAR_* settings do pass through, e.g. MPIR_CVAR_ENABLE_HEAVY_YIELD=1.)
_LAUNCH_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPISHARD_", "SLURM_", "TORCHELASTIC_")
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT")


# -- workers: one job of N ranks, W + S steps -----------------------------------
def _batch(rank: int):
    """This rank's fixed (x, y) token batch: (BATCH, block_size) int64, different per rank."""
    import numpy as np

    r = np.random.default_rng(1000 + rank)
    shape = (BATCH, CONFIG_S["block_size"])
    return (r.integers(0, CONFIG_S["vocab_size"], shape),
            r.integers(0, CONFIG_S["vocab_size"], shape))


def _timed_steps(phases, barrier, steps: int, warmup: int, on_timed_start=None) -> dict:
    """Run warm-up then timed steps; ``phases()`` yields after forward, backward, update.

    Returns this rank's ``times`` (seconds per timed step), ``splits`` (forward,
    backward, update seconds), ``cpu`` (process CPU seconds per step, all
    threads: busy-waiting shows up here) and the last ``loss``.
    """
    out = {"times": [], "splits": [], "cpu": [], "loss": None}
    for i in range(warmup + steps):
        if i == warmup and on_timed_start is not None:
            on_timed_start()
        barrier()
        cpu0 = time.process_time()
        marks = [time.perf_counter()]
        for value in phases():
            marks.append(time.perf_counter())
            out["loss"] = value
        if i >= warmup:
            out["cpu"].append(time.process_time() - cpu0)
            out["times"].append(marks[-1] - marks[0])
            out["splits"].append([b - a for a, b in zip(marks, marks[1:])])
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB
    return out


def _mpishard_worker(impl: str, steps: int, warmup: int) -> dict | None:
    sys.path.insert(0, str(ROOT))
    from mpi4py import MPI

    from mpishard.comm import Communicator, Mesh
    from mpishard.models import GPT, GPTConfig
    from mpishard.optim import AdamW
    from mpishard.parallel import DataParallel, ZeRO
    from mpishard.planning.memory import estimate_memory

    world = Communicator(MPI.COMM_WORLD)
    mesh = Mesh(world, dp=world.size)
    kind = impl.split("-")[1]
    if kind == "ddp":
        model = DataParallel(GPT(GPTConfig(**CONFIG_S), seed=0), mesh)
    else:
        stage = int(kind[-1])
        model = ZeRO(GPT(GPTConfig(**CONFIG_S), seed=0, materialize_now=stage != 3), mesh,
                     stage=stage)
    opt = AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY,
                ledger=model.ledger)
    opt.allocate_state()
    x, y = _batch(mesh.dp_rank)

    def phases():
        _, loss = model(x, y)
        yield None
        loss.backward()
        yield None
        model.step(opt)         # reduce gradients, global norm, AdamW, (ZeRO-1/2) all-gather
        yield loss.item()

    def on_timed_start():
        mesh.dp.stats.reset()
        model.ledger.reset_peak()

    mine = _timed_steps(phases, world.barrier, steps, warmup, on_timed_start)
    # rank 0's collectives per timed step, by kind (seconds from issue to completion,
    # so they include whatever computation overlapped a non-blocking collective)
    comm = {kind: {"calls": s["calls"] / steps, "bus_mib": s["bus_bytes"] / steps / 2**20,
                   "seconds": s["seconds"] / steps}
            for kind, s in mesh.dp.stats.snapshot().items()}
    plan = estimate_memory(GPT(GPTConfig(**CONFIG_S), materialize_now=False), kind, world.size)
    memory = {"ledger_peak_mib_rank0": {k: round(v / 2**20, 3) for k, v in
                                        model.ledger.peak_by_category().items() if v},
              "planned_mib": {k: round(v / 2**20, 3) for k, v in
                              {**plan.steady, **plan.peak}.items() if v},
              "planned_bus_mib_per_step": round(plan.bus_bytes_per_step / 2**20, 4)}
    out = _collect(world.gather_obj(mine))
    return None if out is None else {**out, "comm_per_step": comm, "memory": memory}


def _torch_worker(impl: str, steps: int, warmup: int) -> dict | None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    import torch.distributed as dist

    from torch_nanogpt import GPT

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(argparse.Namespace(**CONFIG_S, bias=True))
    if impl == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=BETAS)
    x, y = (torch.from_numpy(a) for a in _batch(rank))

    def phases():
        _, loss = model(x, y)
        yield None
        loss.backward()
        yield None
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield loss.item()

    mine = _timed_steps(phases, dist.barrier, steps, warmup)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    dist.destroy_process_group()
    return _collect(gathered) if rank == 0 else None


def _collect(per_rank: list | None) -> dict | None:
    """Rank 0's summary of every rank's :func:`_timed_steps`: per step the slowest
    rank's time and split, the CPU seconds of all ranks together; RSS per rank."""
    if per_rank is None:
        return None
    steps = range(len(per_rank[0]["times"]))
    slowest = [max(per_rank, key=lambda r: r["times"][i]) for i in steps]
    return {"times": [r["times"][i] for i, r in zip(steps, slowest)],
            "splits": [r["splits"][i] for i, r in zip(steps, slowest)],
            "cpu": [sum(r["cpu"][i] for r in per_rank) for i in steps],
            "peak_rss_mib": [r["peak_rss_mib"] for r in per_rank],
            "loss": per_rank[0]["loss"]}


def worker(impl: str, steps: int, warmup: int) -> None:
    run = _mpishard_worker if impl.startswith("mpishard") else _torch_worker
    out = run(impl, steps, warmup)
    if out is not None:
        print("RESULT " + json.dumps(out), flush=True)


# -- the driver ------------------------------------------------------------------
def _mpiexec() -> Path:
    return Path(sys.executable).parent / "mpiexec"


def _worker_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_LAUNCH_PREFIXES) and k not in _LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    if "MPISHARD_BLAS" in os.environ:           # a compute setting, not a launch one
        env["MPISHARD_BLAS"] = os.environ["MPISHARD_BLAS"]
    return env


@functools.lru_cache(maxsize=None)
def _mpiexec_version() -> str:
    """``mpiexec --version`` in one line, e.g. ``HYDRA 5.0.2`` or ``mpiexec (Open MPI) 5.0.3``."""
    out = subprocess.run([str(_mpiexec()), "--version"], capture_output=True, text=True)
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("Version:"):  # MPICH's Hydra: "Version:   5.0.2" under a header
            return "HYDRA " + ln.split(":", 1)[1].strip()
    return lines[0] if lines else "unknown"


def _command(impl: str, ranks: int, steps: int, warmup: int) -> list:
    args = [str(Path(__file__).resolve()), "--worker", impl, "--steps", str(steps),
            "--warmup", str(warmup)]
    if impl.startswith("mpishard"):
        flavour = _mpiexec_version()
        extra = ["--oversubscribe"] if "Open MPI" in flavour or "OpenRTE" in flavour else []
        return [str(_mpiexec()), *extra, "-n", str(ranks), sys.executable, "-m", "mpi4py",
                *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", *args]


class WorkerFailed(RuntimeError):
    """A worker job failed; ``str()`` is one line, ``detail`` adds the command and output."""

    def __init__(self, summary: str, detail: str):
        super().__init__(summary)
        self.detail = detail


def _stop(proc) -> None:
    """End a worker job: SIGTERM to its launcher (mpiexec and torchrun then end their
    ranks, which mpiexec puts in process groups of their own), SIGKILL if it lingers."""
    proc.terminate()
    try:
        proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def _run_worker(impl: str, ranks: int, steps: int, warmup: int, timeout: float) -> dict:
    """Run one worker job and return rank 0's summary (see :func:`_collect`)."""
    cmd = _command(impl, ranks, steps, warmup)
    proc = subprocess.Popen(cmd, env=_worker_env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise WorkerFailed(f"ran past --timeout {timeout:.0f} s", " ".join(cmd)) from None
    except BaseException:  # Ctrl-C or SIGTERM: the job is in its own session, end it too
        _stop(proc)
        raise
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (stdout + stderr).strip().splitlines()[-25:] or ["(no output)"]
        errors = [ln.strip() for ln in tail if "Error" in ln or "Exception" in ln]
        raise WorkerFailed(f"exited with {proc.returncode}: {(errors or tail)[-1]}",
                           " ".join(cmd) + "\n" + "\n".join(tail))
    return json.loads(lines[-1][len("RESULT "):])


def _torch_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("torch") is not None


def _summary(runs: list, ranks: int) -> dict:
    times = [t for run in runs for t in run["times"]]
    splits = [s for run in runs for s in run["splits"]]
    med = statistics.median(times)
    rss = [max(per) for per in zip(*(run["peak_rss_mib"] for run in runs))]
    return {"median_step_s": round(med, 4),
            "tokens_per_s": round(ranks * BATCH * CONFIG_S["block_size"] / med, 1),
            "peak_rss_mib": round(max(rss), 1),
            "peak_rss_mib_per_rank": [round(m, 1) for m in rss],
            "split_s": {name: round(statistics.median(s[k] for s in splits), 4)
                        for k, name in enumerate(("forward", "backward", "update"))},
            # CPU seconds of all ranks per step / step seconds: how many cores were busy
            "cpu_cores_busy": round(statistics.median(
                c / t for run in runs for c, t in zip(run["cpu"], run["times"])), 2),
            "steps_timed": len(times),
            "last_loss": round(runs[-1]["loss"], 4),
            **_comm_summary(runs)}


def _comm_summary(runs: list) -> dict:
    """mpishard only: rank 0's collectives per step by kind (averaged over runs) and
    its ledger's peak bytes by category next to the planner's prediction."""
    if "comm_per_step" not in runs[-1]:
        return {}
    kinds = runs[-1]["comm_per_step"]
    return {"comm_per_step_rank0": {
        kind: {k: round(statistics.mean(run["comm_per_step"][kind][k] for run in runs), 4)
               for k in ("calls", "bus_mib", "seconds")} for kind in kinds},
        **runs[-1]["memory"]}


def _machine(load_before) -> dict:
    """Cores, load average around the run (others' load skews timings), versions."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None
    return {"cpus": os.cpu_count(), "load_avg_1min_before": round(load_before[0], 2),
            "load_avg_1min_after": round(os.getloadavg()[0], 2),
            "python": sys.version.split()[0], "numpy": installed("numpy"),
            "mpi4py": installed("mpi4py"), "torch": installed("torch"),
            "mpiexec": _mpiexec_version() if _mpiexec().exists() else None,
            "blas": os.environ.get("MPISHARD_BLAS", "numpy")}


def _table(result: dict) -> str:
    rows = [f"{'ranks':>5} {'implementation':<15} {'step s':>7} {'tokens/s':>9} "
            f"{'RSS MiB/rank':>12} {'fwd':>6} {'bwd':>6} {'update':>6} {'cores':>5}"]
    for key, entry in result["results"].items():
        for impl in IMPLS:
            e = entry.get(impl)
            if e is None:
                continue
            if "error" in e:
                rows.append(f"{key.split('_')[0]:>5} {impl:<15} failed: {e['error'][:100]}")
                continue
            s = e["split_s"]
            rows.append(f"{key.split('_')[0]:>5} {impl:<15} {e['median_step_s']:7.3f} "
                        f"{e['tokens_per_s']:9.0f} {e['peak_rss_mib']:12.0f} "
                        f"{s['forward']:6.3f} {s['backward']:6.3f} {s['update']:6.3f} "
                        f"{e['cpu_cores_busy']:5.2f}")
        for name, value in entry.get("ratios", {}).items():
            rows.append(f"{'':>5} {name:<40} {value:.3f}")
    m = result["machine"]
    rows.append(f"{m['cpus']} cpus, 1-min load average {m['load_avg_1min_before']} before, "
                f"{m['load_avg_1min_after']} after; {result['wall_s']:.0f} s in all")
    return "\n".join(rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per worker")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per worker")
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help=f"comma-separated subset of {','.join(IMPLS)}")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch side")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per worker job")
    parser.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        worker(args.worker, args.steps, args.warmup)
        return {}

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up the running job
    impls = [i for i in args.impls.split(",") if i]
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        parser.error(f"unknown implementation {unknown[0]!r}; choose from {', '.join(IMPLS)}")
    if any(i in MPISHARD_IMPLS for i in impls) and not _mpiexec().exists():
        parser.error(f"no mpiexec next to {sys.executable}; install an MPI "
                     f"(pip install mpich) or run --impls torch-ddp,torch-fsdp2")
    if args.no_torch or not _torch_available():
        if not args.no_torch:
            print("torch not importable: timing mpishard alone "
                  "(pip install torch==2.13.0 for the side-by-side)", file=sys.stderr)
        impls = [i for i in impls if i not in TORCH_IMPLS]
    rank_counts = [int(n) for n in args.ranks.split(",")]
    load_before = os.getloadavg()
    runs = {(n, impl): [] for n in rank_counts for impl in impls}
    errors: dict = {}
    start = time.perf_counter()
    for rnd in range(args.rounds):
        for n in rank_counts:
            order = impls if rnd % 2 == 0 else impls[::-1]
            for impl in order:
                if (n, impl) in errors:
                    continue
                t0 = time.perf_counter()
                try:
                    out = _run_worker(impl, n, args.steps, args.warmup, args.timeout)
                except WorkerFailed as err:
                    errors[(n, impl)] = str(err)
                    print(f"ranks={n} {impl} failed ({err}); not run again:\n{err.detail}",
                          file=sys.stderr)
                    continue
                runs[(n, impl)].append(out)
                print(f"round {rnd + 1}/{args.rounds} ranks={n} {impl:15s} median "
                      f"{statistics.median(out['times']):.3f} s/step, peak RSS "
                      f"{max(out['peak_rss_mib']):.0f} MiB/rank, job "
                      f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)

    result = {"benchmark": "strategies", "config": "S", **CONFIG_S, "batch_per_rank": BATCH,
              "dtype": "float32", "threads_per_rank": 1, "rounds": args.rounds,
              "steps": args.steps, "warmup": args.warmup, "machine": _machine(load_before),
              "results": {}}
    for n in rank_counts:
        entry: dict = {}
        for impl in impls:
            if (n, impl) in errors:
                entry[impl] = {"error": errors[(n, impl)]}
            elif runs[(n, impl)]:
                entry[impl] = _summary(runs[(n, impl)], n)
        ratios = {}
        for num, den in RATIOS:
            if "median_step_s" in entry.get(num, {}) and "median_step_s" in entry.get(den, {}):
                ratios[f"{num}/{den}"] = round(
                    entry[num]["median_step_s"] / entry[den]["median_step_s"], 3)
        if ratios:
            entry["ratios"] = ratios
        result["results"][f"{n}_ranks"] = entry
    result["wall_s"] = round(time.perf_counter() - start, 1)
    print(_table(result), file=sys.stderr)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

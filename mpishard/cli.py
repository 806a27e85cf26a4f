"""The ``mpishard`` command.

    mpishard info                                   # versions, MPI library, devices per rank
    mpiexec -n 4 python -m mpi4py -m mpishard info
    mpiexec -n 4 python -m mpi4py -m mpishard train --config examples/configs/demo.toml
    mpishard estimate --strategy zero3 --dp 8 --n-layer 12 --n-embd 768

Errors in what the user gave (a config key, a data path, a mesh that does not
fit) are found on every rank alike; rank 0 prints one line and every rank
exits with status 2. Anything unexpected aborts the whole job with the
failing rank's traceback (``install_abort_hook``).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

from . import __version__

__all__ = ["main", "build_parser"]


def _env_rank() -> int:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, but only rank 0 prints usage errors (every rank still exits 2)."""

    def error(self, message):
        if _env_rank() == 0:
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _cmd_info(args) -> int:
    import numpy as np

    import mpi4py
    from mpi4py import MPI

    from .backend import cupy_or_none
    from .comm import Communicator, format_rank_reports, rank_report
    from .comm.gpu import loaded_libmpi

    world = Communicator.from_env(MPI.COMM_WORLD)
    reports = world.gather_obj(rank_report(world))
    if world.rank != 0:
        return 0
    cupy = cupy_or_none()
    print(f"mpishard   {__version__}")
    print(f"python     {platform.python_version()} ({sys.executable})")
    print(f"numpy      {np.__version__}")
    print(f"mpi4py     {mpi4py.__version__}")
    print(f"cupy       {cupy.__version__ if cupy is not None else 'not installed'}")
    print(f"MPI        {MPI.Get_library_version().strip().splitlines()[0]}")
    print(f"libmpi     {loaded_libmpi() or 'unknown'}")
    print(f"world size {world.size}")
    print(format_rank_reports(reports))
    return 0


def _cmd_train(args) -> int:
    from mpi4py import MPI

    from .comm import Communicator, check_launcher
    from .config import config_from_args
    from .train import run

    world = Communicator.from_env(MPI.COMM_WORLD)
    check_launcher(world)
    run(config_from_args(args), world)
    return 0


def _cmd_estimate(args) -> int:
    from .backend import Backend
    from .config import config_from_args
    from .parallel import STRATEGIES, plan_memory
    from .train import build_model

    cfg = config_from_args(args)
    model = build_model(cfg, Backend(), materialize_now=False)
    dp = cfg.dp or 1
    strategies = [cfg.strategy] if args.config or "strategy" in _given(args) else \
        list(STRATEGIES)
    for strategy in strategies:
        plan = plan_memory(model, strategy, dp, precision=cfg.precision)
        print(plan.format())
        if cfg.memory_budget:
            fits = plan.total_peak_bytes <= cfg.memory_budget
            print(f"  budget    {cfg.memory_budget / 2**20:10.2f} MiB per rank: "
                  f"{'fits' if fits else 'does not fit'}")
    return 0


def _cmd_sample(args) -> int:
    import numpy as np
    from mpi4py import MPI

    from .backend import Backend
    from .checkpoint import CheckpointError, load_checkpoint, read_manifest, resolve_checkpoint
    from .comm import Communicator, Mesh
    from .config import ConfigError, TrainConfig
    from .parallel import DataParallel
    from .train import build_model

    step_dir = resolve_checkpoint(args.checkpoint)
    saved = read_manifest(step_dir).extra.get("config")
    if not saved or saved.get("model") != "gpt":
        raise CheckpointError(step_dir, "config", "no GPT training config in the manifest; "
                              "sample needs a checkpoint written by 'mpishard train --model gpt'")
    cfg = TrainConfig(**{k: v for k, v in saved.items() if k in TrainConfig.__dataclass_fields__})
    world = Communicator.from_env(MPI.COMM_SELF)      # one process, whatever the saved layout
    model = DataParallel(build_model(cfg, Backend()), Mesh(world))
    load_checkpoint(step_dir, model, None, world=world)
    if args.tokens < 1:
        raise ConfigError(f"--tokens must be >= 1, got {args.tokens}")
    prompt = np.frombuffer(args.prompt.encode("utf-8"), dtype=np.uint8).astype(np.int64)[None]
    out = model.module.generate(prompt, args.tokens, temperature=args.temperature,
                                top_k=args.top_k, rng=np.random.default_rng(args.seed))
    if MPI.COMM_WORLD.rank == 0:
        print(bytes(out[0].astype(np.uint8).tolist()).decode("utf-8", errors="replace"))
    return 0


def _cmd_bench(args) -> int:
    if args.what == "comm":
        from .bench.comm import main as bench_comm

        bench_comm(args.rest)
        return 0
    import runpy

    script = {"step": "step.py", "strategies": "strategies.py"}[args.what]
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "benchmarks", script)
    if not os.path.exists(path):
        from .config import ConfigError

        raise ConfigError(f"benchmark script {path} not found; run it from a source checkout")
    sys.argv = [path, *args.rest]
    runpy.run_path(path, run_name="__main__")
    return 0


def _given(args) -> set:
    from .config import TrainConfig

    return {name for name in TrainConfig.__dataclass_fields__
            if getattr(args, name, None) is not None}


def build_parser() -> argparse.ArgumentParser:
    from .config import add_config_flags
    from .checkpoint.cli import add_checkpoint_commands
    from .plot import add_plot_command

    parser = _Parser(prog="mpishard", description="Readable model sharding on NumPy/CuPy "
                     "and mpi4py. Launch multi-rank commands as "
                     "'mpiexec -n N python -m mpi4py -m mpishard ...'.")
    parser.add_argument("--version", action="version", version=f"mpishard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    info = sub.add_parser("info", help="versions, MPI library, backend and device of each rank")
    info.set_defaults(func=_cmd_info)

    train = sub.add_parser("train", help="train a model (GPT on text, MLP on digits)")
    train.add_argument("--config", help="TOML file with training settings")
    add_config_flags(train)
    train.set_defaults(func=_cmd_train)

    estimate = sub.add_parser("estimate", help="per-rank memory by category, before training")
    estimate.add_argument("--config", help="TOML file with training settings")
    add_config_flags(estimate)
    estimate.set_defaults(func=_cmd_estimate)
    bench = sub.add_parser("bench", help="benchmarks: comm (collectives vs raw mpi4py), "
                           "step (one process vs torch), strategies (DDP/ZeRO vs torch)")
    bench.add_argument("what", choices=["comm", "step", "strategies"])
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    bench.set_defaults(func=_cmd_bench)
    add_plot_command(sub)
    add_checkpoint_commands(sub)

    sample = sub.add_parser("sample", help="generate text from a GPT checkpoint (any layout)")
    sample.add_argument("--checkpoint", required=True,
                        help="checkpoint root (its newest step) or a step-N directory")
    sample.add_argument("--prompt", default="def ", help="text to continue")
    sample.add_argument("--tokens", type=int, default=200, help="bytes to generate")
    sample.add_argument("--temperature", type=float, default=0.8)
    sample.add_argument("--top-k", type=int, default=40)
    sample.add_argument("--seed", type=int, default=0)
    sample.set_defaults(func=_cmd_sample)
    return parser


def main(argv=None) -> int:
    """Entry point of the ``mpishard`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    from .backend import BackendUnavailable, OutOfMemoryBudget
    from .checkpoint import CheckpointError
    from .comm import LauncherMismatch, install_abort_hook
    from .config import ConfigError
    from .data import DataError

    # Raised alike on every rank (see train._agree): one line, exit 2 everywhere.
    user_errors = (ConfigError, DataError, LauncherMismatch, BackendUnavailable,
                   OutOfMemoryBudget, CheckpointError)
    install_abort_hook()
    try:
        return int(args.func(args) or 0)
    except user_errors as err:
        if _env_rank() == 0:
            print(f"mpishard: error: {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())

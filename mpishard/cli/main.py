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

from mpishard import __version__

__all__ = ["main", "build_parser"]


def _env_rank() -> int:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage of ``train`` alone is 33), printed
    by rank 0 only (every rank still exits 2), and a flag must be spelled out (``--n-lay``
    is not silently ``--n-layer``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        if _env_rank() == 0:
            sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def _cmd_info(args) -> int:
    import numpy as np

    import mpi4py
    from mpi4py import MPI

    from mpishard.core.backend import cupy_or_none, visible_gpu_count
    from mpishard.comm import Communicator, format_rank_reports, rank_report
    from mpishard.comm.gpu import loaded_libmpi
    from mpishard.kernels import describe as describe_kernels
    from mpishard.kernels.cpu.blas import describe as describe_blas

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
    print(f"kernels    {describe_kernels()}")
    if cupy is not None and visible_gpu_count(cupy):
        from mpishard.kernels.cuda.headers import describe as describe_tensor_cores
        print(f"tensor-core attention {describe_tensor_cores(cupy)}")
    print(f"CPU BLAS   {describe_blas()}")
    print(f"world size {world.size}")
    print(format_rank_reports(reports))
    return 0


def _cmd_train(args) -> int:
    from mpi4py import MPI

    from mpishard.comm import Communicator, check_launcher
    from mpishard.config.flags import config_from_args
    from mpishard.run.train import run

    world = Communicator.from_env(MPI.COMM_WORLD)
    check_launcher(world)
    notes: list = []
    given: set = set()
    cfg = config_from_args(args, notes, given)
    if cfg.parallel.layout:     # auto or auto-all: planned on rank 0, the same everywhere
        notes.append(_agreed_layout(world, cfg, given))
    summary = run(cfg, world, notes)
    if summary.get("diverged"):
        return 3                  # final: a restart from the last checkpoint would repeat it
    return 130 if summary.get("interrupted") else 0     # a shell's status after Ctrl-C


def _cmd_supervise(args) -> int:
    """``mpishard supervise``: one plain process, no MPI (see mpishard/run/supervise.py)."""
    from mpishard.config.flags import config_from_args
    from mpishard.config.sections import ConfigError
    from mpishard.run.supervise import supervise, train_args

    job = args.job[1:] if args.job[:1] == ["--"] else args.job
    try:
        if not job:
            raise ConfigError("mpishard supervise needs the job's command after --: "
                              "mpishard supervise -- mpiexec -n 4 python -m mpi4py -m "
                              "mpishard train ...")
        try:
            ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
        except ValueError:
            raise ConfigError(f"--ranks {args.ranks} is not a list of rank counts; pass "
                              f"e.g. --ranks 4,2") from None
        if any(r < 1 for r in ranks):
            raise ConfigError(f"--ranks {args.ranks}: each count must be at least 1")
        train = [a.replace("{ranks}", "1") for a in train_args(job)]
        cfg = config_from_args(_parse(build_parser(), ["train", *train]), [])
        return supervise(job, cfg, args.max_restarts, args.backoff, ranks)
    except ConfigError as err:
        print(f"mpishard: error: {err}", file=sys.stderr, flush=True)
        return 2


def _agreed_layout(world, cfg, given) -> str:
    """``--layout auto`` (keeping the layout keys of ``given``) or ``auto-all``: rank 0
    plans, every rank takes its choice (or its error)."""
    from mpishard.config.sections import ConfigError
    from mpishard.cli.plan import apply_auto_layout
    chosen = None
    if world.rank == 0:
        try:
            line = apply_auto_layout(cfg, world.size, given)
            chosen = ("ok", line, cfg.parallel, cfg.optim, cfg.model.activation_checkpointing)
        except ConfigError as err:
            chosen = ("error", str(err))
    chosen = world.broadcast_obj(chosen, root=0)
    if chosen[0] == "error":
        raise ConfigError(chosen[1])
    _, line, cfg.parallel, cfg.optim, cfg.model.activation_checkpointing = chosen
    return line


def _cmd_estimate(args) -> int:
    from mpishard.core.backend import Backend
    from mpishard.config.sections import ConfigError
    from mpishard.config.flags import config_from_args
    from mpishard.parallel import STRATEGIES
    from mpishard.planning.layout import estimate_layout
    from mpishard.recipes import recipe_for
    from mpishard.run.train import layout_of

    cfg = config_from_args(args)
    recipe = recipe_for(cfg)
    p = cfg.parallel
    dp = p.dp or (p.dp_replicate * p.dp_shard if p.dp_shard else p.dp_replicate)
    strategies = [cfg.parallel.strategy] if args.config or args.strategy is not None else \
        list(STRATEGIES)
    if len(strategies) > 1 and cfg.parallel.offload != "none":   # those that can offload it
        can = [name for name in strategies if _offloads(name, cfg.parallel.offload)]
        if can != strategies:
            print(f"--offload {cfg.parallel.offload}: {', '.join(can)} only "
                  f"({', '.join(n for n in strategies if n not in can)} cannot offload that)")
        strategies = can
    budget = cfg.run.memory_budget
    from mpishard.cli.plan import machine_or_error, plan_backend
    machine = machine_or_error(args.machine) if getattr(args, "machine", None) else None
    if machine is not None and cfg.parallel.offload != "none":
        from mpishard.planning.offload import offload_untimed
        if why := offload_untimed(machine):
            raise ConfigError(f"--offload {cfg.parallel.offload}: {why}; or leave out "
                              f"--machine (the memory rows need none)")
    for strategy in strategies:
        cfg.parallel.strategy = strategy
        try:   # each plan consumes its model (layers are swapped for tensor-parallel ones)
            layout = layout_of(cfg, dp, recipe)
            plan = estimate_layout(recipe.model(plan_backend(machine)), layout)
        except ValueError as err:   # tp larger than n_head, pp than n_layer, ...
            raise ConfigError(str(err)) from None
        print(plan.format())
        if machine is not None:
            print(_time_rows(recipe, layout, machine, plan))
        if budget:
            fits = plan.total_peak_bytes <= budget
            print(f"  budget      {budget / 2**20:10.2f} MiB per rank: "
                  f"{'fits' if fits else 'does not fit'}")
    return 0


def _offloads(strategy: str, offload: str) -> bool:
    """Whether the registered ``strategy`` can offload ``offload``."""
    from mpishard.parallel.offload import check_offload
    from mpishard.parallel.strategy import strategy_entry
    try:
        check_offload(offload, strategy_entry(strategy).cls)
    except ValueError:
        return False
    return True


def _time_rows(recipe, layout, machine, plan) -> str:
    """The estimate's time lines: predicted step, tokens/s, MFU and where the time goes."""
    from mpishard.core.backend import Backend
    from mpishard.planning import predict_step
    cost = predict_step(lambda: recipe.model(Backend()), layout, machine, plan=plan)
    parts = ", ".join(f"{k} {v:.4f}" for k, v in cost.breakdown.items() if v)
    return (f"  {'step':<12}{cost.seconds:10.4f} s on {machine.name} ({cost.tokens_per_s:,.0f} "
            f"tokens/s, MFU {cost.mfu:.1%}; exposed communication "
            f"{cost.exposed_comm:.4f} s)\n  {'where':<12}{parts}")


def _cmd_sample(args) -> int:
    from mpi4py import MPI

    from mpishard.core.backend import Backend
    from mpishard.checkpoint import CheckpointError, load_checkpoint, read_manifest, resolve_checkpoint
    from mpishard.comm import Communicator, Mesh
    from mpishard.config.sections import ConfigError, config_from_dict, flat_values
    from mpishard.parallel import DataParallel
    from mpishard.recipes import recipe_for

    step_dir = resolve_checkpoint(args.checkpoint)
    extra = read_manifest(step_dir).extra
    saved = extra.get("config")
    cfg = config_from_dict(flat_values(saved, str(step_dir), [])) if saved else None
    recipe = recipe_for(cfg) if cfg is not None else None
    if recipe is not None and hasattr(recipe, "token_data"):
        recipe.token_data = extra.get("token_data")    # what the run trained on
    if recipe is None or not recipe.can_sample:
        raise CheckpointError(step_dir, "config", "no training config of a model that writes "
                              "text in the manifest; sample needs a checkpoint written by "
                              "'mpishard train --model gpt'")
    if args.tokens < 1:
        raise ConfigError(f"--tokens must be >= 1, got {args.tokens}")
    if not args.temperature >= 0:
        raise ConfigError(f"--temperature {args.temperature} must be >= 0 (0: the most likely "
                          f"token each time)")
    if args.top_k < 0:
        raise ConfigError(f"--top-k {args.top_k} must be >= 0 (0: all tokens)")
    world = Communicator.from_env(MPI.COMM_SELF)      # one process, whatever the saved layout
    model = DataParallel(recipe.model(Backend()), Mesh(world))
    load_checkpoint(step_dir, model, None, world=world)
    text = recipe.sample(model.module, args.prompt, args.tokens, args.seed,
                         temperature=args.temperature, top_k=args.top_k)
    if MPI.COMM_WORLD.rank == 0:
        print(text)
    return 0


def _cmd_bench(args) -> int:
    if args.what in ("comm", "calibrate"):
        from mpishard.bench import calibrate, comm

        (comm if args.what == "comm" else calibrate).main(args.rest)
        return 0
    import runpy

    script = {"step": "step.py", "strategies": "strategies.py"}[args.what]
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "benchmarks", script)
    if not os.path.exists(path):
        from mpishard.config.sections import ConfigError

        raise ConfigError(f"benchmark script {path} not found; run it from a source checkout")
    sys.argv = [path, *args.rest]
    runpy.run_path(path, run_name="__main__")
    return 0


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the environment table's line breaks (descriptions are wrapped by :func:`_wrap`)."""


def _wrap(text: str) -> str:
    import textwrap

    return textwrap.fill(text, 79)


def _environment_help() -> str:
    from mpishard.comm.env import ENVIRONMENT

    import textwrap

    table = dict(ENVIRONMENT, OMP_NUM_THREADS="BLAS threads per rank; with several ranks per "
                 "node set it to cores // ranks (1 when oversubscribed)")
    rows = [textwrap.fill(text, 79, initial_indent=f"  {name:<24}", subsequent_indent=" " * 26)
            for name, text in table.items()]
    return "environment variables:\n" + "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    from mpishard.config.flags import add_config_flags
    from mpishard.cli.checkpoint import add_checkpoint_commands
    from mpishard.run.plot import add_plot_command
    from mpishard.cli.plan import add_plan_command
    from mpishard.data.prepare import add_prepare_command

    parser = _Parser(prog="mpishard", description="Readable model sharding on NumPy/CuPy "
                     "and mpi4py. Launch multi-rank commands as "
                     "'mpiexec -n N python -m mpi4py -m mpishard ...'.")
    parser.add_argument("--version", action="version", version=f"mpishard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    info = sub.add_parser("info", help="versions, MPI library, backend and device of each rank")
    info.set_defaults(func=_cmd_info)

    train = sub.add_parser("train", help="train a model (GPT or Llama on text or token ids, MLP on "
                           "digits)",
                           description=_wrap("Train a model on every rank of the job. "
                           "Settings come from the defaults, then --config FILE, then these "
                           "flags; each flag is also a key of its [section] in the TOML file."),
                           epilog=_environment_help(), formatter_class=_Formatter)
    train.add_argument("--config", help="TOML file with training settings")
    add_config_flags(train, "train")
    train.set_defaults(func=_cmd_train)

    estimate = sub.add_parser("estimate", help="per-rank memory by category, before training",
                              description=_wrap("Predict per-rank memory (and bus bytes per "
                              "step) of a layout without building it; without --strategy, "
                              "every registered strategy."), formatter_class=_Formatter)
    estimate.add_argument("--config", help="TOML file with training settings")
    estimate.add_argument("--machine", help="also predict the step time on this machine (a "
                          "description file or a shipped name, see mpishard plan)")
    add_config_flags(estimate, "estimate")
    estimate.set_defaults(func=_cmd_estimate)
    bench = sub.add_parser("bench", help="benchmarks: comm (collectives vs raw mpi4py), "
                           "step (one process vs torch), strategies (DDP/ZeRO vs torch), "
                           "calibrate (measure this machine for mpishard plan)")
    bench.add_argument("what", choices=["comm", "step", "strategies", "calibrate"])
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    bench.set_defaults(func=_cmd_bench)
    add_plot_command(sub)
    add_plan_command(sub)
    add_checkpoint_commands(sub)
    add_prepare_command(sub)

    supervise = sub.add_parser(
        "supervise", help="run a training job; restart it from its newest checkpoint when "
        "it fails", formatter_class=_Formatter,
        description=_wrap("Run a training job and, when it fails for another reason than a "
                          "usage or configuration error (status 2) or Ctrl-C (130), "
                          "restart it with --resume true from its newest complete "
                          "checkpoint, up to --max-restarts times. Each restart is one line "
                          "here and one record in the run's metrics file. Not under "
                          "mpiexec: it starts the job's own launcher."),
        epilog="example: mpishard supervise --max-restarts 5 -- mpiexec -n 4 python -m "
               "mpi4py -m mpishard train --config run.toml --checkpoint-dir ckpt")
    supervise.add_argument("--max-restarts", type=int, default=3, help="restarts at most")
    supervise.add_argument("--backoff", type=float, default=5.0, help="seconds before the "
                           "first restart (doubling after each, at most 60)")
    supervise.add_argument("--ranks", default="", help="ranks of each attempt, e.g. 4,2: "
                           "{ranks} in the command is replaced by them in turn")
    supervise.add_argument("job", nargs=argparse.REMAINDER, help="-- and the job's command")
    supervise.set_defaults(func=_cmd_supervise)

    sample = sub.add_parser("sample", help="generate text from a language-model checkpoint "
                            "(any layout)")
    sample.add_argument("--checkpoint", required=True,
                        help="checkpoint root (its newest step) or a step-N directory")
    sample.add_argument("--prompt", default="def ", help="text to continue")
    sample.add_argument("--tokens", type=int, default=200, help="tokens to generate (bytes for a "
                        "model trained on text as bytes)")
    sample.add_argument("--temperature", type=float, default=0.8, help="softmax temperature "
                        "(0: the most likely token each time)")
    sample.add_argument("--top-k", type=int, default=40, help="sample among the k most likely "
                        "tokens (0: all)")
    sample.add_argument("--seed", type=int, default=0)
    sample.set_defaults(func=_cmd_sample)
    parser.commands = dict(sub.choices)   # name -> its parser (unknown-flag errors)
    return parser


def _parse(parser, argv):
    """Parse; an unknown flag is an error of its command, naming the closest real flag."""
    from mpishard.config.sections import closest_key

    args, extra = parser.parse_known_args(argv)
    if extra:
        command = parser.commands.get(getattr(args, "command", None), parser)
        flags = [o for a in command._actions for o in a.option_strings if o.startswith("--")]
        unknown = next((e.split("=")[0] for e in extra if e.startswith("--")), None)
        hint = ""
        if unknown:
            match = closest_key(unknown[2:].replace("-", "_"),
                                [f[2:].replace("-", "_") for f in flags])
            hint = f"; did you mean --{match.replace('_', '-')}?" if match else ""
        command.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return args


def main(argv=None) -> int:
    """Entry point of the ``mpishard`` command; returns the exit status.

    A user error is raised alike on every rank (by construction, or agreed
    first: [Note: agreed errors] in mpishard/core/agree.py): rank 0 prints one line
    and every rank returns 2. A memory budget overrun happens on the ranks
    that overran only, so it aborts the job, naming the rank.
    """
    args = _parse(build_parser(), argv)
    if args.command == "supervise":         # no MPI here: the job has its own launcher
        return _cmd_supervise(args)
    from mpishard.core.backend import BackendUnavailable, OutOfMemoryBudget
    from mpishard.checkpoint import CheckpointError
    from mpishard.comm import LauncherMismatch, install_abort_hook
    from mpishard.comm.env import SettingError
    from mpishard.config.sections import ConfigError
    from mpishard.data.corpus import DataError

    agreed_errors = (ConfigError, DataError, LauncherMismatch, BackendUnavailable,
                     CheckpointError, SettingError)  # SettingError: agreed in Communicator.from_env
    install_abort_hook()
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:          # output piped into a reader that stopped (| head)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except agreed_errors as err:
        if _env_rank() == 0:
            print(f"mpishard: error: {err}", file=sys.stderr, flush=True)
        return 2
    except OutOfMemoryBudget as err:
        # one write: print's message and newline are two, and ranks' lines ran together
        sys.stderr.write(f"mpishard: error on rank {_env_rank()}: {err}\n")
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(2)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Job-level failure handling: abort on unhandled exceptions, launcher check.

Both are for entry points (the CLI, examples, scripts); importing mpishard
changes nothing. The launch form that makes one rank's exception end the whole
job even without this hook is ``python -m mpi4py`` (mpi4py then calls
``MPI_Abort`` itself):

    mpiexec -n 4 python -m mpi4py -m mpishard train
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback

from mpi4py import MPI

from mpishard.comm.debug import rank_prefix

__all__ = ["install_abort_hook", "check_launcher", "LauncherMismatch"]


#: how long a failing rank waits between writing its report and aborting the job
FORWARD_SECONDS = 0.25


class LauncherMismatch(RuntimeError):
    """The launcher started several tasks but MPI sees a world of one."""


def _report(exc_type, exc, tb, communicators) -> str:
    prefix = rank_prefix()
    text = "".join(traceback.format_exception(exc_type, exc, tb)).rstrip()
    lines = [f"{prefix} {line}" for line in text.splitlines()]
    for comm in communicators:
        lines.append(f"{prefix} last collectives of {comm.name!r} and its family "
                     f"(oldest first):")
        lines.extend(f"{prefix}   {line}" for line in comm.format_history().splitlines())
    return "\n".join(lines) + "\n"


def install_abort_hook(*communicators, threads: bool = True) -> None:
    """Make an unhandled exception on any rank abort the whole job.

    The hook prints the traceback with every line prefixed by
    ``[mpishard rank R/N]`` (so interleaved output from many ranks stays
    readable), then the call histories of ``communicators`` (see
    [Note: collective order]), then calls ``MPI.COMM_WORLD.Abort(1)``, which ends
    every rank with a non-zero exit code instead of leaving the others waiting in
    their next collective. Ctrl-C (``KeyboardInterrupt``) prints one line and aborts
    with 130. (A training loop catches the first Ctrl-C itself and saves: see
    :class:`~mpishard.checkpoint.StopSignals`.)

    Args:
        *communicators: Communicators whose recent collectives to print.
        threads: also abort on an unhandled exception in another thread.
    """
    def abort(exc_type, exc, tb):
        try:
            if issubclass(exc_type, KeyboardInterrupt):   # Ctrl-C: not a failure to explain
                sys.stderr.write(f"{rank_prefix()} interrupted (Ctrl-C)\n")
            else:
                sys.stderr.write(_report(exc_type, exc, tb, communicators))
            sys.stderr.flush()
            # the report is in the pipe to the launcher, which relays it; MPI_Abort has the
            # launcher kill every rank at once, and a launcher that has not read the pipe
            # by then drops it (seen with MPICH's Hydra: a job that ended with no output)
            time.sleep(FORWARD_SECONDS)
        finally:
            MPI.COMM_WORLD.Abort(130 if issubclass(exc_type, KeyboardInterrupt) else 1)

    sys.excepthook = abort
    if threads:
        threading.excepthook = lambda args: abort(args.exc_type, args.exc_value,
                                                  args.exc_traceback)


# Variables a launcher sets to tell the ranks how many of them it started.
_LAUNCHER_SIZES = (
    ("SLURM_STEP_NUM_TASKS", "Slurm (srun)"),
    ("SLURM_NTASKS", "Slurm"),
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
    ("PMI_SIZE", "a PMI launcher (MPICH/Hydra mpiexec, srun --mpi=pmi2)"),
)


def check_launcher(world, environ=None) -> None:
    """Fail fast when the launcher and the MPI library do not understand each other.

    If a launcher started N > 1 tasks but MPI reports a world of size 1, each
    task is running alone: the MPI library mpi4py loaded does not speak the
    launcher's process-management interface (PMI). Training would run N
    independent copies. Entry points call this right after building the world.

    Args:
        world: the world :class:`~mpishard.comm.Communicator` (or mpi4py comm).
        environ: where to read launcher variables (default ``os.environ``).

    Raises:
        LauncherMismatch: the message names the variable, the library and fixes.
    """
    size = world.size if hasattr(world, "size") else world.Get_size()
    if size != 1:
        return
    environ = os.environ if environ is None else environ
    for var, launcher in _LAUNCHER_SIZES:
        value = environ.get(var, "")
        if var == "SLURM_NTASKS" and environ.get("SLURM_STEP_NUM_TASKS"):
            continue  # inside a step, its own task count is the one that matters
        if not value.isdigit() or int(value) <= 1:
            continue
        from mpishard.comm.gpu import loaded_libmpi  # noqa: PLC0415

        library = f"{MPI.get_vendor()[0]} ({loaded_libmpi() or 'unknown path'})"
        raise LauncherMismatch(
            f"{launcher} started {value} tasks ({var}={value}) but MPI sees a world of "
            f"size 1: the MPI library mpi4py loaded, {library}, does not speak this "
            f"launcher's PMI, so every task would train alone. Launch with the "
            f"mpiexec that belongs to that library (mpiexec -n {value} python -m mpi4py "
            f"...), or under Slurm use srun --mpi=pmix / --mpi=pmi2 (srun --mpi=list "
            f"shows what the cluster offers) with an MPI that supports it; point "
            f"mpi4py at the system MPI with MPI4PY_LIBMPI or install mpi4py against "
            f"it (python -m mpi4py --mpi-library shows the one in use)")

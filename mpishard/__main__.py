"""``python -m mpishard`` is the ``mpishard`` command.

Launched as ``mpiexec ... python -m mpi4py -m mpishard ...``, a non-zero exit
would make mpi4py call ``MPI_Abort`` (and MPI print its abort lines on every
rank). An error the ranks agreed on (every rank returns the same status, see
mpishard.cli.main; usage errors too) is not a crash: MPI is finalised here, then
every rank exits with that status through the normal interpreter exit. That
exit matters: MPI libraries finish their handshake with the launcher in exit
handlers (without it MPICH's Hydra takes the first rank to leave for a crash,
kills the others and the job's status becomes 9), so no ``os._exit``.
Anything unexpected still aborts the job (the abort hook).

[Note: GPU before MPI]
A CUDA-aware MPI (UCX, Open MPI's CUDA support, MVAPICH2-GDR) creates or
adopts a CUDA context on the *current* device while it initialises. If that
happens before the rank has chosen its GPU, every rank's context lands on GPU
0 of its node. So before anything imports ``mpi4py.MPI`` (mpishard.comm does,
and ``python -m mpi4py`` does not), :func:`bind_device_before_mpi` reads the
node-local rank the launcher exported (:data:`LOCAL_RANK_VARS`) and, when the
command will use a GPU (``--backend cupy|auto`` on the command line or in the
``--config`` file, or ``mpishard info``) and CuPy is installed, makes GPU
``local_rank % visible GPUs`` current. It records what it did in
``MPISHARD_DEVICE_BEFORE_MPI`` (JSON, with this process's id so a child
process does not take it for its own); :func:`mpishard.comm.node_local_rank`
compares it with MPI's own node-local rank after MPI starts and warns, naming
both, when they differ (the GPU the backend then binds follows MPI's).
"""
import importlib.util
import json
import os
import sys

__all__ = ["LOCAL_RANK_VARS", "launcher_local_rank", "wants_gpu", "bind_device_before_mpi",
           "DEVICE_BEFORE_MPI"]

#: Where launchers put the node-local rank, most specific first: a Slurm batch
#: step has SLURM_LOCALID=0 too, which ranks started by mpiexec inherit.
LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK",
                   "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
#: The record :func:`bind_device_before_mpi` leaves (see [Note: GPU before MPI]).
DEVICE_BEFORE_MPI = "MPISHARD_DEVICE_BEFORE_MPI"


def launcher_local_rank(environ) -> tuple[int, str] | None:
    """``(node-local rank, the variable it came from)``, or ``None`` outside a launcher."""
    for var in LOCAL_RANK_VARS:
        value = environ.get(var, "").strip()
        if value.isdigit():
            return int(value), var
    return None


def _option(argv: list, name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def wants_gpu(argv: list) -> bool:
    """Whether the command line asks for a GPU backend (or is ``info``)."""
    if argv[:1] == ["info"]:
        return True
    backend = _option(argv, "--backend")
    config = _option(argv, "--config")
    if backend is None and config:
        try:
            import tomllib  # noqa: PLC0415 (Python 3.11+; else the flag alone decides)

            with open(config, "rb") as f:
                backend = tomllib.load(f).get("run", {}).get("backend")
        except (ImportError, OSError, ValueError, AttributeError):
            backend = None
    return backend in ("cupy", "auto")


def bind_device_before_mpi(argv: list, environ=None) -> dict | None:
    """Make this rank's GPU current before MPI starts (see [Note: GPU before MPI]).

    Returns what was bound (``device``, ``local_rank``, ``source``, ``pid``,
    also stored as JSON in ``environ[DEVICE_BEFORE_MPI]``), or ``None``: no
    launcher, MPI already imported, no GPU wanted, no CuPy, no GPU visible.
    """
    environ = os.environ if environ is None else environ
    environ.pop(DEVICE_BEFORE_MPI, None)
    found = launcher_local_rank(environ)
    if found is None or "mpi4py.MPI" in sys.modules or not wants_gpu(argv):
        return None
    if importlib.util.find_spec("cupy") is None:
        return None
    try:
        import cupy  # noqa: PLC0415

        gpus = int(cupy.cuda.runtime.getDeviceCount())
        if gpus == 0:
            return None
        local_rank, source = found
        device = local_rank % gpus
        cupy.cuda.Device(device).use()
    except Exception:  # noqa: BLE001 (no driver, a CUDA library that does not load)
        return None
    record = {"device": device, "gpus": gpus, "local_rank": local_rank, "source": source,
              "pid": os.getpid()}
    environ[DEVICE_BEFORE_MPI] = json.dumps(record)
    return record


def _main() -> None:
    if sys.argv[1:2] == ["supervise"]:     # starts the job's launcher; is no MPI process
        import mpi4py  # noqa: PLC0415

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
    bind_device_before_mpi(sys.argv[1:])
    from mpishard.cli.main import main  # noqa: PLC0415 (after the GPU is bound)

    try:
        status = main()
    except SystemExit as done:  # a usage error (argparse), alike on every rank, or --help
        status = done.code if isinstance(done.code, int) else (0 if done.code is None else 2)
    if status:
        sys.stdout.flush()
        sys.stderr.flush()
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    sys.exit(status)


if __name__ == "__main__":
    _main()

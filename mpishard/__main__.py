"""``python -m mpishard`` is the ``mpishard`` command.

Launched as ``mpiexec ... python -m mpi4py -m mpishard ...``, a non-zero exit
would make mpi4py call ``MPI_Abort`` (and MPI print its abort lines on every
rank). An error the ranks agreed on (every rank returns the same status, see
mpishard.cli; usage errors too) is not a crash: MPI is finalised here, then
every rank exits with that status through the normal interpreter exit. That
exit matters: MPI libraries finish their handshake with the launcher in exit
handlers (without it MPICH's Hydra takes the first rank to leave for a crash,
kills the others and the job's status becomes 9), so no ``os._exit``.
Anything unexpected still aborts the job (the abort hook).
"""
import sys

from .cli import main

try:
    status = main()
except SystemExit as done:      # a usage error (argparse), alike on every rank, or --help
    status = done.code if isinstance(done.code, int) else (0 if done.code is None else 2)
if status:
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
sys.exit(status)

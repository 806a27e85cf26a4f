"""``python -m mpishard`` is the ``mpishard`` command.

Launched as ``mpiexec ... python -m mpi4py -m mpishard ...``, a non-zero exit
would make mpi4py call ``MPI_Abort`` (and MPI print its abort lines on every
rank). An error the ranks agreed on (every rank returns the same status, see
mpishard.cli) is not a crash: MPI is finalised normally and every rank exits
with that status. Anything unexpected still aborts the job (the abort hook).
"""
import os
import sys

from .cli import main

status = main()
if status:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
sys.exit(status)

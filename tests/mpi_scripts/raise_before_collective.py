"""Rank 1 raises before a collective the other ranks are already waiting in.

    mpiexec -n 2 python tests/mpi_scripts/raise_before_collective.py --hook
    mpiexec -n 2 python -m mpi4py tests/mpi_scripts/raise_before_collective.py

Expected: the job ends quickly with a non-zero exit code and rank 1's
traceback (with ``--hook``: every line prefixed ``[mpishard rank 1/2]``, then
rank 1's ledger). Without the hook and without ``-m mpi4py`` it would hang.
"""
import sys

import numpy as np
from mpi4py import MPI

from mpishard.comm import Communicator, install_abort_hook

world = Communicator(MPI.COMM_WORLD, "world")
if "--hook" in sys.argv:
    install_abort_hook(world)
world.all_reduce(np.ones(4))  # one collective that works, for the ledger
if world.rank == 1:
    raise RuntimeError("rank 1 fails on purpose before the second all_reduce")
world.all_reduce(np.ones(4))
print(f"rank {world.rank} finished (should not happen)", flush=True)

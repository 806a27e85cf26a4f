"""Rank 1 reaches a barrier late, past the timeout, and both ranks then finish.

    MPISHARD_TIMEOUT=0.2 mpiexec -n 2 python -m mpi4py tests/mpi_scripts/late_collective.py

Expected: rank 0's watchdog fires (``CollectiveTimeout``: barrier #2), and although the
program ends before the watchdog's grace is over, the job still exits with code 124.
"""
import time

import numpy as np
from mpi4py import MPI

from mpishard.comm import Communicator

world = Communicator.from_env(MPI.COMM_WORLD)
assert world.timeout, "run with MPISHARD_TIMEOUT=0.2"
world.all_reduce(np.ones(4))
if world.rank == 1:
    time.sleep(3 * world.timeout)
world.barrier()
print(f"rank {world.rank} finished", flush=True)

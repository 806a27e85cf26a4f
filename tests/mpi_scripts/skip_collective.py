"""Rank 1 skips one all_reduce and waits in a barrier; the watchdog ends the job.

    MPISHARD_TIMEOUT=3 mpiexec -n 2 python -m mpi4py tests/mpi_scripts/skip_collective.py

Expected: after about 3 s every stuck rank prints ``CollectiveTimeout`` naming
its stuck operation (rank 0: all_reduce #3, rank 1: barrier #3) and its
ledger, and the job exits with code 124.
"""
import numpy as np
from mpi4py import MPI

from mpishard.comm import Communicator

world = Communicator.from_env(MPI.COMM_WORLD)
assert world.timeout, "run with MPISHARD_TIMEOUT=3"
world.all_reduce(np.ones(4))
world.broadcast(np.ones(2), root=0)
if world.rank != 1:
    world.all_reduce(np.ones(8, np.float32))
world.barrier()
print(f"rank {world.rank} finished (should not happen)", flush=True)

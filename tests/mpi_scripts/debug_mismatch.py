"""Two ranks call all_reduce with different shapes, in debug mode.

    MPISHARD_DEBUG=1 mpiexec -n 2 python -m mpi4py tests/mpi_scripts/debug_mismatch.py [OUT_DIR]

Expected: every rank raises CollectiveMismatch naming both shapes; each prints
``rank R caught CollectiveMismatch: ...`` (also to ``OUT_DIR/rank<R>.txt``, since
the launcher may interleave long lines from different ranks) and exits 0.
"""
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from mpishard.comm import CollectiveMismatch, Communicator

world = Communicator.from_env(MPI.COMM_WORLD)
assert world.debug, "run with MPISHARD_DEBUG=1"
world.all_reduce(np.ones(3))
try:
    world.all_reduce(np.ones(4 if world.rank == 0 else 5, np.float32))
except CollectiveMismatch as exc:
    report = f"rank {world.rank} caught CollectiveMismatch: {exc}"
    print(report, flush=True)
    if len(sys.argv) > 1:
        Path(sys.argv[1], f"rank{world.rank}.txt").write_text(report)
    sys.exit(0)
print(f"rank {world.rank}: no CollectiveMismatch raised", flush=True)
sys.exit(3)

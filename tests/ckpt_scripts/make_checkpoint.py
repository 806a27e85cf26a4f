"""Save a small ZeRO-3 checkpoint from every rank (the fixture of the fuzz test).

    mpiexec -n 2 python -m mpi4py tests/ckpt_scripts/make_checkpoint.py OUT_DIR

A two-layer MLP (4 parameters, 12 tensors with AdamW's state), each layer's
flat buffer split between the ranks, so pieces of one tensor sit in two files;
small, so that thousands of damaged copies verify quickly.
"""
import sys

import numpy as np
from mpi4py import MPI

from mpishard.checkpoint import save_checkpoint
from mpishard.comm import Communicator, Mesh
from mpishard.models import MLPClassifier
from mpishard.optim import AdamW
from mpishard.parallel import ZeRO

world = Communicator(MPI.COMM_WORLD)
strategy = ZeRO(MLPClassifier(6, (5,), 3, materialize_now=False), Mesh(world), stage=3)
opt = AdamW(strategy.parameters(), lr=1e-3)
rng = np.random.default_rng(world.rank)
_, loss = strategy(rng.standard_normal((4, 6)).astype(np.float32), rng.integers(0, 3, 4))
loss.backward()
strategy.step(opt)
save_checkpoint(sys.argv[1], 1, strategy, opt, extra_state={"data": {"epoch": 0, "index": 4}})

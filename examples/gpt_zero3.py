"""Train a byte-level GPT on text with ZeRO-3, written against the library API.

    mpiexec -n 4 python -m mpi4py examples/gpt_zero3.py --steps 100
    mpiexec -n 4 python -m mpi4py examples/gpt_zero3.py --data README.md --steps 50

No rank ever holds the whole model: parameters are built one tensor at a time
from (seed, name) straight into each rank's shard, gathered per block for
forward and backward, and released after. The same loop as a single-process
script, plus a mesh and one wrapper.
"""
import argparse

import numpy as np
from mpi4py import MPI

import mpishard
from mpishard.comm import Communicator, Mesh
from mpishard.data.corpus import BatchSampler, load_corpus
from mpishard.models import GPT, GPTConfig
from mpishard.optim import AdamW, CosineSchedule
from mpishard.parallel import ZeRO

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--data", default=None, help="text file or folder (default: stdlib sources)")
parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
args = parser.parse_args()

mpishard.install_abort_hook()
world = Communicator.from_env(MPI.COMM_WORLD)
mesh = Mesh(world, dp=world.size)
corpus = load_corpus(args.data, max_bytes=1_000_000, min_bytes=65)
config = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)
model = ZeRO(GPT(config, seed=0, materialize_now=False), mesh, stage=3)
opt = AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
            ledger=model.ledger)
schedule = CosineSchedule(3e-3, warmup_steps=min(10, args.steps), decay_steps=args.steps,
                          min_lr=3e-4)
sampler = BatchSampler(corpus.train, 64, args.batch, mesh.dp_rank, mesh.dp.size, seed=0)

for step in range(args.steps):
    opt.lr = schedule(step)
    x, y = sampler.next_batch()                  # a different batch on every rank
    _, loss = model(x, y)
    loss.backward()
    result = model.step(opt, max_norm=1.0)       # reduce-scatter, clip, update, zero
    mean = np.array([loss.item()])
    world.all_reduce(mean, op="avg")
    if world.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
        print(f"step {step}: loss {mean[0]:.3f}, grad norm {result.grad_norm:.2f}, "
              f"{sum(model.ledger.bytes_by_category().values()) / 2**20:.2f} MiB per rank")

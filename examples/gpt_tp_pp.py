"""A GPT on a dp x tp x pp mesh: tensor-parallel layers, pipeline stages, ZeRO over dp.

    mpiexec -n 4 python -m mpi4py examples/gpt_tp_pp.py --tp 2 --pp 2 --steps 30
    mpiexec -n 4 python -m mpi4py examples/gpt_tp_pp.py --dp 2 --tp 2 --pp 1 --strategy zero3

Every rank builds only its pipeline stage, and of that only its tensor-parallel
slices (cut from the same (seed, name) initialisation as the whole model).
Each step runs ``--micro`` micro-batches through the pipeline (1F1B) and
then reduces gradients over dp.
"""
import argparse

import numpy as np
from mpi4py import MPI

import mpishard
from mpishard.comm import Communicator, Mesh
from mpishard.data.corpus import BatchSampler, load_corpus
from mpishard.models import GPT, GPTConfig
from mpishard.optim import AdamW
from mpishard.parallel import ParallelModel

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--dp", type=int, default=None)
parser.add_argument("--tp", type=int, default=2)
parser.add_argument("--pp", type=int, default=2)
parser.add_argument("--strategy", default="zero1", choices=["ddp", "zero1", "zero2", "zero3"])
parser.add_argument("--micro", type=int, default=4, help="micro-batches per step")
parser.add_argument("--steps", type=int, default=30)
args = parser.parse_args()

mpishard.install_abort_hook()
world = Communicator.from_env(MPI.COMM_WORLD)
mesh = Mesh(world, dp=args.dp, tp=args.tp, pp=args.pp)
config = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64)
run = ParallelModel(GPT(config, materialize_now=False), mesh, strategy=args.strategy,
                    micro_batches=args.micro)
opt = AdamW(run.parameters(), lr=3e-3, betas=(0.9, 0.95), ledger=run.ledger)
corpus = load_corpus(None, max_bytes=500_000)
sampler = BatchSampler(corpus.train, 64, 2 * args.micro, mesh.dp_rank, mesh.dp.size, seed=0)
stage = run.module.block_ids
print(f"rank {world.rank}: dp {mesh.dp.rank}, tp {mesh.tp.rank}, pp {mesh.pp.rank} "
      f"holds blocks {stage[0]}..{stage[-1]}, "
      f"{sum(p.size for p in run.module.parameters()):,} parameters", flush=True)
for step in range(args.steps):
    loss = run.train_step(*sampler.next_batch())       # same batch on tp/pp peers
    run.step(opt, max_norm=1.0)
    mean = np.array([loss])
    mesh.dp.all_reduce(mean, op="avg")
    if world.rank == 0 and (step % 5 == 0 or step == args.steps - 1):
        print(f"step {step}: loss {mean[0]:.3f}, pipeline idle "
              f"{run.pipeline.idle_fraction:.2f}")

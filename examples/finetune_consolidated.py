"""Fine-tune from a consolidated checkpoint (one safetensors file, nanoGPT names).

    mpiexec -n 2 python -m mpi4py -m mpishard train --steps 50 --checkpoint-dir runs/base
    mpishard checkpoint consolidate runs/base runs/base.safetensors
    mpiexec -n 2 python -m mpi4py examples/finetune_consolidated.py runs/base.safetensors \
        --data README.md --steps 20

The consolidated file is what a PyTorch nanoGPT loads with
``safetensors.torch.load_file`` + ``load_state_dict``; here it seeds a ZeRO-2
run on new text. The model shape must match the file's (the defaults of
``mpishard train``: 2 layers, 4 heads, width 64, block 64).
"""
import argparse

import numpy as np
from mpi4py import MPI

import mpishard
from mpishard.checkpoint import load_consolidated
from mpishard.comm import Communicator, Mesh
from mpishard.data.corpus import BatchSampler, load_corpus
from mpishard.models import GPT, GPTConfig
from mpishard.optim import AdamW
from mpishard.parallel import ZeRO

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("weights", help="a file written by 'mpishard checkpoint consolidate'")
parser.add_argument("--data", default=None)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--n-layer", type=int, default=2)
parser.add_argument("--n-head", type=int, default=4)
parser.add_argument("--n-embd", type=int, default=64)
parser.add_argument("--block-size", type=int, default=64)
args = parser.parse_args()

mpishard.install_abort_hook()
world = Communicator.from_env(MPI.COMM_WORLD)
mesh = Mesh(world, dp=world.size)
config = GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer,
                   n_head=args.n_head, n_embd=args.n_embd)
model = ZeRO(GPT(config, seed=0), mesh, stage=2)
load_consolidated(args.weights, model, world=world)       # every rank reads its own shards
opt = AdamW(model.parameters(), lr=1e-3, ledger=model.ledger)
corpus = load_corpus(args.data, max_bytes=500_000, min_bytes=args.block_size + 1)
sampler = BatchSampler(corpus.train, args.block_size, 4, mesh.dp_rank, mesh.dp.size, seed=1)
for step in range(args.steps):
    _, loss = model(*sampler.next_batch())
    loss.backward()
    model.step(opt, max_norm=1.0)
    mean = np.array([loss.item()])
    world.all_reduce(mean, op="avg")
    if world.rank == 0 and (step % 5 == 0 or step == args.steps - 1):
        print(f"fine-tune step {step}: loss {mean[0]:.3f}")

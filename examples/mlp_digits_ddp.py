"""Classify scikit-learn's 8x8 digits with an MLP and data parallelism.

    pip install 'mpishard[digits]'        # scikit-learn, for the dataset
    mpiexec -n 4 python -m mpi4py examples/mlp_digits_ddp.py --epochs 20

Every rank holds the whole MLP and a different quarter of each batch;
DataParallel averages the gradients in buckets while backward runs.
"""
import argparse

import numpy as np
from mpi4py import MPI

import mpishard
from mpishard.autodiff import no_grad
from mpishard.comm import Communicator, Mesh
from mpishard.data.corpus import ArraySampler, load_digits
from mpishard.models import MLPClassifier
from mpishard.optim import AdamW
from mpishard.parallel import DataParallel

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--epochs", type=int, default=20)
parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
args = parser.parse_args()

mpishard.install_abort_hook()
world = Communicator.from_env(MPI.COMM_WORLD)
mesh = Mesh(world, dp=world.size)
x, y, x_val, y_val = load_digits(seed=0)
model = DataParallel(MLPClassifier(64, (128, 64), 10, seed=0), mesh)
opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, ledger=model.ledger)
sampler = ArraySampler(x, y, args.batch, mesh.dp_rank, mesh.dp.size, seed=0)
steps_per_epoch = len(x) // (args.batch * mesh.dp.size)

for epoch in range(args.epochs):
    for _ in range(steps_per_epoch):
        _, loss = model(*sampler.next_batch())
        loss.backward()
        model.step(opt)
    with no_grad():
        logits, val_loss = model(x_val, y_val)
    accuracy = float((logits.data.argmax(1) == y_val).mean())
    if world.rank == 0:
        print(f"epoch {epoch}: val loss {val_loss.item():.3f}, accuracy {accuracy:.3f}")

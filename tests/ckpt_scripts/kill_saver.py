"""Save checkpoints in a loop until killed; on start, check what the killed run before left.

    mpiexec -n 2 python -m mpi4py tests/ckpt_scripts/kill_saver.py DIR PID_DIR [--final]

Driven by benchmarks/checkpoint_kill.py, which SIGKILLs one rank at a random moment.
On start, every rank:

1. loads the newest complete checkpoint in DIR (verified) into a fresh ZeRO-3 model and
   checks every element is the value saved at that step (see ``value``);
2. saves again to the step the killed run was writing (the highest step-N, step-N.tmp
   or step-N.old in DIR), which must succeed;
3. prints "ready" and saves steps N+1, N+2, ... (keep_last=2) until killed, or exits
   after step 2 with ``--final``.
Each rank first writes its process id to PID_DIR/RANK (lines of two ranks' output
may interleave), so the driver can kill one.
"""
import os
import re
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from mpishard.checkpoint import latest_checkpoint, load_checkpoint, read_manifest, save_checkpoint
from mpishard.comm import Communicator, Mesh
from mpishard.models import GPT, GPTConfig
from mpishard.optim import AdamW
from mpishard.parallel import ZeRO, pieces_of

KINDS = {"param": 0.0, "exp_avg": 0.25, "exp_avg_sq": 0.5}
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def value(step: int, kind: str, runs) -> np.ndarray:
    """What element i of a tensor holds when step ``step`` is saved (exact in float32)."""
    index = np.concatenate([np.arange(a, b) for a, b in runs])
    return (step * 128 + index % 61 + KINDS[kind]).astype(np.float32)


def fill(strategy, opt, step: int) -> None:
    for piece in pieces_of(strategy, opt):
        piece.array[...] = value(step, piece.kind, piece.runs)


def check(strategy, opt, step: int) -> None:
    for piece in pieces_of(strategy, opt):
        if not np.array_equal(piece.array, value(step, piece.kind, piece.runs)):
            raise AssertionError(f"{piece.name} ({piece.kind}) does not hold step {step}'s values")


def make(world):
    strategy = ZeRO(GPT(CFG, seed=0, materialize_now=False), Mesh(world), stage=3)
    return strategy, AdamW(strategy.parameters(), lr=1e-3)


root, pid_dir = Path(sys.argv[1]), Path(sys.argv[2])
world = Communicator(MPI.COMM_WORLD)
(pid_dir / str(world.rank)).write_text(str(os.getpid()))
strategy, opt = make(world)
steps = [int(m.group(1)) for p in (root.iterdir() if root.exists() else [])
         if (m := re.fullmatch(r"step-(\d+)(\.tmp|\.old)?", p.name))]
in_progress = max(steps, default=1)
found = latest_checkpoint(root)
if found is not None:
    loaded = read_manifest(found).step
    load_checkpoint(root, strategy, opt)
    check(strategy, opt, loaded)
    if world.rank == 0:
        print(f"loaded {loaded} (from {found.name}), in progress {in_progress}", flush=True)
fill(strategy, opt, in_progress)
save_checkpoint(root, in_progress, strategy, opt, keep_last=2)
if world.rank == 0:
    print(f"resaved {in_progress}", flush=True)
    print("ready", flush=True)
if "--final" in sys.argv:
    sys.exit(0)
step = in_progress
while True:
    step += 1
    fill(strategy, opt, step)
    save_checkpoint(root, step, strategy, opt, keep_last=2)
    if world.rank == 0:
        print(f"saved {step}", flush=True)

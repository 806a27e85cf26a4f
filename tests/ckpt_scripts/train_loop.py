"""A small training loop with checkpoints: killed, signalled and resumed by the tests.

    mpiexec -n 2 python -m mpi4py tests/ckpt_scripts/train_loop.py --ckpt DIR --log LOSSES \\
        [--steps 10] [--interval 3] [--resume] [--kill-after K] [--signal-after K] [--params OUT]

ZeRO-3 GPT with dropout (so RNG state matters), AdamW with a cosine schedule,
clipping, and the byte sampler. Rank 0 appends "step loss.hex()" to LOSSES after
every step. ``--kill-after K``: rank 1 SIGKILLs itself right after step K (the job
dies; the newest checkpoint is the last multiple of the interval). ``--signal-after
K``: rank 1 sends itself SIGUSR1 after step K; every rank then saves and exits 0.
This is the loop mpishard/run/train.py follows (see docs/checkpoints.md).
"""
import argparse
import os
import signal

import numpy as np
from mpi4py import MPI

from mpishard.checkpoint import (StopSignals, latest_checkpoint, load_checkpoint,
                                 load_module_rng_states, module_rng_states, save_checkpoint)
from mpishard.comm import Communicator, Mesh
from mpishard.data.corpus import BatchSampler
from mpishard.models import GPT, GPTConfig
from mpishard.optim import AdamW, CosineSchedule
from mpishard.parallel import ZeRO

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt", required=True)
parser.add_argument("--log", required=True)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--interval", type=int, default=3)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--kill-after", type=int, default=-1)
parser.add_argument("--signal-after", type=int, default=-1)
parser.add_argument("--params")
args = parser.parse_args()

world = Communicator(MPI.COMM_WORLD)
mesh = Mesh(world)
cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.1)
model = GPT(cfg, seed=0, materialize_now=False)
strategy = ZeRO(model, mesh, stage=3)
opt = AdamW(strategy.parameters(), lr=3e-3, weight_decay=0.1)
schedule = CosineSchedule(3e-3, 3, args.steps, 3e-4)
data = np.random.default_rng(0).integers(0, 64, 20_000).astype(np.uint8)
sampler = BatchSampler(data, cfg.block_size, 4, mesh.dp_rank, mesh.dp.size, seed=0)

step = 0
if args.resume and latest_checkpoint(args.ckpt) is not None:
    extra = load_checkpoint(args.ckpt, strategy, opt)
    step = extra["step"]
    sampler.load_state_dict(extra["data"])
    load_module_rng_states(model, extra["rng"])
    print(f"rank {world.rank}: resumed at step {step}", flush=True)

log = open(args.log, "a", encoding="utf-8") if world.rank == 0 else None
with StopSignals() as stop:
    while step < args.steps:
        opt.lr = schedule(step)
        _, loss = strategy(*sampler.next_batch())
        loss.backward()
        strategy.step(opt, max_norm=1.0)
        buf = np.array([loss.item()])
        mesh.dp.all_reduce(buf, op="avg")
        step += 1
        if log is not None:
            log.write(f"{step} {float(buf[0]).hex()}\n")
            log.flush()
        if world.rank == 1 and step == args.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        if world.rank == 1 and step == args.signal_after:
            os.kill(os.getpid(), signal.SIGUSR1)
        stopping = stop.should_stop(world)
        if stopping or step % args.interval == 0 or step == args.steps:
            extra = {"step": step, "data": sampler.state_dict(),
                     "rng": module_rng_states(model, world)}
            save_checkpoint(args.ckpt, step, strategy, opt, keep_last=2, extra_state=extra)
        if stopping:
            print(f"rank {world.rank}: stopped by {stop.received or 'a peer'} after step "
                  f"{step}", flush=True)
            break

params = strategy.gather_full_params()
if world.rank == 0 and args.params:
    np.savez(args.params, **params)

"""Parity harness: train a strategy and the single-process reference side by side.

The reference trains one model on the concatenation of every dp rank's batch;
each dp rank of the strategy trains on its own batch (different data per rank).
Averaging gradients over ranks equals the gradient of the mean loss over the
concatenated batch, so losses and parameters must agree to rounding.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np
from mpi4py import MPI

from mpishard.testing.fake_cupy import make_test_comm
from mpishard.models import GPT, GPTConfig
from mpishard.optim import AdamW, clip_grad_norm

# Vocabulary and widths that divide none of 2, 3, 4.
UNEVEN = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=10)
BATCH, SEQ = 2, 8


def batch(step: int, micro: int, dp_rank: int, cfg: GPTConfig = UNEVEN, size: int = BATCH):
    r = np.random.default_rng(100_000 * step + 100 * micro + dp_rank)
    x = r.integers(0, cfg.vocab_size, (size, SEQ))
    y = r.integers(0, cfg.vocab_size, (size, SEQ))
    return x, y


def make_optimizer(params, ledger=None):
    # eps=1e-6: Adam turns pure rounding noise (e.g. the key bias, whose exact
    # gradient is zero) into full-size steps when eps is tiny; float32 parity
    # needs that noise damped. The reference uses the same optimizer.
    return AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, ledger=ledger)


def reference(dp_size: int, steps: int, accum: int, dtype: str, max_norm=None,
              cfg: GPTConfig = UNEVEN, seed: int = 0, model_cls=GPT):
    """Single-process training on the concatenated batches: (losses, params)."""
    model = model_cls(cfg, seed=seed, dtype=dtype)
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            xs, ys = zip(*[batch(step, micro, r, cfg) for r in range(dp_size)])
            _, loss = model(np.concatenate(xs), np.concatenate(ys))
            (loss * (1.0 / accum)).backward()
            total += loss.item() / accum
        if max_norm is not None:
            clip_grad_norm(model.parameters(), max_norm)
        opt.step()
        model.zero_grad()
        losses.append(total)
    return np.array(losses), {n: p.data.copy() for n, p in model.named_parameters()}


def train(strategy, dp_rank: int, steps: int, accum: int, max_norm=None,
          cfg: GPTConfig = UNEVEN, loss_comm=None):
    """Train ``strategy`` with this dp rank's data: (mean losses over dp, params)."""
    opt = make_optimizer(strategy.parameters(), strategy.ledger)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            with strategy.no_sync(micro < accum - 1):
                _, loss = strategy(*batch(step, micro, dp_rank, cfg))
                (loss * (1.0 / accum)).backward()
                total += loss.item() / accum
        strategy.step(opt, max_norm=max_norm)
        buf = np.array([total])
        (loss_comm or strategy.dp).all_reduce(buf, op="avg")
        losses.append(buf[0])
    return np.array(losses), strategy.gather_full_params()


def max_rel_err(a: dict, b: dict, norm: str = "max") -> float:
    """Worst relative error over tensors: ``|a - b| / |b|`` in the max norm or the 2-norm.

    The max norm is the strict one (used for float64). In float32, Adam turns
    the rounding noise of gradients that are almost zero into visible steps for
    a few elements (its update is ``m / sqrt(v)``), so float32 parity is
    judged in the 2-norm of each tensor.
    """
    worst = 0.0
    for name in b:
        diff = np.asarray(a[name], np.float64) - b[name]
        if norm == "max":
            err = np.abs(diff).max() / max(float(np.abs(b[name]).max()), 1e-30)
        else:
            err = np.linalg.norm(diff) / max(float(np.linalg.norm(b[name])), 1e-30)
        worst = max(worst, float(err))
    return worst


def wait_for_every_rank(poll_s: float = 0.002) -> None:
    """A barrier of the world that sleeps between polls instead of spinning.

    MPI's blocking barrier busy-polls: with more ranks than cores, the ranks
    that wait (those outside a sub-world, or done early) take the CPU from the
    ranks still working. Test set-up only; the library's collectives are untouched.
    """
    request = MPI.COMM_WORLD.Ibarrier()
    while not request.Test():
        time.sleep(poll_s)


@contextlib.contextmanager
def sub_world(size: int):
    """A ``size``-rank Communicator for world ranks < size (``None`` on the others);
    every world rank waits for the others on leaving (:func:`wait_for_every_rank`)."""
    comm = make_test_comm(f"split{size}")
    try:
        yield comm
    finally:
        if comm is not None:
            comm.free()
        wait_for_every_rank()

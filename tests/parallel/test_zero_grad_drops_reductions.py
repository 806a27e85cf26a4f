"""``zero_grad`` drops a backward's gradients also when no step took them.

A loop may throw a backward away (a loss it judges bad, a batch it skips): it calls
``zero_grad`` and goes on. The gradients that backward reduced, or is still
reducing, must count for nothing: the next step equals one that never saw it.
"""
import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import Communicator, Mesh
from mpishard.models import GPT, GPTConfig
from mpishard.optim import AdamW
from mpishard.parallel import DataParallel, ParallelModel, ZeRO
from mpishard.parallel.precision import Precision

# a width of 14 does not divide 4 ranks: the units' shards are padded
CONFIG = GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=14)


def _strategy(kind: str, world, precision):
    mesh = Mesh(world, dp=world.size)
    if kind == "ddp":
        return DataParallel(GPT(CONFIG, seed=0), mesh, precision=precision)
    return ZeRO(GPT(CONFIG, seed=0), mesh, stage=int(kind[-1]), precision=precision)


def _two_steps(world, rows: int, train, step, zero_grad, thrown: bool) -> None:
    """Two steps of ``rows`` sequences, different tokens on every rank (``train(x)``:
    forward and backward, ``step()``); ``thrown``: before each step's kept backward, a
    backward on other tokens that ``zero_grad()`` drops."""
    rng = np.random.default_rng(100 + world.rank)
    for _ in range(2):
        x, bad = (rng.integers(0, CONFIG.vocab_size, (rows, CONFIG.block_size))
                  for _ in range(2))
        if thrown:
            train(bad)
            zero_grad()
        train(x)
        step()


def _train(kind: str, world, precision, thrown: bool):
    """Full parameters after :func:`_two_steps` of a strategy's own loop."""
    strategy = _strategy(kind, world, precision)
    opt = AdamW(strategy.parameters(), lr=1e-2, weight_decay=0.1, ledger=strategy.ledger)

    def train(x):
        _, loss = strategy(x, np.roll(x, 1, axis=1))
        strategy.scale_loss(loss).backward()

    _two_steps(world, 2, train, lambda: strategy.step(opt, max_norm=1.0),  # (its zero_grad
               strategy.zero_grad, thrown)                                  # after, too)
    return strategy.gather_full_params()


def _assert_same(got: dict, want: dict) -> None:
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.mpi
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero2", "zero3"])
@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16"])
def test_a_backward_zero_grad_drops_counts_for_nothing(kind, reduce_dtype):
    world = Communicator(MPI.COMM_WORLD)
    precision = Precision("bfloat16", reduce_dtype=reduce_dtype)
    want = _train(kind, world, precision, thrown=False)
    got = _train(kind, world, precision, thrown=True)
    _assert_same(got, want)


def _train_parallel(strategy: str, world, thrown: bool):
    """:func:`_train` through :class:`ParallelModel`: ``train_step`` over 2 micro-batches,
    a thrown one dropped by ``zero_grad``."""
    mesh = Mesh(world, dp=world.size)
    run = ParallelModel(GPT(CONFIG, seed=0), mesh, strategy=strategy, micro_batches=2,
                        precision=Precision("bfloat16", reduce_dtype="float32"))
    opt = AdamW(run.parameters(), lr=1e-2, weight_decay=0.1, ledger=run.ledger)
    _two_steps(world, 4, lambda x: run.train_step(x, np.roll(x, 1, axis=1)),
               lambda: run.step(opt, max_norm=1.0), run.zero_grad, thrown)
    return run.gather_full_params()


@pytest.mark.mpi
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_a_train_step_zero_grad_drops_counts_for_nothing(strategy):
    world = Communicator(MPI.COMM_WORLD)
    want = _train_parallel(strategy, world, thrown=False)
    got = _train_parallel(strategy, world, thrown=True)
    _assert_same(got, want)

"""Evaluation splits a batch as training does: the same loss for every split of a global
batch over dp ranks and micro-batches, also where a loss depends on a forward's rows."""
import numpy as np
import pytest

from mpishard.comm import Mesh
from mpishard.models import GPT, GPTConfig
from mpishard.parallel import ParallelModel
from mpishard.testing.fake_cupy import make_test_comm


@pytest.fixture
def comm():
    comm = make_test_comm("self")
    yield comm
    comm.free()


def _runs(comm, cfg, *micro_batches):
    """One process's DDP run of the same float64 GPT per ``micro_batches`` value."""
    return [ParallelModel(GPT(cfg, seed=0, dtype="float64"), Mesh(comm, dp=1), "ddp",
                          micro_batches=m) for m in micro_batches]


def _batch(seed: int, rows: int):
    r = np.random.default_rng(seed)
    return tuple(r.integers(0, 11, (rows, 8)) for _ in range(2))


def test_evaluation_runs_the_training_micro_batches(comm):
    """A mixture of experts' loss depends on the rows a forward holds (load balancing,
    capacity): eval_step over micro-batches of 2 equals the mean of the two halves
    evaluated alone, as one rank with 2 micro-batches and two ranks with 1 would train."""
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=1, n_embd=4,
                    moe_experts=3, moe_capacity=1.0)
    whole, half = _runs(comm, cfg, 2, 1)
    x, y = _batch(0, 4)
    halves = (half.eval_step(x[:2], y[:2]) + half.eval_step(x[2:], y[2:])) / 2
    assert abs(whole.eval_step(x, y) - halves) <= 1e-14 * abs(halves)
    assert abs(half.eval_step(x, y) - halves) > 1e-6     # one forward of 4 differs


def test_a_batch_that_does_not_split_is_evaluated_at_once(comm):
    """One stage takes a batch that is no multiple of the micro-batches (a whole
    validation set) in one forward."""
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=1, n_embd=4)
    two, one = _runs(comm, cfg, 2, 1)
    x, y = _batch(1, 5)
    assert two.eval_step(x, y) == one.eval_step(x, y)


def test_a_micro_batch_without_a_valid_target_adds_nothing_to_the_loss(comm):
    """Every target of the first micro-batch ignored (padding): the step's loss is the
    mean over the valid targets, as one micro-batch gives (it was nan, 0 x nan, while
    the gradients were right)."""
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=1, n_embd=4)
    one, two = _runs(comm, cfg, 1, 2)
    x, y = _batch(1, 4)
    y[:2] = -100
    want = one.eval_step(x, y)
    assert np.isfinite(want)
    assert abs(two.eval_step(x, y) - want) <= 1e-14 * abs(want)
    assert abs(two.train_step(x, y) - one.train_step(x, y)) <= 1e-14 * abs(want)

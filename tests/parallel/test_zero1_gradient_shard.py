"""ZeRO-1's gradient shard exists at the step alone (see [Note: stage 1's gradient
shard] in mpishard/parallel/zero/base.py).

Between steps a stage-1 rank keeps its gradients once, the full buffer; the
reduced slice waits in its own block of it, and the shard the optimizer reads is
made at the step (that block, or its float32 cast under 16-bit reduction) and let
go by ``zero_grad``. The sums are ZeRO-2's, whose shard lives always: the same
reduce-scatters added in the same order, with ``no_sync`` and without.
"""
import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import Communicator, Mesh
from mpishard.models import GPT, GPTConfig
from mpishard.optim import AdamW
from mpishard.parallel import ZeRO
from mpishard.parallel.precision import Precision
from mpishard.planning.memory import estimate_memory

# 7 heads' worth of width does not divide 4 ranks: the units' shards are padded
CONFIG = GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=14)
MICRO = 3


def _run(stage, world, precision, sync_each: bool, steps: int = 3):
    """Losses and full parameters after ``steps`` steps of ``MICRO`` micro-batches each,
    different tokens on every rank; ``sync_each``: a reduction on every micro-batch,
    else ``no_sync`` before the last. Also the ledger's gradient bytes after each step
    and their peak over the last."""
    strategy = ZeRO(GPT(CONFIG, seed=0), Mesh(world, dp=world.size), stage=stage,
                    precision=precision)
    opt = AdamW(strategy.parameters(), lr=1e-2, weight_decay=0.1, ledger=strategy.ledger)
    rng = np.random.default_rng(100 + world.rank)
    losses, held = [], []
    for _ in range(steps):
        strategy.ledger.reset_peak()
        for micro in range(MICRO):
            x = rng.integers(0, CONFIG.vocab_size, (2, CONFIG.block_size))
            with strategy.no_sync(not sync_each and micro < MICRO - 1):
                _, loss = strategy(x, np.roll(x, 1, axis=1))
                strategy.scale_loss(loss * (1 / MICRO)).backward()
            losses.append(float(loss.data))
        strategy.step(opt, max_norm=1.0)
        held.append(strategy.ledger.bytes_by_category()["grads"])
    peak = strategy.ledger.peak_by_category()["grads"]
    return losses, strategy.gather_full_params(), held, peak, strategy


@pytest.mark.mpi
@pytest.mark.timeout(240)
@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16"])
def test_stage1_holds_its_gradients_once_and_sums_as_stage2(reduce_dtype):
    world = Communicator(MPI.COMM_WORLD)
    precision = Precision("bfloat16", reduce_dtype=reduce_dtype)
    plan = estimate_memory(GPT(CONFIG, materialize_now=False), "zero1", world.size,
                           precision=precision)
    rb = np.dtype(np.float32).itemsize if reduce_dtype == "float32" else 2
    # one rank, float32: the full buffer is the shard (nothing reduced; the micro-batches
    # add in place, tied weights in another order than ZeRO-2's)
    aliased = world.size == 1 and reduce_dtype == "float32"
    for sync_each in (False, True):
        got = _run(1, world, precision, sync_each)
        strategy = got[4]
        if not aliased:
            want = _run(2, world, precision, sync_each)
            assert got[0] == want[0], sync_each                       # losses, bit for bit
            for name, value in want[1].items():
                np.testing.assert_array_equal(got[1][name], value, err_msg=name)
            assert all(u.grad_shard is None for u in strategy.units)
        padded = sum(u.layout.padded for u in strategy.units)
        shards = sum(u.layout.shard_size for u in strategy.units)
        # between steps: the full gradient buffer alone, as planned
        assert got[2] == [padded * rb] * 3 == [plan.steady["grads"]] * 3
        if reduce_dtype == "bfloat16":   # the float32 shard at the step, as planned
            assert plan.at_step == {"grads": 4 * shards}
        else:                            # the shard is the buffer's own block
            assert plan.at_step == {}
        # reduced on every micro-batch, the slice moves into a shard of its own before
        # the next forward clears the buffer: that shard then lives through the step
        made = 4 * shards if reduce_dtype == "bfloat16" or sync_each and not aliased else 0
        assert got[3] == padded * rb + made, sync_each

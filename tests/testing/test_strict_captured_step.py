"""A training step with nothing read back inside it: what a captured CUDA graph needs.

On the CuPy-strict module a GPT-2-small-shaped model (GPT-2 small's widths: 768
wide, 12 heads, its 50,304-token padded vocabulary and 1,024 positions; cut to 2
blocks, micro-batches of 2 x 32 tokens and 2 micro-batches to keep the test fast)
trains under ZeRO-1 in float16 mixed precision with the dynamic loss scale and
clipping. Between the step's first launch (the forward of its first micro-batch,
the batch already on the device) and its last (the optimizer's update and the
all-gather after it), no value is read back to the host and no host data is copied
onto the device (``syncs.pageable``): the norm, the clipping factor, the overflow
flag and the loss scale stay on the device (see [Note: device step decisions] in
mpishard/parallel/strategy.py). The loss and the step's result are read after it.
An overflowing step is skipped the same way, parameters and optimizer state
bit-unchanged. Copies through host buffers for MPI (``syncs.staged``) stay allowed.

    python -m pytest --with-mpi tests/testing/test_strict_captured_step.py
    mpiexec -n 2 python -m mpi4py -m pytest --with-mpi tests/testing/test_strict_captured_step.py
"""
import math

import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import Mesh
from mpishard.core.backend import Backend
from mpishard.models import GPT, GPTConfig
from mpishard.optim import AdamW
from mpishard.parallel import ZeRO
from mpishard.testing import strict
from mpishard.testing.fake_cupy import make_test_comm
from parity import sub_world

#: GPT-2 small's widths, 2 of its 12 blocks
GPT2_SMALL_CUT = GPTConfig(n_layer=2, n_head=12, n_embd=768, dropout=0.1)
SEQ, MICRO, ACCUM = 32, 2, 2


def _micro_batches(step: int, dp_rank: int):
    """This step's micro-batches, uploaded to the device before the step begins (a
    loader's job: the copy from the host is not part of the step)."""
    r = np.random.default_rng(100 * step + dp_rank)
    return [tuple(strict.asarray(r.integers(0, GPT2_SMALL_CUT.vocab_size, (MICRO, SEQ)))
                  for _ in range(2)) for _ in range(ACCUM)]


def _train_step(model, opt, batches):
    """Forward and backward of every micro-batch, then the optimizer's step: the step
    whose inside is measured. Returns the micro-batches' losses (unread) and the result."""
    losses = []
    for (x, y), context in zip(batches, model.accumulation(ACCUM)):
        with context:
            _, loss = model(x, y)
            model.scale_loss(loss * (1.0 / ACCUM)).backward()
            losses.append(loss.data)
    return losses, model.step(opt, max_norm=1.0)


class _AddressedAdamW(AdamW):
    """AdamW that notes where each step's gradients live: the multi-tensor kernels'
    device tables are copied from the host only when those addresses change (see
    [Note: multi-tensor tables] in mpishard/kernels/cuda/multi.py)."""

    def step(self, grad_scale=1.0, skip=None) -> None:
        self.grad_addresses.append([t.grad.__cuda_array_interface__["data"][0]
                                    for t in self.params])
        super().step(grad_scale, skip)


def _zero1_float16(comm):
    mesh = Mesh(comm, dp=comm.size)
    model = GPT(GPT2_SMALL_CUT, seed=0, backend=Backend.resolve("strict"),
                materialize_now=False)
    run = ZeRO(model, mesh, stage=1, precision="float16")
    opt = _AddressedAdamW(run.parameters(), lr=1e-4, weight_decay=0.1, ledger=run.ledger)
    opt.grad_addresses = []
    return mesh, run, opt


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [1, 2])
def test_a_gpt2_small_zero1_float16_step_reads_nothing_back(size):
    if size > MPI.COMM_WORLD.size:
        pytest.skip(f"needs {size} ranks")
    with sub_world(size) as comm:
        if comm is None:
            return
        mesh, run, opt = _zero1_float16(comm)
        for step in range(3):                 # a first step allocates; two more measured
            batches = _micro_batches(step, mesh.dp.rank)
            strict.syncs.reset()
            with strict.syncs.refused():      # a read raises at its line
                losses, result = _train_step(run, opt, batches)
            assert strict.syncs.count == 0
            assert strict.syncs.pageable == 0, dict(strict.syncs.pageable_sites)
            if size > 1:                      # MPI through host buffers: counted apart
                assert strict.syncs.staged > 0
            # after the step: the loss and the result, each one read
            loss = float(strict.stack(losses).sum())
            assert math.isfinite(loss) and not result.skipped
            assert math.isfinite(result.grad_norm) and result.step == step + 1
            assert strict.syncs.count == 2
        assert run.skipped_steps == 0 and opt.step_count == 3
        assert run.scaler.scale == 2.0 ** 16
        # the gradients stay where they are: the kernels' tables stay as built
        assert opt.grad_addresses[1] == opt.grad_addresses[0] == opt.grad_addresses[2]
        # every rank made the same decisions from the same all-reduced norm
        assert comm.all_gather_obj(result.grad_norm) == [result.grad_norm] * comm.size


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")   # meant to overflow
def test_an_overflowing_step_is_skipped_on_the_device():
    """A loss scale that overflows float16: the step reads nothing, leaves the masters,
    the 16-bit copies and Adam's state as they were (bit for bit), halves the scale
    and counts the skip, all on the device; the host learns it when it asks."""
    comm = make_test_comm("self")
    try:
        _, run, opt = _zero1_float16(comm)
        _train_step(run, opt, _micro_batches(0, 0))            # state exists now
        before = [t.data.get() for t in run.parameters()] + \
            [a.get() for slot in opt.state for a in slot.values()]
        run.scaler.scale = 2.0 ** 40                           # float16 gradients: inf
        batches = _micro_batches(1, 0)
        strict.syncs.reset()
        with strict.syncs.refused():
            _, result = _train_step(run, opt, batches)
        assert strict.syncs.count == 0 and strict.syncs.pageable == 0
        after = [t.data.get() for t in run.parameters()] + \
            [a.get() for slot in opt.state for a in slot.values()]
        assert all(np.array_equal(a, b) for a, b in zip(before, after))
        assert result.skipped and not math.isfinite(result.grad_norm)
        assert run.skipped_steps == 1 and opt.step_count == 1
        assert run.scaler.scale == 2.0 ** 39
    finally:
        comm.free()

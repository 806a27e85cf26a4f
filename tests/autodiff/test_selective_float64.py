"""Selective recomputation in float64 on two ranks: the gradients are the bits of none.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py -m pytest -q --with-mpi \
        tests/autodiff/test_selective_float64.py

GPT (with dropout, its masks replayed) and Llama, each under tensor parallelism
with sequence parallelism (tp 2) and under context parallelism (cp 2, ring): two
training steps with ``none`` and with ``selective``, every parameter's gradient
after each backward compared with ``np.array_equal``, and the losses too.
"""
import dataclasses

import numpy as np
import pytest

from mpishard.comm import Mesh
from mpishard.core.backend import to_numpy
from mpishard.models import GPT, GPTConfig, Llama, LlamaConfig
from mpishard.parallel import ParallelModel
from parity import batch, make_optimizer, sub_world

GPT_CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=4, n_embd=16, dropout=0.1)
LLAMA_CFG = LlamaConfig(vocab_size=37, block_size=8, n_layer=2, n_head=4, n_kv_head=2,
                        n_embd=16)


def _gradients(comm, family: str, mode: str, sizes: dict, steps: int = 2) -> tuple:
    """(losses, [each step's gradients by parameter position]) of one run."""
    mesh = Mesh(comm, **{k: v for k, v in sizes.items() if k != "sp"})
    if family == "gpt":   # ring attention draws no attention dropout: none under cp
        cfg = GPT_CFG if mesh.cp.size == 1 else dataclasses.replace(GPT_CFG, dropout=0.0)
        model = GPT(cfg, dtype="float64", materialize_now=False)
    else:
        cfg, model = LLAMA_CFG, Llama(LLAMA_CFG, dtype="float64", materialize_now=False)
    run = ParallelModel(model, mesh, strategy="ddp", sequence_parallel=sizes.get("sp", False))
    run.module.set_activation_checkpointing(mode)
    opt = make_optimizer(run.parameters(), run.ledger)
    losses, grads = [], []
    for step in range(steps):
        x, y = batch(step, 0, mesh.dp.rank, cfg, size=4)
        losses.append(run.train_step(x, y))
        grads.append([to_numpy(p.grad).copy() for p in run.parameters()])
        run.step(opt, max_norm=0.5)
    return losses, grads


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("sizes", [dict(tp=2, sp=True), dict(cp=2)], ids=["tp2-sp", "cp2"])
def test_selective_float64_gradients_bit_identical(family, sizes):
    with sub_world(2) as comm:
        if comm is None:
            return
        plain_losses, plain = _gradients(comm, family, "none", sizes)
        losses, again = _gradients(comm, family, "selective", sizes)
        assert plain_losses == losses
        for step, (want, got) in enumerate(zip(plain, again)):
            assert len(want) == len(got) > 0
            for i, (a, b) in enumerate(zip(want, got)):
                assert a.dtype == np.float64 and np.array_equal(a, b), (step, i)

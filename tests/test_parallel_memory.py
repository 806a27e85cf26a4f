"""Ledger measurements against the memory planner, and communication volume."""
import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import Communicator, Mesh
from mpishard.models import GPT, GPTConfig
from mpishard.optim import AdamW
from mpishard.parallel import DataParallel, ZeRO, plan_memory

CONFIG_S = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256)


def _one_step(kind, world):
    mesh = Mesh(world, dp=world.size)
    if kind == "ddp":
        strategy = DataParallel(GPT(CONFIG_S, seed=0), mesh)
    else:
        stage = int(kind[-1])
        strategy = ZeRO(GPT(CONFIG_S, seed=0, materialize_now=stage != 3), mesh, stage=stage)
    opt = AdamW(strategy.parameters(), lr=1e-3, ledger=strategy.ledger)
    opt.allocate_state()
    strategy.ledger.reset_peak()
    strategy.dp.stats.reset()
    x = np.random.default_rng(world.rank).integers(0, 256, (1, 16))
    _, loss = strategy(x, x)
    loss.backward()
    strategy.step(opt)
    return strategy, opt   # the optimizer owns its state: keep it alive


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_ledger_matches_planner_and_zero3_shrinks_model_state():
    world = Communicator(MPI.COMM_WORLD)
    model_state = {}
    bus = {}
    for kind in ("ddp", "zero1", "zero2", "zero3"):
        plan = plan_memory(GPT(CONFIG_S, materialize_now=False), kind, world.size)
        strategy, _opt = _one_step(kind, world)
        live = strategy.ledger.bytes_by_category()
        peak = strategy.ledger.peak_by_category()
        for cat, predicted in plan.steady.items():
            assert abs(live[cat] - predicted) <= 0.05 * max(predicted, 1), (kind, cat)
        for cat, predicted in plan.peak.items():
            assert abs(peak[cat] - predicted) <= 0.05 * max(predicted, 1), (kind, cat)
        model_state[kind] = live["params"] + live["grads"] + live["optim"]
        bus[kind] = strategy.dp.stats.total_bus_bytes
        assert abs(bus[kind] - plan.bus_bytes_per_step) <= 0.05 * max(plan.bus_bytes_per_step, 1)
    if world.size >= 4:
        assert model_state["zero3"] <= 0.3 * model_state["ddp"]
    if world.size >= 2:
        assert 1.4 <= bus["zero3"] / bus["ddp"] <= 1.6
        for kind in ("zero1", "zero2"):
            assert 0.9 <= bus[kind] / bus["ddp"] <= 1.1

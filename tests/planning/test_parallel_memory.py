"""Ledger measurements against the memory planner, and communication volume."""
import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import Communicator, Mesh
from mpishard.models import GPT, GPTConfig
from mpishard.optim import AdamW
from mpishard.parallel import DataParallel, ZeRO
from mpishard.planning.memory import estimate_memory

CONFIG_S = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256)


def _one_step(kind, world, precision=None):
    mesh = Mesh(world, dp=world.size)
    if kind == "ddp":
        strategy = DataParallel(GPT(CONFIG_S, seed=0), mesh, precision=precision)
    else:
        stage = int(kind[-1])
        strategy = ZeRO(GPT(CONFIG_S, seed=0, materialize_now=stage != 3), mesh, stage=stage,
                        precision=precision)
    opt = AdamW(strategy.parameters(), lr=1e-3, ledger=strategy.ledger)
    opt.allocate_state()
    strategy.ledger.reset_peak()
    strategy.dp.stats.reset()
    x = np.random.default_rng(world.rank).integers(0, 256, (1, 16))
    _, loss = strategy(x, x)
    strategy.scale_loss(loss).backward()
    strategy.step(opt)
    return strategy, opt   # the optimizer owns its state: keep it alive


def _check_against_plan(strategy, plan, kind) -> dict:
    """Ledger live/peak bytes and bus bytes within 5% of the plan; returns the live bytes."""
    live = strategy.ledger.bytes_by_category()
    peak = strategy.ledger.peak_by_category()
    for cat, predicted in plan.steady.items():
        assert abs(live[cat] - predicted) <= 0.05 * max(predicted, 1), (kind, cat)
    for cat, predicted in plan.peak.items():
        assert abs(peak[cat] - predicted) <= 0.05 * max(predicted, 1), (kind, cat)
    bus = strategy.dp.stats.total_bus_bytes
    assert abs(bus - plan.bus_bytes_per_step) <= 0.05 * max(plan.bus_bytes_per_step, 1), kind
    return live


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_ledger_matches_planner_and_zero3_shrinks_model_state():
    world = Communicator(MPI.COMM_WORLD)
    model_state = {}
    bus = {}
    for kind in ("ddp", "zero1", "zero2", "zero3"):
        plan = estimate_memory(GPT(CONFIG_S, materialize_now=False), kind, world.size)
        strategy, _opt = _one_step(kind, world)
        live = _check_against_plan(strategy, plan, kind)
        model_state[kind] = live["params"] + live["grads"] + live["optim"]
        bus[kind] = strategy.dp.stats.total_bus_bytes
    if world.size >= 4:
        assert model_state["zero3"] <= 0.3 * model_state["ddp"]
    if world.size >= 2:
        assert 1.4 <= bus["zero3"] / bus["ddp"] <= 1.6
        for kind in ("zero1", "zero2"):
            assert 0.9 <= bus[kind] / bus["ddp"] <= 1.1


@pytest.mark.mpi
@pytest.mark.timeout(180)
@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_ledger_matches_planner_with_mixed_precision(precision):
    """float32 masters and state, a 16-bit compute copy, float32 gradient buffers."""
    world = Communicator(MPI.COMM_WORLD)
    for kind in ("ddp", "zero1", "zero2", "zero3"):
        plan = estimate_memory(GPT(CONFIG_S, materialize_now=False), kind, world.size,
                           precision=precision)
        full = estimate_memory(GPT(CONFIG_S, materialize_now=False), kind, world.size)
        strategy, _opt = _one_step(kind, world, precision)
        _check_against_plan(strategy, plan, kind)
        if kind == "zero3":  # gathered units are 16-bit: half the float32 bytes
            assert plan.peak["gathered"] * 2 == full.peak["gathered"]
        assert {t.data.dtype.name for t in strategy.parameters()} == {"float32"}
        assert {p.data.dtype.name for p in strategy.module.parameters()} == {precision}


@pytest.mark.timeout(120)
def test_one_rank_ddp_and_zero1_hold_one_copy_of_the_gradients():
    """DDP keeps its buckets and ZeRO-1 its shard inside the full buffer at dp 1: both
    hold the gradients once, in ledger-counted memory, as the planner says."""
    world = Communicator(MPI.COMM_SELF.Dup(), "self", _owned=True)
    held = {}
    for kind in ("ddp", "zero1"):
        plan = estimate_memory(GPT(CONFIG_S, materialize_now=False), kind, 1)
        strategy, _opt = _one_step(kind, world)
        held[kind] = _check_against_plan(strategy, plan, kind)
    n_bytes = 4 * GPT(CONFIG_S, materialize_now=False).num_parameters()
    assert held["ddp"]["grads"] == n_bytes
    assert abs(held["zero1"]["grads"] - n_bytes) <= 4 * world.size * 8   # unit padding only
    world.free()

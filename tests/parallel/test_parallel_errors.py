"""Bad input to the strategies: clear errors, raised on every rank."""
import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import Communicator, Mesh
from mpishard.models import GPT, GPTConfig
from mpishard.nn import Parameter
from mpishard.optim import AdamW
from mpishard.parallel import DataParallel, ZeRO
from parity import UNEVEN, batch, max_rel_err, reference, train

TINY = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=1, n_embd=4)


def _mesh():
    world = Communicator(MPI.COMM_WORLD)
    return world, Mesh(world, dp=world.size)


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_parameters_that_differ_across_ranks():
    world, mesh = _mesh()
    if world.size < 2:
        pytest.skip("needs 2 ranks")
    model = GPT(TINY, seed=world.rank)         # different seed on every rank
    with pytest.raises(ValueError, match="differ across ranks at wrap time: rank 1"):
        DataParallel(model, mesh)
    synced = DataParallel(GPT(TINY, seed=world.rank), mesh, sync_params="broadcast")
    rank0 = GPT(TINY, seed=0)
    w = synced.module.transformer.wte.weight.data
    assert np.array_equal(w, rank0.transformer.wte.weight.data)
    with pytest.raises(ValueError, match="same seed on every rank, as ZeRO takes each "
                                         "rank's slice of its own values$"):
        ZeRO(GPT(TINY, seed=world.rank), mesh, stage=1)       # no sync_params to suggest


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["ddp", "zero2", "zero3"])
def test_model_changed_after_wrapping(kind):
    _, mesh = _mesh()
    model = GPT(TINY, seed=0, materialize_now=kind != "zero3")
    strategy = DataParallel(model, mesh) if kind == "ddp" else \
        ZeRO(model, mesh, stage=int(kind[-1]))
    opt = AdamW(strategy.parameters(), lr=1e-3)
    extra = Parameter((2,))
    extra.data = np.zeros(2, np.float32)
    model.transformer.ln_f.extra = extra
    _, loss = strategy(*batch(0, 0, 0, TINY))
    loss.backward()
    with pytest.raises(RuntimeError, match="changed after it was wrapped"):
        strategy.step(opt)


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_unit_plans():
    _, mesh = _mesh()
    with pytest.raises(ValueError, match=r"is in two units, 'transformer.h.0' and"):
        ZeRO(GPT(TINY, materialize_now=False), mesh, units=["transformer.h.0", "transformer.h.0"])
    with pytest.raises(ValueError, match="parameters in no unit: transformer.wte.weight"):
        ZeRO(GPT(TINY, materialize_now=False), mesh, root_unit=False)
    with pytest.raises(ValueError, match="'transformer.nope' is not a sub-module"):
        ZeRO(GPT(TINY, materialize_now=False), mesh, units=["transformer.nope"])
    with pytest.raises(ValueError, match="also used by module 'lm_head'"):
        ZeRO(GPT(TINY, materialize_now=False), mesh, units=["transformer.wte"])
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        ZeRO(GPT(TINY, materialize_now=False), mesh, stage=4)


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_accumulation_steps_must_be_positive():
    _, mesh = _mesh()
    strategy = ZeRO(GPT(TINY, materialize_now=False), mesh)
    with pytest.raises(ValueError, match="micro_steps >= 1, got 0"):
        strategy.accumulation(0)
    assert len(strategy.accumulation(3)) == 3


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_units_smaller_than_the_dp_size(stage):
    """One unit per layer norm: 2 elements each, so ranks 2 and 3 own only padding."""
    world, mesh = _mesh()
    cfg = GPTConfig(vocab_size=5, block_size=8, n_layer=1, n_head=1, n_embd=2, bias=False)
    units = ["transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.h.0.attn",
             "transformer.h.0.mlp"]
    ref_losses, ref_params = reference(world.size, 3, 1, "float64", None, cfg)
    strategy = ZeRO(GPT(cfg, dtype="float64", materialize_now=stage != 3), mesh, stage=stage,
                    units=units)
    ln_1 = strategy.units[0].layout
    assert ln_1.numel == 2
    if world.rank >= 2:
        assert ln_1.shard_start >= ln_1.numel      # nothing but padding here
    losses, params = train(strategy, world.rank, 3, 1, None, cfg)
    assert np.allclose(losses, ref_losses, rtol=1e-10)
    assert max_rel_err(params, ref_params) < 1e-10


def test_parity_config_is_uneven():
    assert UNEVEN.vocab_size % 2 and UNEVEN.vocab_size % 3
    assert UNEVEN.n_embd % 3 and UNEVEN.n_embd % 4


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero3"])
def test_an_optimizer_of_a_strategy_is_stepped_by_the_strategy(kind):
    """``opt.step()`` on a strategy's targets would skip the gradient reduction (DDP's
    replicas drift apart, ZeRO's shards see no gradient); ``step`` with no backward since
    the last would decay the weights anyway: both refused, before any communication."""
    _, mesh = _mesh()
    model = GPT(TINY, seed=0, materialize_now=kind != "zero3")
    strategy = DataParallel(model, mesh) if kind == "ddp" else \
        ZeRO(model, mesh, stage=int(kind[-1]))
    opt = AdamW(strategy.parameters(), lr=1e-3)
    before = [p.data.copy() for p in strategy.parameters()]
    with pytest.raises(RuntimeError, match=r"no backward since the last step or zero_grad"):
        strategy.step(opt)
    _, loss = strategy(*batch(0, 0, 0, TINY))
    loss.backward()
    with pytest.raises(RuntimeError, match=r"call model.step\(opt\) instead of opt.step\(\)"):
        opt.step()
    assert all(np.array_equal(a, p.data) for a, p in zip(before, strategy.parameters()))
    strategy.step(opt)                                  # the reduction, then the update
    assert any(not np.array_equal(a, p.data) for a, p in zip(before, strategy.parameters()))

    class Wrapper:                                      # a wrapper's call is the strategy's
        def __init__(self, inner):
            self.inner, self.params = inner, inner.params

        def step(self, grad_scale=1.0, skip=None):
            self.inner.step(grad_scale=grad_scale, skip=skip)
    _, loss = strategy(*batch(1, 0, 0, TINY))
    loss.backward()
    assert strategy.step(Wrapper(opt)).step == 2
    with pytest.raises(RuntimeError, match="no backward since the last step"):
        strategy.step(opt)
    _, loss = strategy(*batch(0, 0, 0, TINY))
    loss.backward()
    strategy.zero_grad()                                # a backward thrown away
    with pytest.raises(RuntimeError, match="no backward since the last step or zero_grad"):
        strategy.step(opt)


def test_strategies_and_optimizers_name_what_they_take():
    world = Communicator(MPI.COMM_SELF)
    for cls in (DataParallel, ZeRO):
        with pytest.raises(TypeError, match=r"takes a mpishard Mesh, got Communicator; "
                                            r"build one: Mesh\(Communicator\("):
            cls(GPT(TINY, seed=0), world)
    with pytest.raises(TypeError, match=r"takes the targets, not the model: pass "
                                        r"model.parameters\(\)"):
        AdamW(GPT(TINY, seed=0))
    with pytest.raises(TypeError, match="lr must be a number, got '1e-3'"):
        AdamW(GPT(TINY, seed=0).parameters(), lr="1e-3")


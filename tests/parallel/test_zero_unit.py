"""ZeRO's entry and a ZeRO-3 unit's life, on one rank.

``ZeRO(stage=k)`` builds the class the registry lists as ``zero{k}``. A stage-3
unit's sharded state (where its parameters are) and training state (what its
module is doing) follow forward, backward and the step as [Note: unit training
state] in parallel/zero/stage3.py says; the unit that ran next last forward is
prefetched in forward, the one before it in backward; an event out of order
raises naming the unit.
"""
import pytest

from mpishard.autodiff.tensor import no_grad
from mpishard.comm import Mesh
from mpishard.models import GPT, GPTConfig
from mpishard.optim import AdamW
from mpishard.parallel import STRATEGIES, ZeRO, ZeroStrategy, wrap_model
from mpishard.parallel.zero.stage3 import (ForwardOrder, FullyShardedZeRO, ShardedState,
                                           TrainingState)
from mpishard.testing.fake_cupy import make_test_comm
from parity import batch

TINY = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=1, n_embd=4)
IDLE, FORWARD, BACKWARD = TrainingState.IDLE, TrainingState.FORWARD, TrainingState.BACKWARD
SHARDED, GATHERING, UNSHARDED = (ShardedState.SHARDED, ShardedState.GATHERING,
                                 ShardedState.UNSHARDED)


@pytest.fixture
def mesh():
    comm = make_test_comm("self")
    yield Mesh(comm, dp=1)
    comm.free()


def _zero3(mesh, **options):
    return ZeRO(GPT(TINY, seed=0, materialize_now=False), mesh, stage=3, **options)


def _states(units):
    return [(u.training_state, u.state) for u in units]


def test_zero_builds_the_class_the_registry_names(mesh):
    for stage in (1, 2, 3):
        strategy = ZeRO(GPT(TINY, seed=0, materialize_now=stage != 3), mesh, stage=stage)
        assert type(strategy) is STRATEGIES[f"zero{stage}"].cls
        assert isinstance(strategy, ZeroStrategy)
        assert strategy.describe() == {"name": "ZeRO", "stage": stage}
        by_name = wrap_model(GPT(TINY, seed=0, materialize_now=False), mesh, f"zero{stage}")
        assert type(by_name) is type(strategy) and by_name.stage == stage
    assert STRATEGIES["zero1"].cls is STRATEGIES["zero2"].cls is not FullyShardedZeRO
    assert STRATEGIES["zero3"].cls is FullyShardedZeRO


def test_stage_options_are_checked(mesh):
    with pytest.raises(ValueError, match="stage-3 options; stage 2 keeps parameters whole"):
        ZeRO(GPT(TINY, seed=0), mesh, stage=2, prefetch=False)
    with pytest.raises(ValueError, match=r"FullyShardedZeRO implements ZeRO stages \(3,\), "
                                         r"not 2; build it as ZeRO\(module, mesh, stage=2\)"):
        FullyShardedZeRO(GPT(TINY, seed=0, materialize_now=False), mesh, stage=2)


def test_a_unit_s_states_through_forward_backward_and_step(mesh):
    strategy = _zero3(mesh)
    h0, h1, root = strategy.units
    assert (h0.label, h1.label, root.label) == ("transformer.h.0", "transformer.h.1", "<root>")
    assert _states(strategy.units) == [(IDLE, SHARDED)] * 3
    seen = {}

    def watch(name, module_path):
        """Record every unit's states when backward reaches ``module_path``'s output
        (after the unit's own hook there) and inside its forward."""
        def record(event):
            seen[f"{name} {event}"] = _states(strategy.units)

        def hook_output(m, args, out):
            out.register_grad_ready_hook(lambda t: record("backward"))
        module = strategy.module.get_submodule(module_path)
        module.register_forward_pre_hook(lambda m, a: record("forward"))
        module.register_forward_hook(hook_output)

    watch("h0", "transformer.h.0")
    watch("h1", "transformer.h.1")
    _, loss = strategy(*batch(0, 0, 0, TINY))
    # inside h0's forward: h0 gathered, h1 (next in the listed order) prefetched
    assert seen["h0 forward"] == [(FORWARD, UNSHARDED), (IDLE, GATHERING), (FORWARD, UNSHARDED)]
    assert seen["h1 forward"] == [(IDLE, SHARDED), (FORWARD, UNSHARDED), (FORWARD, UNSHARDED)]
    # after forward: blocks released, the root kept for backward
    assert _states(strategy.units) == [(IDLE, SHARDED), (IDLE, SHARDED), (IDLE, UNSHARDED)]
    loss.backward()
    # backward reaches h1 first and prefetches h0, the unit before it in this forward
    assert seen["h1 backward"] == [(IDLE, GATHERING), (BACKWARD, UNSHARDED),
                                   (BACKWARD, UNSHARDED)]
    assert seen["h0 backward"] == [(BACKWARD, UNSHARDED), (IDLE, SHARDED),
                                   (BACKWARD, UNSHARDED)]
    # each unit reduce-scattered once its gradients were final; the root stays gathered
    assert [u.reductions for u in strategy.units] == [1, 1, 1]
    assert _states(strategy.units) == [(IDLE, SHARDED), (IDLE, SHARDED), (IDLE, UNSHARDED)]
    strategy.reduce_grads()     # the step's gradients reduced: the root is released too
    assert _states(strategy.units) == [(IDLE, SHARDED)] * 3
    assert all(u.grads_reduced and u.target.grad is u.grad_shard for u in strategy.units)
    strategy.step(AdamW(strategy.parameters(), lr=1e-3))
    assert _states(strategy.units) == [(IDLE, SHARDED)] * 3
    assert all(u.target.grad is None and u.grads_reduced is False for u in strategy.units)


def test_an_evaluation_forward_leaves_only_the_root_gathered(mesh):
    strategy = _zero3(mesh, prefetch=False)
    with no_grad():
        strategy(*batch(0, 0, 0, TINY))
    assert _states(strategy.units) == [(IDLE, SHARDED), (IDLE, SHARDED), (IDLE, UNSHARDED)]
    strategy.after_update()
    assert _states(strategy.units) == [(IDLE, SHARDED)] * 3


def test_events_out_of_order_raise_naming_the_unit(mesh):
    h0 = _zero3(mesh).units[0]
    with pytest.raises(RuntimeError, match=r"ZeRO-3 unit 'transformer.h.0': post_backward "
                                           r"while idle, expected backward"):
        h0.post_backward()
    with pytest.raises(RuntimeError, match="post_forward while idle, expected forward"):
        h0.post_forward(None)
    h0.pre_forward()
    assert (h0.training_state, h0.state) == (FORWARD, UNSHARDED)
    with pytest.raises(RuntimeError, match="pre_forward while forward, expected idle"):
        h0.pre_forward()
    with pytest.raises(RuntimeError, match="pre_backward while forward, expected idle or "
                                           "backward"):
        h0.pre_backward()


def test_the_forward_order_is_the_one_that_ran():
    order = ForwardOrder()
    a, b, c = "a", "b", "c"
    for unit in (a, b, c):
        order.add(unit)
    assert (order.after(a), order.after(c), order.before(a)) == (b, None, None)
    order.begin()                    # nothing ran yet: the listed order stays
    for unit in (c, a):              # this forward runs c, then a (b not at all)
        order.ran(unit)
    assert (order.before(a), order.before(c), order.before(b)) == (c, None, None)
    order.begin()
    assert (order.after(c), order.after(a), order.after(b)) == (a, None, None)
    assert order.current == [] and order.last == [c, a]


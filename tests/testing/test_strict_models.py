"""Models, ops and optimizers on the CuPy-strict module: no NumPy assumption, no host read.

A forward, backward and optimizer step of GPT and Llama (dropout and activation
checkpointing on) runs with host syncs refused: nothing in it reads a value
back. Sampling, state dicts and optimizer state move between the module and
NumPy only through explicit copies.
"""
import numpy as np
import pytest

from mpishard.testing import strict
from mpishard.autodiff import Tensor, nn_ops, ops, softmax_ops
from mpishard.core.backend import Backend, to_numpy, xp_of
from mpishard.models import GPT, GPTConfig, Llama, LlamaConfig
from mpishard.optim import SGD, AdamW

GPT_CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=10, dropout=0.1)
LLAMA_CFG = LlamaConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_kv_head=1,
                        n_embd=8)
MODELS = {"gpt": lambda **kw: GPT(GPT_CFG, **kw), "llama": lambda **kw: Llama(LLAMA_CFG, **kw)}


@pytest.fixture
def be():
    strict.syncs.reset()
    return Backend.resolve("strict")


def _batch(seed=0):
    r = np.random.default_rng(seed)
    x, y = r.integers(0, 37, (2, 8)), r.integers(0, 37, (2, 8))
    y[0, :3] = -100                                  # some ignored targets
    return x, y


@pytest.mark.parametrize("name", sorted(MODELS))
def test_training_steps_read_nothing_back(be, name):
    model = MODELS[name](seed=0, backend=be)
    model.set_activation_checkpointing(True)
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with strict.syncs.refused():
        for step in range(2):
            _, loss = model(*_batch(step))
            loss.backward()
            opt.step()
            model.zero_grad()
    assert xp_of(loss.data) is strict and all(xp_of(p.data) is strict
                                              for p in model.parameters())
    assert np.isfinite(loss.item())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_state_dicts_and_sampling_cross_the_host_explicitly(be, name):
    model = MODELS[name](seed=0, backend=be)
    host = MODELS[name](seed=1)
    host.load_state_dict(model.state_dict())        # device -> NumPy: .get(), not np.asarray
    for (n, p), (_, q) in zip(model.named_parameters(), host.named_parameters()):
        assert isinstance(q.data, np.ndarray) and np.array_equal(to_numpy(p.data), q.data), n
    back = MODELS[name](seed=2, backend=be)
    back.load_state_dict(host.state_dict())         # NumPy -> device
    assert all(xp_of(p.data) is strict for p in back.parameters())
    x, _ = _batch()
    on_host = model.generate(x[:, :4], 3, rng=np.random.default_rng(0))
    on_device = model.generate(be.asarray(x[:, :4]), 3, rng=np.random.default_rng(0))
    assert on_host.shape == (2, 7) and np.array_equal(on_host, on_device)
    assert np.array_equal(on_host, host.generate(x[:, :4], 3, rng=np.random.default_rng(0)))


def test_optimizer_state_moves_to_a_host_optimizer(be):
    model, host = GPT(GPT_CFG, seed=0, backend=be), GPT(GPT_CFG, seed=0)
    opt = SGD(model.parameters(), lr=0.1, momentum=0.9)
    _, loss = model(*_batch())
    loss.backward()
    opt.step()
    host_opt = SGD(host.parameters(), lr=0.1, momentum=0.9)
    host_opt.load_state_dict(opt.state_dict())
    for slot, host_slot in zip(opt.state, host_opt.state):
        assert np.array_equal(to_numpy(slot["momentum_buffer"]), host_slot["momentum_buffer"])


def test_python_constants_join_the_tensors_module(be):
    a = Tensor(be.asarray([[1.0, -2.0, 3.0]]), requires_grad=True)
    with strict.syncs.refused():
        out = ops.where(a.data > 0, a, 0.0) + ops.add(a, [[1.0, 2.0, 3.0]]) * [2.0]
        out.sum().backward()
        empty = nn_ops.layer_norm(Tensor(be.xp.zeros((0, 4))), None)   # zero rows, one block
    assert xp_of(out.data) is strict and out.data.get().tolist() == [[5.0, 0.0, 15.0]]
    assert a.grad.get().tolist() == [[3.0, 2.0, 3.0]] and empty.shape == (0, 4)


def test_out_of_range_ids_and_no_valid_target_stay_on_the_device(be):
    w = Tensor(be.xp.ones((5, 3)), requires_grad=True)
    with strict.syncs.refused():
        out = nn_ops.embedding(be.asarray([[0, 7], [-1, 4]]), w)   # checked, never read
        out.backward(be.xp.ones((2, 2, 3)))
    rows = np.isnan(out.data.get()).all(axis=-1)
    assert rows.tolist() == [[False, True], [True, False]]
    assert w.grad.get()[:, 0].tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]  # none for the bad ids
    with pytest.raises(ValueError, match=r"index out of range \[0, 5\)"):
        nn_ops.embedding(np.array([[0, 7]]), Tensor(np.ones((5, 3))))    # NumPy: raises
    logits = Tensor(be.xp.zeros((2, 4)), requires_grad=True)
    with strict.syncs.refused():
        loss = softmax_ops.cross_entropy(logits, be.asarray([-100, -100]))
        loss.backward()
    assert np.isnan(loss.item()) and np.all(logits.grad.get() == 0.0)


def test_dropout_masks_come_from_the_device_generator(be):
    model = GPT(GPT_CFG, seed=0, backend=be)
    gens = [m.rng for _, m in model.named_modules() if "rng" in m.__dict__]
    assert gens and all(isinstance(g, strict.random.Generator) for g in gens)


def test_a_dropout_that_never_draws_holds_no_device_generator(be):
    """p = 0 (GPT-2's default): no device generator (each is 12 MiB on an H200); the
    model trains, and its checkpoint's generator states are empty."""
    from dataclasses import replace

    from mpishard.checkpoint import load_module_rng_states, module_rng_states

    model = GPT(replace(GPT_CFG, dropout=0.0), seed=0, backend=be)
    dropouts = [m for _, m in model.named_modules() if "rng" in m.__dict__]
    assert dropouts and all(m.rng is None for m in dropouts)
    x = be.asarray(np.arange(16).reshape(2, 8) % 37)
    _, loss = model(x, x)
    loss.backward()
    assert np.isfinite(loss.item())
    assert module_rng_states(model) == {}
    load_module_rng_states(model, {})

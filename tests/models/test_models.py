"""GPT and MLP: names, init, overfitting, determinism, errors, PyTorch parity."""
import numpy as np
import pytest

from mpishard.models import GPT, GPTConfig, MLPClassifier
from mpishard.nn import StateDictError, init_array
from mpishard.optim import AdamW

TINY = dict(vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=24)


def _batch(seed, B=4, T=16, V=37):
    r = np.random.default_rng(seed)
    return r.integers(0, V, (B, T)), r.integers(0, V, (B, T))


def test_parameter_names_are_nanogpts():
    names = [n for n, _ in GPT(GPTConfig(**{**TINY, "n_layer": 1})).named_parameters()]
    assert names == [
        "transformer.wte.weight", "transformer.wpe.weight",
        "transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias",
        "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias",
        "transformer.h.0.attn.c_proj.weight", "transformer.h.0.attn.c_proj.bias",
        "transformer.h.0.ln_2.weight", "transformer.h.0.ln_2.bias",
        "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_fc.bias",
        "transformer.h.0.mlp.c_proj.weight", "transformer.h.0.mlp.c_proj.bias",
        "transformer.ln_f.weight", "transformer.ln_f.bias"]
    model = GPT(GPTConfig(**TINY))
    sd = model.state_dict()
    assert "lm_head.weight" in sd and sd["lm_head.weight"] is sd["transformer.wte.weight"]
    assert model.transformer.h[0].attn.c_attn.weight.shape == (72, 24)   # [out, in]


def test_init_depends_only_on_seed_and_name():
    model = GPT(GPTConfig(**TINY), seed=5)
    for name, p in model.named_parameters():
        expected = init_array(p.init, p.shape, 5, name).astype(np.float32)
        assert np.array_equal(p.data, expected), name
    other = GPT(GPTConfig(**{**TINY, "n_layer": 3}), seed=5)
    assert np.array_equal(other.transformer.wte.weight.data, model.transformer.wte.weight.data)
    assert not np.array_equal(GPT(GPTConfig(**TINY), seed=6).transformer.wte.weight.data,
                              model.transformer.wte.weight.data)


def test_float64_model_is_the_unrounded_float32_model():
    m32 = GPT(GPTConfig(**TINY), seed=1)
    m64 = GPT(GPTConfig(**TINY), seed=1, dtype="float64")
    for (n, a), (_, b) in zip(m32.named_parameters(), m64.named_parameters()):
        assert b.data.dtype == np.float64
        assert np.array_equal(a.data, b.data.astype(np.float32)), n


def test_gpt_overfits_one_batch():
    model = GPT(GPTConfig(**TINY), seed=0)
    x, y = _batch(0)
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    first = None
    for step in range(300):
        _, loss = model(x, y)
        first = first if first is not None else loss.item()
        model.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() <= 0.1 * first:
            break
    assert loss.item() <= 0.1 * first, (first, loss.item(), step)


def _train(steps=5, seed=0):
    model = GPT(GPTConfig(**TINY, dropout=0.1), seed=seed)
    opt = AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        _, loss = model(x, y)
        model.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.data.copy() for n, p in model.named_parameters()}


def test_two_runs_are_bit_identical():
    (l1, p1), (l2, p2) = _train(), _train()
    assert l1 == l2
    for name in p1:
        assert np.array_equal(p1[name], p2[name]), name


def test_config_errors():
    with pytest.raises(ValueError, match="n_embd=30 is not divisible by n_head=4"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="n_layer must be a positive integer"):
        GPTConfig(n_layer=0)
    model = GPT(GPTConfig(**TINY))
    with pytest.raises(ValueError, match="sequence length 17 exceeds block_size 16"):
        model(np.zeros((1, 17), dtype=np.int64))


def test_load_state_dict_names_every_problem():
    model = GPT(GPTConfig(**TINY))
    sd = dict(model.state_dict())
    sd.pop("transformer.wpe.weight")
    sd["transformer.extra"] = np.zeros(1)
    sd["transformer.ln_f.bias"] = np.zeros(5)
    with pytest.raises(StateDictError) as err:
        model.load_state_dict(sd)
    msg = str(err.value)
    assert "missing: transformer.wpe.weight" in msg
    assert "unexpected: transformer.extra" in msg
    assert "transformer.ln_f.bias: expected (24,), got (5,)" in msg


def test_state_dict_round_trip():
    a, b = GPT(GPTConfig(**TINY), seed=1), GPT(GPTConfig(**TINY), seed=2)
    b.load_state_dict(a.state_dict())
    x, y = _batch(3)
    assert a(x, y)[1].item() == b(x, y)[1].item()


def test_generate_extends_the_prompt():
    model = GPT(GPTConfig(**TINY))
    out = model.generate(np.array([[1, 2, 3]]), max_new_tokens=20, top_k=5)
    assert out.shape == (1, 23) and (out[:, :3] == [1, 2, 3]).all()
    assert out.max() < TINY["vocab_size"]


def test_mlp_classifier_learns():
    r = np.random.default_rng(0)
    x = r.standard_normal((256, 8)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64) + 2 * (x[:, 2] > 0)
    model = MLPClassifier(8, (32,), 4, seed=0)
    opt = AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        logits, loss = model(x, y)
        model.zero_grad()
        loss.backward()
        opt.step()
    assert (logits.data.argmax(1) == y).mean() > 0.95


def test_matches_pytorch_nanogpt():
    torch = pytest.importorskip("torch")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from torch_nanogpt import GPT as TorchGPT

    cfg = GPTConfig(**TINY)
    ours = GPT(cfg, seed=0, dtype="float64")
    theirs = TorchGPT(cfg).double()
    theirs.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in ours.state_dict().items()})
    x, y = _batch(9)
    logits, loss = ours(x, y)
    loss.backward()
    tl, tloss = theirs(torch.from_numpy(x), torch.from_numpy(y))
    tloss.backward()
    assert abs(loss.item() - tloss.item()) < 1e-10
    assert np.allclose(logits.data, tl.detach().numpy(), rtol=0, atol=1e-10)
    tparams = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert np.allclose(p.grad, tparams[name].grad.numpy(), rtol=1e-8, atol=1e-12), name

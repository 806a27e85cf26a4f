"""The fused Llama attention (mpishard/autodiff/gqa_attention.py) against float64 central
differences and against the per-projection ops it stands in for, and the model
taking it only where its projections are plain ``Linear`` layers."""
import numpy as np
import pytest

from mpishard.autodiff import Tensor, gradcheck, gqa_attention, nn_ops, rms_rope_swiglu, softmax_ops
from mpishard.core.dtypes import resolve_dtype
from mpishard.models import Llama, LlamaConfig
from mpishard.models.llama import model as llama_module

TOL = 1e-6
SCALED = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 4}


def _n(r, *shape):
    return r.standard_normal(shape)


# (batch, T, query heads, key/value heads, head size, rope scaling)
GQA = [(2, 3, 4, 2, 4, None), (1, 4, 2, 2, 2, None), (2, 2, 3, 1, 4, SCALED),
       (1, 1, 2, 1, 2, None)]
C = 5


def _tables(T, hs, scaling=None):
    return rms_rope_swiglu.rope_tables(T, hs, 10000.0 if scaling is None else 500000.0, scaling,
                                 dtype="float64")


def _inputs(r, B, T, H, Hkv, hs):
    return [_n(r, B, T, C), _n(r, H * hs, C), _n(r, Hkv * hs, C), _n(r, Hkv * hs, C)]


@pytest.mark.parametrize("B,T,H,Hkv,hs,scaling", GQA)
def test_gqa_attention_gradcheck(B, T, H, Hkv, hs, scaling):
    r = np.random.default_rng(H * 10 + Hkv)
    cos, sin = _tables(T, hs, scaling)
    err = gradcheck(lambda x, wq, wk, wv: gqa_attention.gqa_attention(
        x, wq, wk, wv, cos, sin, H, Hkv, B), _inputs(r, B, T, H, Hkv, hs))
    assert err <= TOL


def _per_projection(x, wq, wk, wv, cos, sin, H, Hkv, B):
    """The unfused path: three products, rope_qkv (repeating key/value heads), attention."""
    T, hs = x.shape[1], wq.shape[0] // H
    q, k, v = (nn_ops.linear(x, w) for w in (wq, wk, wv))
    packed = rms_rope_swiglu.rope_qkv(q.reshape(B, T, H, hs), k.reshape(B, T, Hkv, hs),
                                v.reshape(B, T, Hkv, hs), cos, sin,
                                [j // (H // Hkv) for j in range(H)])
    return softmax_ops.causal_self_attention(packed, H, B)


@pytest.mark.parametrize("B,T,H,Hkv,hs,scaling", GQA)
def test_gqa_attention_matches_projections_rope_qkv_then_attention(B, T, H, Hkv, hs, scaling):
    r = np.random.default_rng(1)
    cos, sin = _tables(T, hs, scaling)
    data, g = _inputs(r, B, T, H, Hkv, hs), _n(r, B * T, H * hs)
    outs, grads = [], []
    for fn in (gqa_attention.gqa_attention, _per_projection):
        tensors = [Tensor(a.copy(), requires_grad=True) for a in data]
        y = fn(*tensors, cos, sin, H, Hkv, B)
        (y * Tensor(g)).sum().backward()
        outs.append(y.data)
        grads.append([t.grad for t in tensors])
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-12, atol=1e-14)
    for got, want in zip(*grads):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gqa_attention_16_bit_inputs(dtype):
    r = np.random.default_rng(2)
    B, T, H, Hkv, hs = 2, 4, 4, 2, 4
    cos, sin = rms_rope_swiglu.rope_tables(T, hs)
    low = resolve_dtype(dtype)
    data = [a.astype(np.float32).astype(low) for a in _inputs(r, B, T, H, Hkv, hs)]
    tensors = [Tensor(a, requires_grad=True) for a in data]
    y = gqa_attention.gqa_attention(*tensors, cos, sin, H, Hkv, B)
    y.sum().backward()
    want = gqa_attention.gqa_attention(*[Tensor(a.astype(np.float32)) for a in data], cos, sin,
                                     H, Hkv, B).data
    assert y.dtype == low and all(t.grad is not None for t in tensors)
    assert tensors[0].grad.dtype == low
    np.testing.assert_allclose(y.data.astype(np.float32), want, atol=0.05)


def test_gqa_attention_checks_its_shapes():
    r = np.random.default_rng(3)
    cos, sin = rms_rope_swiglu.rope_tables(3, 4)
    x, wq, wk, wv = (Tensor(a) for a in _inputs(r, 2, 3, 4, 2, 4))
    with pytest.raises(ValueError, match="gqa_attention"):
        gqa_attention.gqa_attention(x, wq, wk, wv, cos, sin, 4, 3, 2)        # 3 does not divide 4
    with pytest.raises(ValueError, match="gqa_attention"):
        gqa_attention.gqa_attention(x, wq, wk, wk[:4], cos, sin, 4, 2, 2)    # v of another width
    with pytest.raises(ValueError, match="gqa_attention"):
        gqa_attention.gqa_attention(x, wq, wk, wv, *rms_rope_swiglu.rope_tables(4, 4), 4, 2, 2)


CFG = dict(vocab_size=40, block_size=8, n_layer=2, n_head=4, n_kv_head=2, n_embd=16,
           intermediate_size=24)


def _step(model, seed=0):
    r = np.random.default_rng(seed)
    x, y = r.integers(0, 40, (2, 8)), r.integers(0, 40, (2, 8))
    logits, loss = model(x, y)
    model.zero_grad()
    loss.backward()
    return logits.data, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_the_fused_model_matches_the_per_projection_model(monkeypatch, n_kv_head):
    cfg = LlamaConfig(**{**CFG, "n_kv_head": n_kv_head})
    fused = _step(Llama(cfg, seed=3, dtype="float64"))
    monkeypatch.setattr(llama_module, "plain_linears", lambda *modules: False)
    plain = _step(Llama(cfg, seed=3, dtype="float64"))
    np.testing.assert_allclose(fused[0], plain[0], rtol=1e-12, atol=1e-14)
    for name, g in plain[1].items():
        np.testing.assert_allclose(fused[1][name], g, rtol=1e-10, atol=1e-14, err_msg=name)


def test_hooked_or_replaced_projections_take_the_per_projection_path():
    model = Llama(LlamaConfig(**CFG), seed=0)
    attn = model.model.layers["0"].self_attn
    assert llama_module.plain_linears(attn.q_proj, attn.k_proj, attn.v_proj)
    seen = []
    attn.k_proj.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    assert not llama_module.plain_linears(attn.q_proj, attn.k_proj, attn.v_proj)
    _step(model)
    assert seen == [(16, 8)]                       # the hook ran: k_proj was called

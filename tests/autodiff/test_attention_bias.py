"""c_attn's bias handed to attention (``causal_self_attention(..., bias=)``): the same
result and gradients as attention on the biased rows, on NumPy and on the strict module
(the device path, where the bias is added in the copy into the heads' layout)."""
import numpy as np
import pytest

from mpishard.testing import strict
from mpishard.autodiff import Tensor
from mpishard.autodiff.softmax_ops import causal_self_attention


def _run(xp, qkv, bias, g, fused: bool, dropout: float):
    q = Tensor(xp.asarray(qkv), requires_grad=True)
    b = Tensor(xp.asarray(bias), requires_grad=True)
    rng = np.random.default_rng(5)
    if fused:
        y = causal_self_attention(q, 2, 3, dropout, rng, True, bias=b)
    else:
        y = causal_self_attention(q + b, 2, 3, dropout, rng, True)
    y.backward(xp.asarray(g))
    host = (lambda a: a.get()) if xp is strict else np.asarray
    return host(y.data), host(q.grad), host(b.grad)


@pytest.mark.parametrize("xp", [np, strict], ids=["numpy", "strict"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_attention_with_the_bias_is_attention_on_the_biased_rows(xp, dtype, dropout):
    r = np.random.default_rng(0)
    B, T, C = 3, 7, 10                                   # 2 heads of 5
    qkv = r.standard_normal((B * T, 3 * C)).astype(dtype)
    bias = r.standard_normal(3 * C).astype(dtype)
    g = r.standard_normal((B * T, C)).astype(dtype)
    got = _run(xp, qkv, bias, g, True, dropout)
    want = _run(xp, qkv, bias, g, False, dropout)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
    np.testing.assert_allclose(got[2], got[1].sum(axis=0), rtol=tol, atol=tol)


def test_a_bias_of_the_wrong_shape_is_refused():
    qkv = Tensor(np.zeros((6, 12)))
    with pytest.raises(ValueError, match=r"pass the q/k/v projection's bias, \(12,\)"):
        causal_self_attention(qkv, 2, 2, bias=Tensor(np.zeros(4)))

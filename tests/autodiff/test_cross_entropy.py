"""Cross-entropy over blocks of rows (mpishard/kernels/cpu/ops.py, the op's NumPy kernels).

Forward keeps each row's maximum and sum of exponentials, never float32
exponentiated logits of the whole vocabulary; backward recomputes each block's
softmax. The block size must not change a bit of the loss or the gradient, and
the kept bytes are the logits' and a few per row.
"""
import numpy as np
import pytest

from mpishard.autodiff import Tensor
from mpishard.autodiff.softmax_ops import cross_entropy
from mpishard.core.backend import MemoryLedger
from mpishard.kernels.cpu import ops as cpu_kernels


def _loss_and_grad(x, t):
    lt = Tensor(x, requires_grad=True)
    loss = cross_entropy(lt, t)
    loss.backward()
    return np.asarray(loss.data), lt.grad


def _plain(x, t, ignore=-100):
    """Mean negative log-likelihood and its gradient, in float64."""
    x = x.astype(np.float64)
    valid = t != ignore
    z = x - x.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    rows = np.arange(len(t))[valid]
    loss = -np.log(p[rows, t[valid]]).mean() if rows.size else np.nan
    g = p.copy()
    g[rows, t[valid]] -= 1
    g *= valid[:, None] / max(valid.sum(), 1)
    return loss, g


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("N,V", [(37, 53), (300, 1000), (1, 7), (129, 4096)])
def test_the_block_size_changes_no_bit(monkeypatch, N, V, dtype):
    r = np.random.default_rng(N + V)
    x = (3 * r.standard_normal((N, V))).astype(dtype)
    t = r.integers(0, V, N)
    t[::4] = -100                                        # ignored targets
    monkeypatch.setattr(cpu_kernels, "CE_BLOCK_ELEMS", 1 << 30)          # one block
    whole = _loss_and_grad(x, t)
    for elems in (1, V + 1, 3 * V):                      # a row, a row, three rows
        monkeypatch.setattr(cpu_kernels, "CE_BLOCK_ELEMS", elems)
        loss, grad = _loss_and_grad(x, t)
        assert loss.tobytes() == whole[0].tobytes()
        assert grad.dtype == x.dtype and grad.tobytes() == whole[1].tobytes()
    want_loss, want_grad = _plain(x, t)
    tol = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 2e-3}[dtype]
    np.testing.assert_allclose(float(loss), want_loss, rtol=tol)
    np.testing.assert_allclose(grad.astype(np.float64), want_grad, rtol=tol, atol=tol / N)


def test_no_float32_copy_of_the_logits_is_kept():
    N, V = 256, 4096
    r = np.random.default_rng(0)
    x = Tensor(r.standard_normal((N, V)).astype(np.float32), requires_grad=True)
    t = r.integers(0, V, N)
    ledger = MemoryLedger()
    with ledger.measure_activations() as kept:
        loss = cross_entropy(x, t)
    assert kept.nbytes < 64 * N, kept.nbytes            # per-row values, not N x V
    loss.backward()
    assert x.grad.shape == (N, V)


def test_every_target_ignored_is_nan_and_a_zero_gradient():
    x = Tensor(np.ones((3, 5), np.float32), requires_grad=True)
    loss = cross_entropy(x, np.full(3, -100))
    assert np.isnan(loss.data)
    loss.backward()
    assert not x.grad.any()


def test_the_vocabulary_parallel_loss_keeps_no_logits_either():
    """On one tensor-parallel rank it is the whole-vocabulary loss; its forward keeps
    per-row values only (backward recomputes the exponentials)."""
    from mpishard.testing.fake_cupy import make_test_comm
    from mpishard.parallel import vocab_parallel_cross_entropy

    N, V = 256, 4096
    r = np.random.default_rng(1)
    x = r.standard_normal((N, V)).astype(np.float32)
    t = r.integers(0, V, N)
    t[::5] = -100
    tp = make_test_comm("self")
    try:
        lt = Tensor(x, requires_grad=True)
        ledger = MemoryLedger()
        with ledger.measure_activations() as kept:
            loss = vocab_parallel_cross_entropy(lt, t, tp, 0)
        assert kept.nbytes < 64 * N, kept.nbytes
        loss.backward()
    finally:
        tp.free()
    want_loss, want_grad = _loss_and_grad(x, t)
    np.testing.assert_allclose(float(loss.data), float(want_loss), rtol=1e-6)
    np.testing.assert_allclose(lt.grad, want_grad, rtol=1e-5, atol=1e-9)

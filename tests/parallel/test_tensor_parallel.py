"""Each tensor-parallel layer equals the plain layer with the same weights.

Forward outputs and the matching gradient slices, at tp = 2 and 4 (and 3, an
uneven split), float64.
"""
import numpy as np
import pytest
from mpi4py import MPI

from mpishard.autodiff import Tensor, nn_ops, softmax_ops
from mpishard.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear,
                                               VocabParallelEmbedding,
                                               vocab_parallel_cross_entropy)
from parity import sub_world

SIZES = [2, 3, 4]


def _load(p, full):
    p.data = np.ascontiguousarray(p.spec.local_slice_of(full))


def _skip_if_small(size):
    if MPI.COMM_WORLD.size < size:
        pytest.skip(f"needs {size} ranks")


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES)
def test_column_then_row_parallel_equals_plain(size):
    _skip_if_small(size)
    r = np.random.default_rng(0)
    x = r.standard_normal((6, 5))
    w1, b1 = r.standard_normal((7, 5)), r.standard_normal(7)
    w2, b2 = r.standard_normal((3, 7)), r.standard_normal(3)
    grad_out = r.standard_normal((6, 3))
    # reference
    xr = Tensor(x, requires_grad=True)
    wr1, br1 = Tensor(w1, requires_grad=True), Tensor(b1, requires_grad=True)
    wr2, br2 = Tensor(w2, requires_grad=True), Tensor(b2, requires_grad=True)
    hr = nn_ops.linear(xr, wr1, br1)
    yr = nn_ops.linear(nn_ops.gelu(hr), wr2, br2)
    yr.backward(grad_out)
    with sub_world(size) as tp:
        if tp is None:
            return
        col = ColumnParallelLinear(5, 7, tp, dtype="float64")
        row = RowParallelLinear(7, 3, tp, dtype="float64")
        for p, full in [(col.weight, w1), (col.bias, b1), (row.weight, w2), (row.bias, b2)]:
            _load(p, full)
        xt = Tensor(x, requires_grad=True)
        h = col(xt)
        (lo, hi), = col.weight.spec.tp_blocks
        assert np.allclose(h.data, hr.data[:, lo:hi], rtol=1e-13, atol=1e-13)
        y = row(nn_ops.gelu(h))
        assert np.allclose(y.data, yr.data, rtol=1e-12, atol=1e-13)
        y.backward(grad_out)
        assert np.allclose(xt.grad, xr.grad, rtol=1e-12, atol=1e-13)
        for p, ref in [(col.weight, wr1), (col.bias, br1), (row.weight, wr2), (row.bias, br2)]:
            assert np.allclose(p.grad, p.spec.local_slice_of(ref.grad), rtol=1e-12, atol=1e-13)


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES)
def test_vocab_parallel_embedding_and_cross_entropy(size):
    _skip_if_small(size)
    r = np.random.default_rng(1)
    V, C = 11, 4
    table = r.standard_normal((V, C))
    idx = r.integers(0, V, (3, 5))
    targets = r.integers(0, V, 15)
    targets[2] = -100                                  # ignored
    proj = r.standard_normal((C, C))
    # reference: embed, mix, project back onto the (tied) table, cross-entropy
    wr = Tensor(table, requires_grad=True)
    er = nn_ops.embedding(idx, wr).reshape(15, C)
    lr = nn_ops.linear(er @ Tensor(proj), wr)
    loss_r = softmax_ops.cross_entropy(lr, targets)
    loss_r.backward()
    with sub_world(size) as tp:
        if tp is None:
            return
        emb = VocabParallelEmbedding(V, C, tp, dtype="float64")
        _load(emb.weight, table)
        head = ColumnParallelLinear(C, V, tp, bias=False, dtype="float64",
                                    blocks=[(emb.vocab_start, emb.vocab_stop)])
        head.weight = emb.weight
        e = emb(idx).reshape(15, C)
        assert np.allclose(e.data, er.data, rtol=1e-13)
        logits = head(e @ Tensor(proj))
        assert np.allclose(logits.data, lr.data[:, emb.vocab_start:emb.vocab_stop], rtol=1e-12)
        loss = vocab_parallel_cross_entropy(logits, targets, tp, emb.vocab_start)
        assert abs(loss.item() - loss_r.item()) < 1e-12
        loss.backward()
        assert np.allclose(emb.weight.grad, emb.weight.spec.local_slice_of(wr.grad),
                           rtol=1e-11, atol=1e-13)

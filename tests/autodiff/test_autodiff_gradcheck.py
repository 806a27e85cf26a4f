"""Every op against float64 central differences (max relative error <= 1e-6).

``CASES`` maps each op name in ``mpishard.autodiff.OPS`` to functions of a
generator that return ``(fn, inputs)``; ``test_every_op_has_a_gradcheck`` fails
when an op is added without a case here (or, for an op that communicates, in
distributed_gradcheck.py).
"""
import zlib

import numpy as np
import pytest

from mpishard.autodiff import OPS, Tensor, gradcheck
from mpishard.autodiff import (gqa_attention, moe_ops, nn_ops, ops, rms_rope_swiglu,
                               shape_ops, softmax_ops)
from mpishard.autodiff.graph import as_tensor

TOL = 1e-6


def _n(r, *shape):
    return r.standard_normal(shape)


def _pos(r, *shape):
    return r.uniform(0.5, 2.0, shape)


def _distinct(r, *shape):
    """Values with no ties (max's gradient is ambiguous at ties)."""
    return r.permutation(np.arange(np.prod(shape), dtype=np.float64)).reshape(shape) * 0.1


CASES = {
    "add": [lambda r: (ops.add, [_n(r, 3, 4), _n(r, 4)]),
            lambda r: (lambda a: ops.add(a, 2.5), [_n(r, 2, 3)]),
            lambda r: (ops.add, [_n(r, 2, 1, 3), _n(r, 4, 1)])],
    "sub": [lambda r: (ops.sub, [_n(r, 3, 4), _n(r, 3, 1)]),
            lambda r: (lambda a: 1.5 - a, [_n(r, 3)])],
    "mul": [lambda r: (ops.mul, [_n(r, 2, 3, 4), _n(r, 1, 3, 1)]),
            lambda r: (lambda a: a * -0.7, [_n(r, 5)])],
    "div": [lambda r: (ops.div, [_n(r, 3, 4), _pos(r, 4)]),
            lambda r: (lambda a: 2.0 / a, [_pos(r, 3)])],
    "neg": [lambda r: (ops.neg, [_n(r, 3, 2)])],
    "pow": [lambda r: (lambda a: ops.pow(a, 3), [_n(r, 4, 3)]),
            lambda r: (lambda a: ops.pow(a, 2), [_n(r, 4)]),
            lambda r: (lambda a: ops.pow(a, -1.5), [_pos(r, 4)]),
            lambda r: (ops.pow, [_pos(r, 3, 2), _n(r, 2)])],
    "matmul": [lambda r: (ops.matmul, [_n(r, 3, 4), _n(r, 4, 5)]),
               lambda r: (ops.matmul, [_n(r, 2, 3, 4), _n(r, 4, 2)]),
               lambda r: (ops.matmul, [_n(r, 2, 1, 3, 4), _n(r, 5, 4, 2)]),
               lambda r: (ops.matmul, [_n(r, 4), _n(r, 2, 4, 3)]),
               lambda r: (ops.matmul, [_n(r, 3, 4), _n(r, 4)])],
    "sum": [lambda r: (lambda a: ops.sum(a), [_n(r, 3, 4)]),
            lambda r: (lambda a: ops.sum(a, axis=1), [_n(r, 2, 3, 4)]),
            lambda r: (lambda a: ops.sum(a, axis=(0, 2), keepdims=True), [_n(r, 2, 3, 4)])],
    "mean": [lambda r: (lambda a: ops.mean(a, axis=-1), [_n(r, 2, 3, 4)]),
             lambda r: (lambda a: ops.mean(a), [_n(r, 5)])],
    "max": [lambda r: (lambda a: ops.max(a, axis=1), [_distinct(r, 3, 4)]),
            lambda r: (lambda a: ops.max(a), [_distinct(r, 2, 3)]),
            lambda r: (lambda a: ops.max(a, axis=(0, 2), keepdims=True), [_distinct(r, 2, 3, 2)])],
    "reshape": [lambda r: (lambda a: shape_ops.reshape(a, (4, -1)), [_n(r, 2, 3, 2, 2)])],
    "permute": [lambda r: (lambda a: shape_ops.permute(a, (2, 0, 1)), [_n(r, 2, 3, 4)])],
    "transpose": [lambda r: (lambda a: shape_ops.transpose(a, 0, 2), [_n(r, 2, 3, 4)])],
    "getitem": [lambda r: (lambda a: a[1:, ::2], [_n(r, 3, 5)]),
                lambda r: (lambda a: a[np.array([0, 2, 0])], [_n(r, 3, 2)]),
                lambda r: (lambda a: a[..., 1], [_n(r, 2, 3, 4)])],
    "concat": [lambda r: (lambda a, b: shape_ops.concat([a, b], axis=1),
                          [_n(r, 2, 3), _n(r, 2, 2)])],
    "split": [lambda r: (lambda a: shape_ops.split(a, [1, 3], axis=1), [_n(r, 2, 4)]),
              lambda r: (lambda a: shape_ops.split(a, 2, axis=0), [_n(r, 4, 3)])],
    "exp": [lambda r: (ops.exp, [_n(r, 3, 3)])],
    "log": [lambda r: (ops.log, [_pos(r, 3, 3)])],
    "tanh": [lambda r: (ops.tanh, [_n(r, 3, 3)])],
    "sqrt": [lambda r: (ops.sqrt, [_pos(r, 4)])],
    "relu": [lambda r: (ops.relu, [_n(r, 4, 4) + 0.05])],
    # float64 to float64: the cast itself (its gradient's dtype, other dtypes) is
    # test_autodiff_engine.py's test_floats_of_two_dtypes_meet_only_through_astype
    "astype": [lambda r: (lambda a: ops.astype(a * a, "float64"), [_n(r, 2, 3)])],
    "where": [lambda r: (lambda a, b: ops.where(np.array([[True, False, True]]), a, b),
                         [_n(r, 2, 3), _n(r, 3)])],
    "masked_fill": [lambda r: (lambda a: ops.masked_fill(a, np.triu(np.ones((3, 3), bool), 1),
                                                         -3.0), [_n(r, 2, 3, 3)])],
    "linear": [lambda r: (nn_ops.linear, [_n(r, 2, 3, 4), _n(r, 5, 4), _n(r, 5)]),
               lambda r: (nn_ops.linear, [_n(r, 3, 4), _n(r, 2, 4)])],
    "layer_norm": [lambda r: (nn_ops.layer_norm, [_n(r, 2, 3, 6), _n(r, 6), _n(r, 6)]),
                   lambda r: (lambda x, w: nn_ops.layer_norm(x, w), [_n(r, 4, 5), _n(r, 5)])],
    "gelu": [lambda r: (nn_ops.gelu, [_n(r, 3, 5) * 2]),
             lambda r: (nn_ops.gelu, [_n(r, 3, 5) * 2, _n(r, 5)])],     # with a bias
    "softmax": [lambda r: (lambda a: softmax_ops.softmax(a, axis=-1), [_n(r, 2, 3, 4)]),
                lambda r: (lambda a: softmax_ops.softmax(a, axis=1), [_n(r, 2, 3, 4)])],
    "log_softmax": [lambda r: (lambda a: softmax_ops.log_softmax(a), [_n(r, 3, 5)]),
                    lambda r: (lambda a: softmax_ops.log_softmax(a, axis=0), [_n(r, 3, 2, 2)])],
    "cross_entropy": [
        lambda r: (lambda x: softmax_ops.cross_entropy(x, np.array([[1, 0, 4], [2, 3, 3]])),
                   [_n(r, 2, 3, 5)]),
        lambda r: (lambda x: softmax_ops.cross_entropy(x, np.array([1, -100, 0, 2])),
                   [_n(r, 4, 3)])],
    "embedding": [lambda r: (lambda w: nn_ops.embedding(np.array([[0, 3, 3], [1, 0, 4]]), w),
                             [_n(r, 5, 3)])],
    "dropout": [lambda r: (lambda a: nn_ops.dropout(a, 0.4, np.random.default_rng(7)),
                           [_n(r, 4, 5)])],
    # a fresh generator per evaluation: the same mask every time
    "dropout_add": [lambda r: (lambda x, y: nn_ops.dropout_add(x, y, 0.4,
                                                              np.random.default_rng(7)),
                               [_n(r, 4, 5), _n(r, 4, 5)]),
                    lambda r: (lambda x, y, b: nn_ops.dropout_add(   # a bias in the kernel
                        x, y, 0.4, np.random.default_rng(7), bias=b),
                        [_n(r, 4, 5), _n(r, 4, 5), _n(r, 5)]),
                    lambda r: (lambda y, b: nn_ops.dropout_add(      # no residual, no draws
                        None, y, 0.0, None, bias=b), [_n(r, 4, 5), _n(r, 5)])],
    "rms_norm": [lambda r: (rms_rope_swiglu.rms_norm, [_n(r, 2, 3, 6), _n(r, 6)]),
                 lambda r: (lambda x: rms_rope_swiglu.rms_norm(x, eps=1e-6), [_n(r, 4, 5)])],
    "rope": [lambda r: (lambda x: rms_rope_swiglu.rope(x, *rms_rope_swiglu.rope_tables(
                            3, 4, 10000.0, dtype="float64")),
                        [_n(r, 2, 3, 2, 4)]),
             lambda r: (lambda x: rms_rope_swiglu.rope(x, *rms_rope_swiglu.rope_tables(
                 5, 6, 500000.0, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 4}, dtype="float64")),
                        [_n(r, 1, 5, 3, 6)])],
    "swiglu": [lambda r: (rms_rope_swiglu.swiglu, [_n(r, 3, 5) * 2, _n(r, 3, 5)])],
    # two query heads per key/value head of size 4, over 3 rows of width 5
    "gqa_attention": [lambda r: (lambda x, wq, wk, wv: gqa_attention.gqa_attention(
        x, wq, wk, wv, *rms_rope_swiglu.rope_tables(3, 4, dtype="float64"), 4, 2, 2),
        [_n(r, 2, 3, 5), _n(r, 16, 5), _n(r, 8, 5), _n(r, 8, 5)])],
    # 3 experts over 6 sorted rows, the middle one empty
    "expert_swiglu": [lambda r: (lambda x, gu, dn: moe_ops.expert_swiglu(x, [0, 2, 2, 6], gu, dn),
                                 [_n(r, 6, 4), _n(r, 3, 10, 4), _n(r, 3, 4, 5)])],
    "expert_gelu": [lambda r: (lambda x, fc, fb, pj, pb: moe_ops.expert_gelu(x, [0, 3, 3, 5], fc,
                                                                            fb, pj, pb),
                               [_n(r, 5, 4), _n(r, 3, 6, 4), _n(r, 3, 6), _n(r, 3, 4, 6),
                                _n(r, 3, 4)])],
    "permute_rows": [lambda r: (lambda v: moe_ops.permute_rows(v, np.array([2, 0, 3, 1])),
                                [_n(r, 4, 3)]),
                     lambda r: (lambda v: moe_ops.permute_rows(v, np.zeros(0, np.int64)),
                                [_n(r, 0, 3)])],
    "scatter_rows": [lambda r: (lambda v: moe_ops.scatter_rows(v, np.array([2, 0, 2, 3]), 5),
                                [_n(r, 4, 3)])],
    "rope_qkv": [
        lambda r: (lambda q, k, v: rms_rope_swiglu.rope_qkv(
            q, k, v, *rms_rope_swiglu.rope_tables(3, 4, dtype="float64"), [0, 0, 1, 1]),
            [_n(r, 2, 3, 4, 4), _n(r, 2, 3, 2, 4), _n(r, 2, 3, 2, 4)]),
        lambda r: (lambda q, k, v: rms_rope_swiglu.rope_qkv(
            q, k, v, *rms_rope_swiglu.rope_tables(2, 2, dtype="float64"), [1, 2, 2]),
            [_n(r, 1, 2, 3, 2), _n(r, 1, 2, 3, 2), _n(r, 1, 2, 3, 2)]),
        lambda r: (lambda q, k, v: rms_rope_swiglu.rope_qkv(         # one kv head; one query head
            q, k, v, *rms_rope_swiglu.rope_tables(2, 4, dtype="float64"), [0]),
            [_n(r, 2, 2, 1, 4), _n(r, 2, 2, 1, 4), _n(r, 2, 2, 1, 4)]),
        lambda r: (lambda q, k, v: rms_rope_swiglu.rope_qkv(         # a tp rank's: kv heads
            q, k, v, *rms_rope_swiglu.rope_tables(2, 2, dtype="float64"), [1, 1]),  # 0, 2 unread
            [_n(r, 1, 2, 2, 2), _n(r, 1, 2, 3, 2), _n(r, 1, 2, 3, 2)])],
    "causal_self_attention": [
        lambda r: (lambda q: softmax_ops.causal_self_attention(q, 2, 2), [_n(r, 2 * 5, 3 * 2 * 3)]),
        lambda r: (lambda q: softmax_ops.causal_self_attention(q, 1, 3), [_n(r, 3 * 4, 3 * 4)]),
        lambda r: (lambda q: softmax_ops.causal_self_attention(     # dropout on the weights
            q, 2, 2, 0.3, np.random.default_rng(3)), [_n(r, 2 * 5, 3 * 2 * 3)])],
}


def test_every_op_has_a_gradcheck():
    """Every registered op, those of mpishard.parallel included (they communicate,
    so their cases run across ranks: distributed_gradcheck.py)."""
    import mpishard.parallel  # noqa: F401 -- registers the tensor-parallel ops
    from distributed_gradcheck import DISTRIBUTED_CASES

    covered = set(CASES) | set(DISTRIBUTED_CASES)
    missing = sorted(set(OPS) - covered)
    assert not missing, f"ops without a finite-difference test: {missing}"
    assert not covered - set(OPS), f"cases for unknown ops: {covered - set(OPS)}"


@pytest.mark.parametrize("name,index", [(n, i) for n, cases in CASES.items()
                                        for i in range(len(cases))])
def test_gradcheck(name, index):
    rng = np.random.default_rng(zlib.crc32(name.encode()) + index)
    fn, inputs = CASES[name][index](rng)
    if name == "dropout":  # the mask must be the same in every evaluation
        fn = _fixed_dropout(inputs[0].shape)
    err = gradcheck(fn, inputs)
    assert err <= TOL, f"{name} case {index}: relative error {err:.3e} > {TOL}"


def _fixed_dropout(shape):
    def fn(a):
        return nn_ops.dropout(a, 0.4, np.random.default_rng(7))
    return fn


def test_dropout_mask_statistics():
    x = as_tensor(np.ones((200, 200)))
    y = nn_ops.dropout(x, 0.25, np.random.default_rng(0)).data
    kept = (y != 0).mean()
    assert abs(kept - 0.75) < 0.01
    assert np.allclose(y[y != 0], 1 / 0.75)
    same = nn_ops.dropout(x, 0.25, np.random.default_rng(0)).data
    assert np.array_equal(y, same)
    assert nn_ops.dropout(x, 0.25, np.random.default_rng(0), training=False) is x


def test_dropout_add_is_the_residual_add_of_dropout():
    """The fused op draws the mask ``dropout`` draws from the same generator state, and
    adds as ``x + dropout(y)`` does, bit for bit; without dropout it is ``x + y``."""
    r = np.random.default_rng(1)
    x, y = as_tensor(r.standard_normal((6, 7))), as_tensor(r.standard_normal((6, 7)))
    fused = nn_ops.dropout_add(x, y, 0.3, np.random.default_rng(5)).data
    plain = (x + nn_ops.dropout(y, 0.3, np.random.default_rng(5))).data
    assert np.array_equal(fused, plain)
    assert np.array_equal(nn_ops.dropout_add(x, y, 0.3, None, training=False).data,
                          (x + y).data)
    with pytest.raises(ValueError, match="one shape"):
        nn_ops.dropout_add(x, as_tensor(np.ones((6, 1))), 0.3, np.random.default_rng(5))


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_dropout_add_gives_each_input_its_own_gradient(p):
    """Without dropout both inputs get the output's gradient: as two arrays, so adding
    ``y``'s other use into one cannot change the other (``y`` used twice here)."""
    r = np.random.default_rng(2)
    x = Tensor(r.standard_normal((3, 4)), requires_grad=True)
    z = Tensor(r.standard_normal((3, 4)), requires_grad=True)
    b = Tensor(r.standard_normal(4), requires_grad=True)
    y = z * 2.0
    out = nn_ops.dropout_add(x, y, p, np.random.default_rng(4), bias=b)
    (y.sum() + out.sum()).backward()
    np.testing.assert_array_equal(x.grad, np.ones((3, 4)))
    kept = (out.data - x.data) != 0
    np.testing.assert_allclose(z.grad, 2.0 * (1.0 + kept / (1.0 - p)), rtol=1e-12)
    np.testing.assert_allclose(b.grad, (kept / (1.0 - p)).sum(axis=0), rtol=1e-12)

"""The backward engine (order, accumulation, hooks, no_grad, errors) and Tensor's operators."""
import sys

import numpy as np
import pytest

from mpishard.autodiff import Tensor, no_grad, nn_ops, ops, softmax_ops


def test_shared_input_accumulates():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    y = (x * x + x * 3.0).sum()        # dy/dx = 2x + 3
    y.backward()
    assert np.allclose(x.grad, [5.0, 7.0])


def test_leaf_grads_accumulate_across_backward_calls():
    x = Tensor(np.array([1.0, -2.0]), requires_grad=True)
    (x * 2.0).sum().backward()
    (x * 3.0).sum().backward()
    assert np.allclose(x.grad, [5.0, 5.0])


def test_sibling_grads_are_not_aliased():
    a = Tensor(np.ones(3), requires_grad=True)
    b = Tensor(np.ones(3), requires_grad=True)
    (a + b).sum().backward()
    assert a.grad is not b.grad
    a.grad *= 10.0                      # must not change b.grad
    assert np.allclose(b.grad, 1.0)


def test_deep_graph_has_no_recursion_limit():
    x = Tensor(np.array(1.0), requires_grad=True)
    y = x
    for _ in range(sys.getrecursionlimit() * 2):
        y = y * 1.0
    y.backward()
    assert x.grad == 1.0


def test_no_grad_records_nothing():
    x = Tensor(np.ones(2), requires_grad=True)
    with no_grad():
        y = x * 2.0
    assert not y.requires_grad and y.is_leaf
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.sum().backward()


def test_grad_ready_hooks_fire_once_when_final():
    w = Tensor(np.ones(2), requires_grad=True)
    order = []
    w.register_grad_ready_hook(lambda t: order.append(("w", t.grad.copy())))
    h = w * 2.0
    out = (h * w).sum()      # w used twice: hook fires after both contributions
    out.backward()
    assert len(order) == 1
    assert np.allclose(order[0][1], 4.0 * np.ones(2))


def test_interior_hook_fires_before_its_backward():
    """ZeRO-3's pre-backward gather hangs on a unit output's hook."""
    w = Tensor(np.full(3, 2.0), requires_grad=True)
    x = Tensor(np.ones(3), requires_grad=True)
    saved = w.data
    hidden = x * w
    w.data = np.empty(0)                # released after forward
    hidden.register_grad_ready_hook(lambda t: setattr(w, "data", saved))  # gathered again
    out = (hidden * hidden).sum()
    out.backward()
    assert np.allclose(x.grad, 2 * x.data * saved * saved)


def test_hook_handle_removes():
    w = Tensor(np.ones(1), requires_grad=True)
    calls = []
    handle = w.register_grad_ready_hook(lambda t: calls.append(1))
    handle.remove()
    (w * 1.0).sum().backward()
    assert calls == []


def test_backward_needs_scalar_or_grad():
    x = Tensor(np.ones((2, 2)), requires_grad=True)
    with pytest.raises(ValueError, match="one-element"):
        (x * 2.0).backward()
    with pytest.raises(ValueError, match=r"\(3,\) does not match"):
        (x * 2.0).backward(np.ones(3))


def test_shape_and_dtype_errors_name_both():
    a = Tensor(np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"\(2, 3\) and \(4,\)"):
        ops.add(a, Tensor(np.ones(4)))
    with pytest.raises(ValueError, match=r"float64 vs float32"):
        ops.mul(a, Tensor(np.ones(3, np.float32)))
    with pytest.raises(ValueError, match=r"\(2, 3\) and \(2, 3\) do not align"):
        ops.matmul(a, Tensor(np.ones((2, 3))))
    with pytest.raises(ValueError, match="does not end in"):
        nn_ops.linear(a, Tensor(np.ones((4, 5))))


def test_float32_stays_float32():
    x = Tensor(np.ones((4, 8), np.float32), requires_grad=True)
    w = Tensor(np.ones((3, 8), np.float32), requires_grad=True)
    y = nn_ops.gelu(nn_ops.layer_norm(nn_ops.linear(x, w), None, None)) * 0.5
    loss = softmax_ops.cross_entropy(y, np.array([0, 1, 2, 0]))
    assert y.dtype == np.float32 and loss.dtype == np.float32
    loss.backward()
    assert x.grad.dtype == np.float32 and w.grad.dtype == np.float32


def test_float16_is_accepted():
    x = Tensor(np.ones((2, 4), np.float16), requires_grad=True)
    y = softmax_ops.softmax(x * 2.0).sum()
    y.backward()
    assert x.grad.dtype == np.float16


def test_backward_order_is_deterministic():
    def run():
        rng = np.random.default_rng(0)
        x = Tensor(rng.standard_normal((8, 16)).astype(np.float32), requires_grad=True)
        ws = [Tensor(rng.standard_normal((16, 16)).astype(np.float32), requires_grad=True)
              for _ in range(3)]
        h = x
        for w in ws:
            h = nn_ops.gelu(nn_ops.linear(h, w)) + h
        h.sum().backward()
        return [w.grad.copy() for w in ws] + [x.grad.copy()]
    for a, b in zip(run(), run()):
        assert np.array_equal(a, b)


def test_op_profile_times_each_op_forward_and_backward():
    from mpishard.autodiff import profile
    from mpishard.autodiff.nn_ops import gelu, layer_norm
    synced = []
    x = Tensor(np.random.default_rng(0).standard_normal((64, 32)), requires_grad=True)
    with profile.op_profile(sync=lambda: synced.append(1)) as prof:
        y = gelu(layer_norm(x)).sum()
        y.backward()
    assert profile.active is None
    for op in ("layer_norm", "gelu", "sum"):
        assert prof.calls[(op, "forward")] == 1 and prof.calls[(op, "backward")] == 1
        assert prof.seconds[(op, "forward")] >= 0 and prof.seconds[(op, "backward")] > 0
    assert len(synced) == 1 + 3 + 2 * 3                  # start, each result, each backward
    parts = prof.by_class({"gelu": "activation"})
    assert set(parts) == {"activation", "other"}
    assert sum(parts.values()) == pytest.approx(prof.total)
    with pytest.raises(RuntimeError, match="already being recorded"):
        with profile.op_profile():
            with profile.op_profile():
                pass
    assert profile.active is None                         # cleared after the error too


TENSOR_OPERATORS = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
                    "__truediv__", "__rtruediv__", "__neg__", "__pow__", "__matmul__",
                    "__rmatmul__", "__getitem__", "sum", "mean", "max", "reshape", "permute",
                    "transpose", "exp", "log", "tanh", "sqrt", "relu", "masked_fill", "T")


def test_tensor_operators_are_the_classes_own_and_run_the_ops():
    """Every operator and method is written in the Tensor class (tensor.py), none attached
    from outside; each gives its op's result bit for bit, the reflected forms too."""
    from mpishard.autodiff import shape_ops
    for name in TENSOR_OPERATORS:
        member = vars(Tensor).get(name)
        fn = member.fget if isinstance(member, property) else member
        assert fn is not None and fn.__module__ == Tensor.__module__, name
    r = np.random.default_rng(0)
    a, b = (Tensor(r.standard_normal((3, 3)) + 3.0, requires_grad=True) for _ in range(2))
    pairs = [(a + b, ops.add(a, b)), (2.0 + a, ops.add(a, 2.0)), (a - b, ops.sub(a, b)),
             (2.0 - a, ops.add(ops.neg(a), 2.0)), (b.data - a, ops.sub(b.data, a)),
             (a * 3.0, ops.mul(a, 3.0)), (3.0 * a, ops.mul(a, 3.0)), (a / b, ops.div(a, b)),
             (2.0 / a, ops.mul(ops.pow(a, -1), 2.0)), (b.data / a, ops.div(b.data, a)),
             (-a, ops.neg(a)), (a ** 3, ops.pow(a, 3)), (a @ b, ops.matmul(a, b)),
             (b.data @ a, ops.matmul(b.data, a)),
             (a[1:, ::2], shape_ops.getitem(a, np.s_[1:, ::2])),
             (a.sum(0), ops.sum(a, 0)), (a.mean(keepdims=True), ops.mean(a, None, True)),
             (a.max(axis=1), ops.max(a, 1)), (a.reshape(9), shape_ops.reshape(a, 9)),
             (a.permute(1, 0), shape_ops.permute(a, 1, 0)), (a.T, shape_ops.permute(a, (1, 0))),
             (a.transpose(), shape_ops.transpose(a)), (a.exp(), ops.exp(a)), (a.log(), ops.log(a)),
             (a.tanh(), ops.tanh(a)), (a.sqrt(), ops.sqrt(a)), (a.relu(), ops.relu(a)),
             (a.masked_fill(a.data > 3, 0.0), ops.masked_fill(a, a.data > 3, 0.0))]
    for got, want in pairs:
        assert got._op == want._op and np.array_equal(got.data, want.data), want._op


def test_floats_of_two_dtypes_meet_only_through_astype():
    """An op refuses floats of two dtypes, bfloat16 among them (``ml_dtypes`` gives it
    kind ``'V'``, which once let a bfloat16 + float32 sum promote to float32 unseen);
    ``astype`` casts differentiably, its gradient back in the input's dtype."""
    from mpishard.autodiff import ops
    from mpishard.core.dtypes import resolve_dtype
    bf16 = resolve_dtype("bfloat16")
    a = Tensor(np.array([1.5, -2.0, 3.0], dtype=bf16), requires_grad=True)
    w = Tensor(np.array([0.5, 2.0, -1.0], dtype=np.float32), requires_grad=True)
    for op in (ops.add, ops.mul, ops.sub, ops.div, ops.matmul):
        with pytest.raises(ValueError, match="dtype mismatch bfloat16 vs float32.*astype"):
            op(a, w)
    y = (a.astype("float32") * w).sum()
    assert y.dtype == np.float32
    y.backward()
    assert a.grad.dtype == bf16 and w.grad.dtype == np.float32
    np.testing.assert_array_equal(a.grad.astype(np.float32), w.data)
    np.testing.assert_array_equal(w.grad, a.data.astype(np.float32))
    for source, target in ((np.float16, "float32"), (np.float64, "float32"),
                           (np.float32, "float64"), (np.float32, "bfloat16")):
        x = Tensor(np.array([0.75, -1.25], dtype=source), requires_grad=True)
        (x.astype(target) * 3.0).sum().backward()
        assert x.grad.dtype == source and np.array_equal(x.grad, np.full(2, 3.0, source))
    assert a.astype(bf16) is a                                   # no cast, no node
    with pytest.raises(ValueError, match="unknown floating dtype 'int32'"):
        a.astype("int32")

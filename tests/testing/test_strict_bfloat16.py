"""bfloat16 mixed precision on the CuPy-strict module, against NumPy's bfloat16 path.

``precision="bfloat16"`` on a device module keeps bfloat16 arrays as CuPy 14 does
(``ml_dtypes.bfloat16``; see [Note: bfloat16 on devices] in mpishard/core/dtypes.py),
and the strict module refuses what CuPy 14 cannot do with them (batched products,
``cupyx.scatter_add``), so a path that would fail on a GPU fails here. A tiny GPT
and a tiny Llama train a few steps under DDP and ZeRO-3 on the module and on NumPy
from the same seed and data: the losses agree to bfloat16 rounding, and so do the
first step's gradients.
"""
from __future__ import annotations

import types

import ml_dtypes
import numpy as np
import pytest

from parity import batch, make_optimizer
from mpishard.comm import Mesh
from mpishard.core.backend import Backend, to_numpy, xp_of
from mpishard.core.dtypes import resolve_dtype, where_kept
from mpishard.models import GPT, GPTConfig, Llama, LlamaConfig
from mpishard.parallel import DataParallel, ZeRO
from mpishard.testing import strict
from mpishard.testing.fake_cupy import make_test_comm

BF16 = np.dtype(ml_dtypes.bfloat16)
MODELS = {
    "gpt": (GPT, GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16)),
    "llama": (Llama, LlamaConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2,
                                 n_kv_head=1, n_embd=16)),
}
STEPS = 3


def _train(name: str, backend: str, strategy: str):
    """``STEPS`` clipped AdamW steps in bfloat16: (losses, the first step's gradients
    under DDP (ZeRO-3 keeps only their shards), the last logits' dtype and array
    module)."""
    cls, cfg = MODELS[name]
    be = Backend.resolve(backend)
    comm = make_test_comm("self")
    mesh = Mesh(comm, dp=1)
    if strategy == "ddp":
        model = DataParallel(cls(cfg, seed=0, backend=be), mesh, precision="bfloat16")
    else:
        model = ZeRO(cls(cfg, seed=0, backend=be, materialize_now=False), mesh, stage=3,
                     precision="bfloat16")
    opt = make_optimizer(model.parameters(), model.ledger)
    losses, grads = [], None
    for step in range(STEPS):
        x, y = batch(step, 0, 0, cfg)
        logits, loss = model(be.asarray(x), be.asarray(y)) if backend == "strict" else \
            model(x, y)
        model.scale_loss(loss).backward()
        if grads is None and strategy == "ddp":
            grads = [to_numpy(p.grad).copy() for p in model.module.parameters()]
        model.step(opt, max_norm=1.0)
        losses.append(loss.item())
    masters = [p.data for p in model.parameters()]
    assert all(xp_of(m) is be.xp and m.dtype == np.float32 for m in masters)
    comm.free()
    return np.array(losses), grads, logits.data.dtype, xp_of(logits.data)


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_bfloat16_training_matches_numpy(name, strategy):
    strict.syncs.reset()
    want, want_grads, dtype, xp = _train(name, "numpy", strategy)
    assert dtype == BF16 and xp is np
    got, got_grads, dtype, xp = _train(name, "strict", strategy)
    assert dtype == BF16 and xp is strict                # computed in bfloat16 on the module
    assert (got_grads is not None) == (want_grads is not None) == (strategy == "ddp")
    # one bfloat16 rounding is 2**-8 relative; the losses are float32 sums of them
    np.testing.assert_allclose(got, want, rtol=2e-3)
    for g, w in zip(got_grads or (), want_grads or ()):
        assert g.dtype == np.float32 and np.linalg.norm(g - w) <= 2e-2 * np.linalg.norm(w)


def test_the_strict_module_does_with_bfloat16_what_cupy_14_does():
    """Arrays of ``ml_dtypes.bfloat16``; a 2-D product accumulates in float32 and rounds
    once, as cuBLAS; a batched product and ``scatter_add`` raise, as in CuPy 14."""
    assert resolve_dtype("bfloat16", strict) == BF16
    r = np.random.default_rng(0)
    a, b = r.standard_normal((5, 40)).astype(BF16), r.standard_normal((40, 3)).astype(BF16)
    got = strict.asarray(a) @ strict.asarray(b)
    assert got.dtype == BF16
    want = (a.astype(np.float32) @ b.astype(np.float32)).astype(BF16)
    np.testing.assert_array_equal(got.get().view(np.uint16), want.view(np.uint16))
    np.testing.assert_array_equal(strict.dot(strict.asarray(a), strict.asarray(b)).get()
                                  .view(np.uint16), want.view(np.uint16))
    with pytest.raises(NotImplementedError, match="cupy#10317"):
        strict.asarray(a[None]) @ strict.asarray(b[None])
    with pytest.raises(TypeError, match="no bfloat16"):
        strict.scatter_add(strict.zeros(4, dtype=BF16), strict.asarray([0, 0]),
                           strict.ones(2, dtype=BF16))


def test_the_strict_module_promotes_bfloat16_where_cupy_14_does():
    """Seen on an H100 with CuPy 14.2: ``where`` on bfloat16 choices and a bfloat16 array
    met with a Python float (or a float32 scalar) come out float32; integers and
    scalars of the array's own dtype keep bfloat16. ``where_kept`` picks the words:
    bfloat16 on every module, bit for bit NumPy's ``where``."""
    a = strict.asarray(np.arange(6, dtype=np.float32).astype(BF16) - 2)
    total = a.sum()                                  # a 0-d array: typed as arrays are
    for promoted in (a * 2.0, 2.0 * a, a + np.float32(1), strict.multiply(a, 0.5),
                     strict.where(a > 0, a, 0), strict.where(a > 0, a, a), total * 0.5):
        assert promoted.dtype == np.float32
    for kept in (a * a, a + 1, a * BF16.type(2.0), -a, strict.exp(a), strict.maximum(a, 0),
                 total * BF16.type(0.5), strict.multiply(a, 0.5, dtype=BF16)):
        assert kept.dtype == BF16
    host = a.get()
    for xp, x in ((np, host), (strict, a)):
        for choices in ((x, 0), (0, x), (x, x[::-1].copy()), (x, BF16.type(np.nan))):
            got = where_kept(xp, x > 0, *choices)
            assert got.dtype == BF16
            want = np.where(host > 0, *(c.get() if c is not None and hasattr(c, "get")
                                        and not isinstance(c, np.generic) else c
                                        for c in choices))
            np.testing.assert_array_equal(to_numpy(got).view(np.uint16),
                                          want.astype(BF16).view(np.uint16))
    assert where_kept(strict, a > 0, a.astype(np.float32), 0).dtype == np.float32


def test_a_cupy_without_bfloat16_is_refused_with_the_fix():
    old_cupy = types.ModuleType("cupy")         # CuPy 13 refuses the dtype
    old_cupy.__version__ = "13.6.0"

    def empty(shape, dtype=None):
        raise TypeError(f"Unsupported dtype {dtype}")
    old_cupy.empty = empty
    with pytest.raises(ValueError, match=r"bfloat16 on cupy 13\.6\.0: .*install CuPy 14 or "
                                         r"later .*or use precision 'float16'"):
        resolve_dtype("bfloat16", old_cupy)
    assert resolve_dtype("float16", old_cupy) == np.float16


def test_bfloat16_scatter_adds_in_float32_on_a_device():
    """A gather's backward (``a[idx]``) scatters its gradient; on a device module (no
    bfloat16 in ``cupyx.scatter_add``) the rows add up in float32 and round once: 256
    + 1 + 1 + 1 gives 260 where adding in bfloat16 would stay at 256."""
    from mpishard.autodiff import Tensor

    grad = np.array([[256.0], [1.0], [1.0], [1.0]], np.float32).astype(BF16)
    idx = np.array([0, 0, 0, 0])
    results = {}
    for name, xp in (("strict", strict), ("numpy", np)):
        a = Tensor(xp.asarray(np.zeros((2, 1), np.float32).astype(BF16)), requires_grad=True)
        out = a[xp.asarray(idx)]
        out.backward(xp.asarray(grad))
        results[name] = np.asarray(a.grad.get() if xp is strict else a.grad, np.float32)
    assert results["strict"].ravel().tolist() == [260.0, 0.0]
    assert results["numpy"].ravel().tolist() == [256.0, 0.0]   # NumPy adds in bfloat16


def test_where_kept_takes_0d_bfloat16_arrays_on_the_module():
    """A 0-d array is an array (its words are viewed on the module, never copied to
    the host); a float32 scalar with bfloat16 choices follows NumPy (float32)."""
    zero_d = strict.asarray(np.asarray(3.0, dtype=BF16))
    got = where_kept(strict, strict.asarray(np.array([True, False])), zero_d,
                     strict.asarray(np.array([1.0, 2.0]).astype(BF16)))
    assert got.dtype == BF16
    np.testing.assert_array_equal(got.get().astype(np.float32), [3.0, 2.0])
    bf = np.array([1.0, 2.0]).astype(BF16)
    for xp, a in ((np, bf), (strict, strict.asarray(bf))):
        assert where_kept(xp, a > 1, a, np.float32(0)).dtype == np.float32
        assert where_kept(xp, a > 1, a, BF16.type(0)).dtype == BF16


def test_a_gradient_scale_keeps_bfloat16_gradients_bfloat16_on_the_module():
    """The optimizer's unscaling of a bfloat16 gradient by a Python float is typed as on
    NumPy (bfloat16), not as CuPy 14 types a bare float (float32)."""
    from mpishard.optim.optimizers import _scaled
    grad = np.array([1.0, -3.0, 0.375]).astype(BF16)
    for g in (grad, strict.asarray(grad)):
        got = _scaled(g, 0.3)
        assert got.dtype == BF16
        np.testing.assert_array_equal(to_numpy(got).view(np.uint16),
                                      (grad * 0.3).view(np.uint16))

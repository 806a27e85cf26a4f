"""What the norms, the MLP activations and the rotary embeddings keep for backward (see
[Note: what ops keep] in mpishard/autodiff/rows.py).

* RMS norm, layer norm, GELU and SwiGLU keep no float32 normalised rows, tanh or
  sigmoid, on NumPy or on a device (the strict module): backward computes them again.
* On NumPy the rotary embeddings and the fused grouped-query attention build their
  per-head rotation tables again in backward; the bits are those of the tables a
  device keeps (the keeping path, run here on NumPy), for float32, float64 and
  bfloat16 rows, and less is kept.
"""
import gc
import tracemalloc

import numpy as np
import pytest

from mpishard.autodiff import Tensor, gqa_attention, rms_rope_swiglu
from mpishard.autodiff.nn_ops import gelu, layer_norm
from mpishard.core.backend import Backend
from mpishard.core.dtypes import resolve_dtype

DTYPES = ["float64", "float32", "bfloat16"]
B, T, H, HKV, HS, C = 2, 48, 4, 2, 16, 40


def _rotation_cases(r, dtype):
    """``{op: (fn, inputs)}``: each op that builds rotation tables, on rows of ``dtype``."""
    dt = resolve_dtype(dtype)

    def n(*shape):
        return r.standard_normal(shape).astype(dt)
    cos, sin = rms_rope_swiglu.rope_tables(T, HS, 500000.0, dtype="float32")
    heads = [j // (H // HKV) for j in range(H)]
    return {
        "rope": (lambda x: rms_rope_swiglu.rope(x, cos, sin), [n(B, T, H, HS)]),
        "rope_qkv": (lambda q, k, v: rms_rope_swiglu.rope_qkv(q, k, v, cos, sin, heads),
                     [n(B, T, H, HS), n(B, T, HKV, HS), n(B, T, HKV, HS)]),
        "gqa_attention": (lambda x, wq, wk, wv: gqa_attention.gqa_attention(
            x, wq, wk, wv, cos, sin, H, HKV, B),
            [n(B * T, C), n(H * HS, C), n(HKV * HS, C), n(HKV * HS, C)]),
    }


def _run(fn, arrays, seed, xp=np):
    """``(output, input gradients, bytes the graph kept between forward and backward)``
    of one forward and backward with a fixed upstream gradient."""
    inputs = [Tensor(xp.asarray(a.copy()), requires_grad=True) for a in arrays]
    gc.collect()
    tracemalloc.start()
    out = fn(*inputs)
    gc.collect()
    kept = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    g = np.random.default_rng(seed).standard_normal(out.shape).astype(out.dtype)
    out.backward(xp.asarray(g))
    return out.data, [t.grad for t in inputs], kept


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qkv_keeps_no_tables_of_its_own(dtype):
    """rope_qkv's backward reads the model's tables again (its kernels take the rotation's
    sign themselves): on the strict module, as on a GPU, it keeps what it keeps on NumPy
    (within the wrappers' few bytes), where a device's rope_qkv kept a (T, hs) pair of
    float32 or float64 tables per op; and the same bits come out on both."""
    from mpishard.testing import strict
    dt = resolve_dtype(dtype)
    r = np.random.default_rng(3)
    arrays = [r.standard_normal(shape).astype(dt)
              for shape in ((B, T, H, HS), (B, T, HKV, HS), (B, T, HKV, HS))]
    heads = [j // (H // HKV) for j in range(H)]
    runs = []
    for xp in (np, strict):
        cos, sin = rms_rope_swiglu.rope_tables(T, HS, 500000.0, dtype="float32", xp=xp)

        def fn(q, k, v):
            return rms_rope_swiglu.rope_qkv(q, k, v, cos, sin, heads)
        _run(fn, arrays, 7, xp=xp)                   # first calls' caches, not counted
        runs.append(_run(fn, arrays, 7, xp=xp))
    (out, grads, kept), (dev_out, dev_grads, dev_kept) = runs
    np.testing.assert_array_equal(out, dev_out.get())
    for a, b in zip(grads, dev_grads):
        np.testing.assert_array_equal(a, b.get())
    assert dev_kept - kept < T * HS * 4, (kept, dev_kept)      # a table pair: 2 T hs 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["rope", "gqa_attention"])
def test_numpy_builds_again_the_tables_a_device_keeps(monkeypatch, op, dtype):
    fn, arrays = _rotation_cases(np.random.default_rng(3), dtype)[op]
    _run(fn, arrays, 7)                              # first calls' caches, not counted
    lean_out, lean_grads, lean_kept = _run(fn, arrays, 7)
    for module in (rms_rope_swiglu, gqa_attention):
        monkeypatch.setattr(module, "keeps_least", lambda xp: False)
    out, grads, kept = _run(fn, arrays, 7)
    np.testing.assert_array_equal(lean_out, out)
    for a, b in zip(lean_grads, grads):
        np.testing.assert_array_equal(a, b)
    assert lean_kept < kept, (lean_kept, kept)


@pytest.mark.parametrize("backend", ["numpy", "strict"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "gelu", "swiglu"])
def test_norms_and_activations_keep_their_output_alone(op, dtype, backend):
    """The bytes kept are the output's (plus a row's statistics and the graph's small
    objects): no float32 copy of the rows, which would be 2x (bfloat16) or 1x more."""
    xp = Backend.resolve(backend).xp
    r = np.random.default_rng(0)
    dt = resolve_dtype(dtype)
    rows, width = 256, 96
    x, u, w, b = (r.standard_normal(s).astype(dt) for s in ((rows, width), (rows, width),
                                                            (width,), (width,)))
    fn, arrays = {"rms_norm": (rms_rope_swiglu.rms_norm, [x, w]),
                  "layer_norm": (layer_norm, [x, w, b]),
                  "gelu": (gelu, [x]),
                  "swiglu": (rms_rope_swiglu.swiglu, [x, u])}[op]
    _run(fn, arrays, 1, xp)
    out, grads, kept = _run(fn, arrays, 1, xp)
    output = rows * width * dt.itemsize
    assert output <= kept < output + rows * 8 + 8192, (kept, output)
    assert all(g is not None for g in grads)

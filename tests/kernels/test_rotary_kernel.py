"""Rotary embeddings packed with grouped key/value heads as a kernel of each set
(``rope_qkv_forward`` / ``rope_qkv_backward``: mpishard/kernels/reference.py, cpu/ops.py,
cuda/rotary.py).

* the GPU's two RawKernels, their CUDA C run on the host (tests/cuda_host.py, which
  contracts no multiply-add into an FMA) through the kernel set's own launch code,
  equal the reference bit for bit: float32, float64, float16 and bfloat16 rows (16-bit
  ones read as they lie, rounded once), Llama's groups, a tensor-parallel rank's (its
  query heads reading the second of three key/value heads, the others zero), one head
  per group, the smallest head, each gradient alone, and a grid too small for the
  elements (its threads stride over the rest);
* the CPU set (a copy per query head, tables per head) equals the reference bit for
  bit, on an uneven map too, which the GPU's launcher hands to the reference.
"""
from __future__ import annotations

import numpy as np
import pytest

from cuda_host import use_host_kernels
from mpishard.autodiff.rms_rope_swiglu import rope_tables
from mpishard.core.dtypes import resolve_dtype
from mpishard.kernels import reference
from mpishard.kernels.cpu import ops as cpu
from mpishard.kernels.cuda import rotary

BFLOAT16 = resolve_dtype("bfloat16")
#: (B, T, H, n_kv, hs, heads)
CASES = [(2, 3, 8, 2, 4, [j // 4 for j in range(8)]),          # Llama's groups of 4
         (1, 5, 2, 3, 6, [1, 1]),                              # a tp rank: head 1 of 3
         (2, 2, 3, 3, 8, [0, 1, 2]),                           # one query head per group
         (3, 1, 1, 1, 2, [0])]                                 # the smallest head


def _inputs(B, T, H, n_kv, hs, dtype, seed=0):
    r = np.random.default_rng(seed + 7 * H + hs)
    q, k, v = (r.standard_normal((B, T, n, hs)).astype(dtype) for n in (H, n_kv, n_kv))
    d = r.standard_normal((B, T, 3, H, hs)).astype(dtype)
    cos, sin = rope_tables(T, hs, 500000.0,
                           dtype="float64" if dtype == np.float64 else "float32")
    return q, k, v, d, cos, sin


def _same(got, want):
    if want is None:
        assert got is None
        return
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BFLOAT16], ids=str)
@pytest.mark.parametrize("B,T,H,n_kv,hs,heads", CASES, ids=str)
def test_host_cuda_kernels_equal_the_reference_bit_for_bit(monkeypatch, B, T, H, n_kv, hs,
                                                          heads, dtype):
    use_host_kernels(monkeypatch)
    monkeypatch.setattr(rotary, "MAX_BLOCKS", 1)     # one block of 256 threads: they stride
    monkeypatch.setattr(rotary, "ROW_THREADS", 32)
    heads = np.asarray(heads)
    q, k, v, d, cos, sin = _inputs(B, T, H, n_kv, hs, dtype)
    out = rotary.rope_qkv_forward(q, k, v, cos, sin, heads)
    assert out.shape == (B, T, 3, H, hs)
    _same(out, reference.rope_qkv_forward(q, k, v, cos, sin, heads))
    for need in ((True, True, True), (True, False, False), (False, True, False),
                 (False, False, True)):
        got = rotary.rope_qkv_backward(d, cos, sin, heads, n_kv, *need)
        for g, w in zip(got, reference.rope_qkv_backward(d, cos, sin, heads, n_kv, *need)):
            _same(g, w)


def test_the_launcher_hands_what_its_kernels_do_not_take_to_the_reference(monkeypatch):
    """An uneven map of query heads, mixed dtypes or strided rows run the reference (the
    kernels would read them wrong): no kernel is built for them."""
    monkeypatch.setattr(rotary, "raw_function", lambda *a, **k: pytest.fail("a kernel ran"))
    q, k, v, d, cos, sin = _inputs(2, 3, 3, 3, 4, np.float32)
    uneven = np.asarray([1, 2, 2])
    _same(rotary.rope_qkv_forward(q, k, v, cos, sin, uneven),
          reference.rope_qkv_forward(q, k, v, cos, sin, uneven))
    for g, w in zip(rotary.rope_qkv_backward(d, cos, sin, uneven, 3),
                    reference.rope_qkv_backward(d, cos, sin, uneven, 3)):
        _same(g, w)
    even = np.arange(3)
    rotary.rope_qkv_forward(q, k.astype(np.float64), v, cos, sin, even)
    rotary.rope_qkv_forward(q[:, :, ::-1], k, v, cos, sin, even)
    with pytest.raises(ValueError):              # a sin table of another shape: the
        rotary.rope_qkv_forward(q, k, v, cos, sin[:, :2], even)   # reference refuses it
    with pytest.raises(ValueError):
        rotary.rope_qkv_backward(d, cos, sin[:, :2], even, 3)


def test_the_op_names_a_table_of_the_wrong_shape():
    """rope and rope_qkv refuse a cos or sin table that is not (T, hs), naming both."""
    from mpishard.autodiff import Tensor
    from mpishard.autodiff.rms_rope_swiglu import rope, rope_qkv
    q, k, v, _, cos, sin = _inputs(2, 3, 2, 1, 4, np.float32)
    q, k, v = (Tensor(a, requires_grad=True) for a in (q, k, v))
    with pytest.raises(ValueError, match=r"cos \(3, 4\) and sin \(3, 2\)"):
        rope_qkv(q, k, v, cos, sin[:, :2], [0, 0])
    with pytest.raises(ValueError, match=r"cos \(2, 4\) and sin \(3, 4\)"):
        rope(q, cos[:2], sin)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, BFLOAT16], ids=str)
@pytest.mark.parametrize("B,T,H,n_kv,hs,heads", [*CASES, (2, 3, 3, 3, 4, [1, 2, 2])], ids=str)
def test_the_cpu_set_equals_the_reference_bit_for_bit(B, T, H, n_kv, hs, heads, dtype):
    heads = np.asarray(heads)
    q, k, v, d, cos, sin = _inputs(B, T, H, n_kv, hs, dtype)
    _same(cpu.rope_qkv_forward(q, k, v, cos, sin, heads),
          reference.rope_qkv_forward(q, k, v, cos, sin, heads))
    for g, w in zip(cpu.rope_qkv_backward(d, cos, sin, heads, n_kv),
                    reference.rope_qkv_backward(d, cos, sin, heads, n_kv)):
        _same(g, w)

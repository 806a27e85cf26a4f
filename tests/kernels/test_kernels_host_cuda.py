"""The GPU kernel set's RawKernels, run as CUDA C on the host (tests/cuda_host.py).

On the CuPy-strict module the kernel set runs its reference math, so no CPU test
ran the CUDA bodies of the row kernels: their indexing, block reductions, warp
shuffles and barriers. Here ``g++`` compiles the very source the GPU compiles
(``row_kernel_source``, ``norm_kernel_source``) and the kernel set's own launch code
(grid, block, argument order and dtypes) runs it on NumPy arrays, against the
references: float32, float64, and float16 rows for the norms; odd widths (fewer and
more columns than a block's 256 threads, not multiples of 32), one row, no rows.
"""
from __future__ import annotations

import numpy as np
import pytest

from cuda_host import host_compiler, use_host_kernels
from mpishard.kernels import reference
from mpishard.kernels.cuda import ops as gpu
from mpishard.kernels.cuda.launch import ROW_THREADS

pytestmark = pytest.mark.skipif(host_compiler() is None,
                                reason="no g++ to compile CUDA C for the host")

TOL = {np.float64: 1e-12, np.float32: 3e-5}
@pytest.fixture(autouse=True)
def host_kernels(monkeypatch):
    use_host_kernels(monkeypatch)


def _rand(shape, dtype, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _close(got, want, dtype, scale=1.0):
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOL[np.dtype(dtype).type] * scale
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


DTYPES = [np.float32, np.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,n,threads", [(8, 3, 256), (1, 1, 256), (5, 7, 256), (150, 1, 64)],
                         ids=str)
def test_attention_softmax_kernels(T, n, threads, dtype, monkeypatch):
    """Forward (scale, causal mask, softmax, dropout of the weights) and backward
    (through the dropout, the row dot, the product; the dropped weights again); rows
    longer than a block's threads (150 keys over 64 threads: two warps, three passes)."""
    monkeypatch.setattr(gpu, "ROW_THREADS", threads)
    scores = _rand((n * T, T), dtype)
    got, want = scores.copy(), scores.copy()
    assert gpu.causal_softmax(got, T, 0.37) is None
    reference.causal_softmax(want, T, 0.37)
    _close(got, want, dtype)
    u = np.random.default_rng(1).random(scores.shape, dtype=np.float32)
    got, want = scores.copy(), scores.copy()
    dropped = gpu.causal_softmax(got, T, 0.37, drop_u=u, drop_p=0.25)
    want_dropped = reference.causal_softmax(want, T, 0.37, drop_u=u, drop_p=0.25)
    _close(got, want, dtype), _close(dropped, want_dropped, dtype)
    for drop in (False, True):
        d = _rand(scores.shape, dtype, 2)
        got_d, want_d = d.copy(), d.copy()
        got_p = np.full_like(d, np.nan) if drop else None
        want_p = np.full_like(d, np.nan) if drop else None
        kw = dict(drop_u=u, drop_p=0.25) if drop else {}
        gpu.softmax_backward(got_d, want, 0.37, dropped=got_p, **kw)
        reference.softmax_backward(want_d, want, 0.37, dropped=want_p, **kw)
        _close(got_d, want_d, dtype)
        if drop:
            _close(got_p, want_p, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 33), (1, 1), (3, 300), (2, 769), (0, 16)], ids=str)
def test_norm_kernels(shape, dtype):
    """Layer norm and RMS norm each way, with and without their weight and bias, the
    backward also added into a gradient so far; then the parameters' gradients."""
    x, g = _rand(shape, dtype), _rand(shape, dtype, 1)
    w, b = _rand(shape[1:], dtype, 2), _rand(shape[1:], dtype, 3)
    for weight, bias in ((w, b), (None, None), (w, None), (None, b)):
        got = gpu.layer_norm_forward(x, weight, bias, 1e-5)
        want = reference.layer_norm_forward(x, weight, bias, 1e-5)
        for a, c in zip(got, want):
            _close(a, c, dtype)
        _close(gpu.layer_norm_backward(g, got[1], got[2], weight),
               reference.layer_norm_backward(g, want[1], want[2], weight), dtype)
        so_far = _rand(shape, dtype, 4)
        into = gpu.layer_norm_backward(g, got[1], got[2], weight, into=so_far.copy())
        _close(into, so_far + reference.layer_norm_backward(g, want[1], want[2], weight),
               dtype)
        got = gpu.rms_norm_forward(x, weight, 1e-6)
        want = reference.rms_norm_forward(x, weight, 1e-6)
        for a, c in zip(got, want):
            _close(a, c, dtype)
        _close(gpu.rms_norm_backward(g, got[1], got[2], weight),
               reference.rms_norm_backward(g, want[1], want[2], weight), dtype)
    sums = max(shape[0], 1) ** 0.5
    for need in ((True, True), (True, False), (False, True)):
        got = gpu.norm_param_grads(g, x, *need)
        for a, c in zip(got, reference.norm_param_grads(g, x, *need)):
            assert (a is None) == (c is None)
            if a is not None:
                _close(a, c, dtype, sums)


@pytest.mark.parametrize("shape", [(5, 33), (1, 300), (3, 769)], ids=str)
def test_norm_kernels_on_float16_rows(shape):
    """The __half build: float16 rows in and out, float32 statistics, the values of the
    float32 kernels on rows cast up, cast down once; layer norm, then RMS norm."""
    x, g = _rand(shape, np.float16), _rand(shape, np.float16, 1)
    w, b = _rand(shape[1:], np.float16, 2), _rand(shape[1:], np.float16, 3)
    up = reference.up32
    y, xhat, rstd = gpu.layer_norm_forward(x, w, b, 1e-5)
    wy, wxhat, wrstd = reference.layer_norm_forward(up(x), up(w), up(b), 1e-5)
    assert y.dtype == np.float16 and xhat.dtype == rstd.dtype == np.float32
    np.testing.assert_allclose(y.astype(np.float32), wy, rtol=1e-3, atol=1e-3)
    _close(xhat, wxhat, np.float32), _close(rstd, wrstd, np.float32)
    gx = gpu.layer_norm_backward(g, xhat, rstd, w)
    want = reference.layer_norm_backward(up(g), wxhat, wrstd, up(w))
    assert gx.dtype == np.float16
    np.testing.assert_allclose(gx.astype(np.float32), want, rtol=2e-3, atol=2e-3)
    gw, gb = gpu.norm_param_grads(g, xhat, True, True)
    ww, wb = reference.norm_param_grads(up(g), wxhat, True, True)
    assert gw.dtype == gb.dtype == np.float32
    _close(gw, ww, np.float32, shape[0] ** 0.5), _close(gb, wb, np.float32, shape[0] ** 0.5)
    y, xhat, rstd = gpu.rms_norm_forward(x, w, 1e-6)                 # not centred
    wy, wxhat, wrstd = reference.rms_norm_forward(up(x), up(w), 1e-6)
    assert y.dtype == np.float16 and xhat.dtype == rstd.dtype == np.float32
    np.testing.assert_allclose(y.astype(np.float32), wy, rtol=1e-3, atol=1e-3)
    _close(xhat, wxhat, np.float32), _close(rstd, wrstd, np.float32)
    gx = gpu.rms_norm_backward(g, xhat, rstd, w)
    assert gx.dtype == np.float16
    np.testing.assert_allclose(gx.astype(np.float32),
                               reference.rms_norm_backward(up(g), wxhat, wrstd, up(w)),
                               rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 53), (1, 1), (70, 31), (0, 5)], ids=str)
def test_column_sum_kernels(shape, dtype):
    """GELU's backward with its bias, and the gradient through a biased dropout: the
    element gradients and their column sums (the biases' gradients)."""
    a, t, g = _rand(shape, dtype), np.tanh(_rand(shape, dtype, 1)), _rand(shape, dtype, 2)
    bias = _rand(shape[1:], dtype, 3)
    sums = max(shape[0], 1) ** 0.5
    gx, gb = gpu.bias_gelu_backward(a, bias, t, g)
    wx, wb = reference.bias_gelu_backward(a, bias, t, g)
    _close(gx, wx, dtype), _close(gb, wb, dtype, sums)
    u = np.random.default_rng(4).random(shape, dtype=np.float32)
    for draws in (u, None):
        gy, gb = gpu.bias_dropout_backward(g, draws, 0.3)
        wy, wb = reference.bias_dropout_backward(g, draws, 0.3)
        _close(gy, wy, dtype), _close(gb, wb, dtype, sums)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,nh,T,hs", [(2, 3, 5, 7), (1, 1, 1, 1), (1, 4, 9, 16), (3, 2, 0, 4)],
                         ids=str)
def test_unpack_heads_kernel(B, nh, T, hs, dtype):
    """q's, k's and v's gradients from the head-major buffer to packed rows, bit for bit,
    with their column sums."""
    h = _rand((3, B, nh, T, hs), dtype)
    rows, sums = gpu.unpack_heads(h, need_sum=True)
    want_rows, want_sums = reference.unpack_heads(h, True)
    np.testing.assert_array_equal(rows, want_rows)
    _close(sums, want_sums, dtype, max(B * T, 1) ** 0.5)
    rows, sums = gpu.unpack_heads(h)
    assert sums is None
    np.testing.assert_array_equal(rows, want_rows)


def test_the_emulation_checks_argument_dtypes():
    """A float64 scalar where the kernel takes a float is refused: on a GPU CuPy would
    pass its 8 bytes and the kernel would read garbage."""
    a = _rand((4, 4), np.float32)
    kernel = gpu.row_kernel(np, "mpishard_causal_softmax", "float32")
    with pytest.raises(TypeError, match="scale is float, got float64"):
        kernel((4,), (ROW_THREADS,),
               (a, np.int32(4), np.float64(0.5), np.int32(0), a, np.float32(0), np.float32(1), a))
    kernel((4,), (ROW_THREADS,),
           (a, np.int32(4), np.float32(0.5), np.int32(0), a.astype(np.float64), np.float32(0),
            np.float32(1), a))
    assert kernel.null_pointers == ["du"]             # absent (flag 0): passed as NULL


def _typed(spec: str, ctype: str) -> str:
    """An ElementwiseKernel's ``T`` spelled as ``ctype`` (host_elementwise takes no ``T``)."""
    import re
    return re.sub(r"\bT\b", ctype, spec)


def test_swiglu_kernels_compute_the_sigmoid_inline():
    """SwiGLU's ElementwiseKernels, their ``T`` spelled float and compiled for the host (the
    harness takes float64 parameters as CuPy's Python-float scalars, so float32 rows):
    the forward writes only ``y`` and the backward computes the sigmoid from the gate
    itself, as the references do (nothing passes between them)."""
    from cuda_host import host_elementwise
    from mpishard.kernels.cuda.ops_src import SOURCES
    dtype = np.float32
    kernels = {}
    for name in ("mpishard_swiglu_forward", "mpishard_swiglu_backward"):
        inputs, outputs, body = SOURCES[name]
        kernels[name] = host_elementwise(name, _typed(inputs, "float32"),
                                         _typed(outputs, "float32"), _typed(body, "float"))
    gate, up, g = (_rand((7, 300), dtype, seed) for seed in range(3))
    _close(kernels["mpishard_swiglu_forward"](gate, up), reference.swiglu_forward(gate, up),
           dtype)
    for got, want in zip(kernels["mpishard_swiglu_backward"](gate, up, g),
                         reference.swiglu_backward(gate, up, g)):
        _close(got, want, dtype)


def test_swiglu16_kernels_compute_in_float32():
    """SwiGLU's 16-bit kernels with ``T`` float16 (CuPy's ``__half``), compiled for the
    host: float32 inside, each result rounded once to float16, within float16's rounding
    of the float32 reference (whose backward formula the kernel writes otherwise)."""
    from cuda_host import host_elementwise
    from mpishard.kernels.cuda.ops_src import SOURCES
    kernels = {}
    for name in ("mpishard_swiglu16_forward", "mpishard_swiglu16_backward"):
        inputs, outputs, body = SOURCES[name]
        kernels[name] = host_elementwise(name, _typed(inputs, "float16"),
                                         _typed(outputs, "float16"), _typed(body, "__half"),
                                         preamble="#include <cuda_fp16.h>")
    gate, up, g = (_rand((7, 300), np.float16, seed) for seed in range(3))
    g32, u32, d32 = (v.astype(np.float32) for v in (gate, up, g))

    def within_rounding(got, want32):
        assert got.dtype == np.float16
        ulp = np.spacing(np.abs(want32).astype(np.float16)).astype(np.float32)
        assert (np.abs(got.astype(np.float32) - want32) <= ulp).all()
    within_rounding(kernels["mpishard_swiglu16_forward"](gate, up),
                    reference.swiglu_forward(g32, u32))
    for got, want in zip(kernels["mpishard_swiglu16_backward"](gate, up, g),
                         reference.swiglu_backward(g32, u32, d32)):
        within_rounding(got, want)

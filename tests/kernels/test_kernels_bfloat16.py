"""The GPU kernel set on bfloat16 data, without a GPU.

bfloat16 is stored as 16-bit words, the top half of a float32, and the kernels
convert them (see [Note: bfloat16 on devices] in mpishard/core/dtypes.py). Here:

* the host emulation's ``__nv_bfloat16`` (tests/cuda_host.py) against ``ml_dtypes``:
  every rounding bit for bit, ties to even, NaN, infinities, subnormals;
* the RawKernels compiled for the host with bfloat16 rows, through the kernel set's
  own launch code, against the references on the rows cast up: layer norm and RMS
  norm each way and their parameter gradients, the three fused-attention kernels;
* the ElementwiseKernels' bfloat16 twins (dropout with and without bias and residual,
  GELU with and without bias, each way), emulated element by element, against the
  references run by NumPy on bfloat16 arrays: bit for bit where the reference rounds
  the same operations, within one bfloat16 step where it differs only in float32
  ``tanh``;
* the cuBLAS arguments of a bfloat16 product (``CUDA_R_16BF`` in, float32 compute,
  bfloat16 or float32 out) through the emulation of the documented call
  (tests/kernels/test_gemm.py), and the float32 fallback of a layout cuBLAS does not
  take (CuPy 14's own batched bfloat16 product fails);
* all of the kernel set on each array module (``array_backend``): on CuPy the compiled
  kernels (``MPISHARD_TEST_BACKENDS=cupy``), on the strict module the references, on
  NumPy the host emulation.

    pytest tests/kernels/test_kernels_bfloat16.py
    MPISHARD_TEST_BACKENDS=cupy pytest tests/kernels/test_kernels_bfloat16.py   # a GPU
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import test_gemm
from cuda_host import HostModule, host_compiler, host_elementwise, use_host_kernels
from mpishard.kernels import reference
from mpishard.kernels.cuda import attention as gpu_attention, gemm, ops as gpu
from mpishard.kernels.cuda.ops_src import BF16_WORDS, BFLOAT16_SOURCES

BF16 = np.dtype(ml_dtypes.bfloat16)
needs_compiler = pytest.mark.skipif(host_compiler() is None,
                                    reason="no g++ to compile CUDA C for the host")


def _rand(shape, dtype=BF16, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _within_one_step(got, want32, atol: float = 0.0):
    """``got`` (bfloat16) is ``want32`` (float32) rounded to bfloat16, or a bfloat16 next
    to that (the float32 math summed in another order), or within ``atol`` of it (near
    zero, where another float32 ``tanh`` moves GELU's result by more than a step)."""
    assert got.dtype == BF16 and got.shape == want32.shape
    rounded = np.asarray(want32, np.float32).astype(BF16)
    word = rounded.view(np.uint16).astype(np.int32)
    near = [((word + d) & 0xFFFF).astype(np.uint16).view(BF16).astype(np.float32)
            for d in (-1, 1)]
    r32 = rounded.astype(np.float32)
    step = np.fmax(np.abs(near[0] - r32), np.abs(near[1] - r32))  # word 0 - 1 is a NaN
    diff = np.abs(got.astype(np.float32) - r32)
    assert np.all(diff <= np.maximum(step, atol)), float(np.max(diff - step))


# -- the emulation's conversions ------------------------------------------------

CONVERT = r"""
#include <cuda_bf16.h>
extern "C" __global__ void round_trip(const float* x, __nv_bfloat16* h, float* back,
                                      const int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    h[i] = __float2bfloat16_rn(x[i]);
    back[i] = __bfloat162float(h[i]);
  }
}
"""


@needs_compiler
def test_the_emulated_bfloat16_rounds_as_ml_dtypes():
    """``__float2bfloat16_rn`` in the shim gives ``ml_dtypes``' words for random floats,
    exact ties (to even, both ways), the largest values that round to infinity or not,
    infinities, NaN and subnormals; reading a word back gives its float32 exactly."""
    r = np.random.default_rng(0)
    words = r.integers(0, 2 ** 32, 20000, dtype=np.uint64).astype(np.uint32)
    ties = np.array([0x3f808000, 0x3f818000, 0xbf808000, 0x7f7f8000, 0x7f7fffff,
                     0x00008000, 0x00018000, 0x7f800000, 0xff800000, 0x00000001],
                    dtype=np.uint32)
    x = np.concatenate([words, ties]).view(np.float32)
    x = x[~np.isnan(x)]
    kernel = HostModule(CONVERT).get_function("round_trip")
    h, back = np.empty(x.size, BF16), np.empty(x.size, np.float32)
    kernel((-(-x.size // 256),), (256,), (x, h, back, np.int32(x.size)))
    np.testing.assert_array_equal(h.view(np.uint16), x.astype(BF16).view(np.uint16))
    np.testing.assert_array_equal(back, x.astype(BF16).astype(np.float32))
    assert h.view(np.uint16)[-10:-8].tolist() == [0x3f80, 0x3f82]      # ties to even
    nan = np.array([np.nan, -np.nan], np.float32)
    h = np.empty(2, BF16)
    kernel((1,), (32,), (nan, h, np.empty(2, np.float32), np.int32(2)))
    assert np.isnan(h.astype(np.float32)).all()


# -- the RawKernels on bfloat16 rows ------------------------------------------

@pytest.fixture
def host_kernels(monkeypatch):
    use_host_kernels(monkeypatch)


@pytest.mark.parametrize("shape", [(5, 33), (1, 300), (3, 769)], ids=str)
def test_norm_kernels_on_bfloat16_rows(host_kernels, shape):
    """The ``__nv_bfloat16`` build: bfloat16 rows in and out, float32 statistics and
    parameter gradients; the float32 kernels' values on the rows cast up, rounded
    once to bfloat16."""
    x, g = _rand(shape), _rand(shape, seed=1)
    w, b = _rand(shape[1:], seed=2), _rand(shape[1:], seed=3)
    up = reference.up32
    for centred in (True, False):
        if centred:
            y, xhat, rstd = gpu.layer_norm_forward(x, w, b, 1e-5)
            wy, wxhat, wrstd = reference.layer_norm_forward(up(x), up(w), up(b), 1e-5)
            gx = gpu.layer_norm_backward(g, xhat, rstd, w)
            wgx = reference.layer_norm_backward(up(g), wxhat, wrstd, up(w))
        else:
            y, xhat, rstd = gpu.rms_norm_forward(x, w, 1e-6)
            wy, wxhat, wrstd = reference.rms_norm_forward(up(x), up(w), 1e-6)
            gx = gpu.rms_norm_backward(g, xhat, rstd, w)
            wgx = reference.rms_norm_backward(up(g), wxhat, wrstd, up(w))
        assert xhat.dtype == rstd.dtype == np.float32
        np.testing.assert_allclose(xhat, wxhat, rtol=3e-5, atol=3e-5)
        np.testing.assert_allclose(rstd, wrstd, rtol=3e-5, atol=3e-5)
        _within_one_step(y, wy)
        _within_one_step(gx, wgx)
    gw, gb = gpu.norm_param_grads(g, xhat, True, True)
    ww, wb = reference.norm_param_grads(up(g), wxhat, True, True)
    assert gw.dtype == gb.dtype == np.float32
    tol = 3e-5 * shape[0] ** 0.5
    np.testing.assert_allclose(gw, ww, rtol=tol, atol=tol)
    np.testing.assert_allclose(gb, wb, rtol=tol, atol=tol)


def test_a_bfloat16_norm_adds_into_the_gradient_so_far(host_kernels):
    """``into``: the bfloat16 rows' gradient is computed, then added (as float16's is)."""
    x, g, so_far = _rand((4, 40)), _rand((4, 40), seed=1), _rand((4, 40), seed=4)
    _, xhat, rstd = gpu.layer_norm_forward(x, None, None, 1e-5)
    alone = gpu.layer_norm_backward(g, xhat, rstd, None)
    into = gpu.layer_norm_backward(g, xhat, rstd, None, into=so_far.copy())
    np.testing.assert_array_equal(into, so_far + alone)


@pytest.mark.parametrize("B,nh,T,hs", [(1, 1, 1, 1), (2, 3, 5, 7), (1, 2, 33, 8),
                                       (1, 2, 17, 24)], ids=str)
def test_fused_attention_kernels_on_bfloat16_rows(host_kernels, B, nh, T, hs):
    """Forward and both backward kernels with ``__nv_bfloat16`` rows against the fused
    reference (which computes in float32 on the rows cast up)."""
    r = np.random.default_rng(1)
    hm = r.standard_normal((3, B, nh, T, hs)).astype(BF16)
    gy = r.standard_normal((B, nh, T, hs)).astype(BF16)
    scale = 1.0 / np.sqrt(hs)
    assert gpu_attention.fused_attention_takes(hm)
    y, lse = gpu_attention.flash_attention_forward(hm, scale)
    want_y, want_lse = reference.flash_attention_forward(hm, scale)
    assert y.dtype == want_y.dtype == BF16 and lse.dtype == np.float32
    _within_one_step(y, want_y.astype(np.float32))
    np.testing.assert_allclose(lse, want_lse, rtol=3e-5, atol=3e-5)
    dh = gpu_attention.flash_attention_backward(hm, y, gy, lse, scale)
    want = reference.flash_attention_backward(hm, y, gy, lse, scale)
    assert dh.dtype == BF16
    np.testing.assert_allclose(dh.astype(np.float32), want.astype(np.float32), rtol=8e-3,
                               atol=8e-3 * max(1.0, float(np.abs(want.astype(np.float32)).max())))


# -- the ElementwiseKernels' bfloat16 twins ---------------------------------------

def _twin(name):
    return host_elementwise(name, *BFLOAT16_SOURCES[name], preamble=BF16_WORDS)


def _words(a):
    return a.view(np.uint16)


@needs_compiler
@pytest.mark.parametrize("shape", [(7, 33), (1, 1), (0, 4)], ids=str)
def test_dropout_twins_round_as_numpy_does(shape):
    """Each bfloat16 twin of dropout / bias / residual add against the reference on
    NumPy's bfloat16 arrays (every operation rounded to bfloat16): bit for bit."""
    x, y = _rand(shape), _rand(shape, seed=1)
    b = _rand(shape[1:], seed=2)                         # broadcast over the rows, as on CuPy
    u = np.random.default_rng(3).random(shape, dtype=np.float32)
    p = 0.3
    scale = 1.0 / (1.0 - p)
    cases = {
        "mpishard_dropout_bf16": ((y, u, p, scale), reference.dropout_add(None, y, u, p)),
        "mpishard_dropout_add_bf16": ((x, y, u, p, scale), reference.dropout_add(x, y, u, p)),
        "mpishard_bias_dropout_bf16": ((y, b, u, p, scale),
                                       reference.dropout_add(None, y, u, p, b)),
        "mpishard_bias_dropout_add_bf16": ((x, y, b, u, p, scale),
                                           reference.dropout_add(x, y, u, p, b)),
        "mpishard_bias_add_bf16": ((x, y, b), reference.dropout_add(x, y, None, p, b)),
        "mpishard_add_bias_bf16": ((y, b), reference.dropout_add(None, y, None, p, b)),
    }
    for name, (args, want) in cases.items():
        got = _twin(name)(*(_words(a) if getattr(a, "dtype", None) == BF16 else a
                            for a in args))
        assert want.dtype == BF16, name
        np.testing.assert_array_equal(got.view(BF16).astype(np.float32),
                                      want.astype(np.float32), err_msg=name)


@needs_compiler
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
def test_gelu_twins_compute_in_float32(with_bias):
    """GELU's bfloat16 twins each way: float32 inside, the output rounded once; tanh
    (kept in float32) and the bias's float32 gradient within float32 rounding."""
    a, g = _rand((9, 40)), _rand((9, 40), seed=1)
    b = _rand((40,), seed=2) if with_bias else None
    tag = "bias_" if with_bias else ""
    inputs = (a,) if b is None else (a, b)                 # the bias broadcast, as on CuPy
    y, t = _twin(f"mpishard_{tag}gelu16_forward_bf16")(*map(_words, inputs))
    wy, wt = reference.gelu16_forward(a, b)
    assert wy.dtype == BF16
    np.testing.assert_allclose(t, wt, rtol=2e-6, atol=2e-6)
    x32 = reference.up32(a) if b is None else reference.up32(a) + reference.up32(b)
    _within_one_step(y.view(BF16), reference.gelu_forward(x32)[0], atol=1e-6)
    want_gf = reference.gelu16_grad32(a, b, wt, g)
    if b is None:
        gx = _twin("mpishard_gelu16_backward_bf16")(_words(a), wt, _words(g))
    else:
        gx, gf = _twin("mpishard_bias_gelu16_backward_bf16")(_words(a), _words(b), wt,
                                                             _words(g))
        np.testing.assert_allclose(gf, want_gf, rtol=2e-6, atol=2e-6)
    _within_one_step(gx.view(BF16), want_gf, atol=1e-6)


@needs_compiler
def test_swiglu_twins_compute_in_float32():
    """SwiGLU's bfloat16 twins each way: float32 inside, each result rounded once, the
    sigmoid from the gate itself (the float32 kernels' formulas, equal to the
    reference's to float32 rounding)."""
    a, u, g = (_rand((9, 40), seed=s) for s in range(3))
    y = _twin("mpishard_swiglu16_forward_bf16")(_words(a), _words(u))
    a32, u32, g32 = (reference.up32(v) for v in (a, u, g))
    _within_one_step(y.view(BF16), reference.swiglu_forward(a32, u32), atol=1e-6)
    dg, du = _twin("mpishard_swiglu16_backward_bf16")(_words(a), _words(u), _words(g))
    want_gate, want_up = reference.swiglu_backward(a32, u32, g32)
    _within_one_step(dg.view(BF16), want_gate, atol=1e-6)
    _within_one_step(du.view(BF16), want_up, atol=1e-6)


def test_the_kernel_set_passes_bfloat16_as_words(monkeypatch):
    """On a device module the kernel set hands a bfloat16 array to its twin as uint16
    words and returns bfloat16 arrays; float16 goes to the ``T`` kernel unchanged."""
    calls = []

    def fake_kernel(xp, name, sources, preamble=""):
        def run(*args):
            calls.append((name, [getattr(a, "dtype", type(a).__name__) for a in args],
                          preamble == BF16_WORDS))
            return np.zeros(3, np.uint16) if name.endswith("_bf16") else np.zeros(3, np.float16)
        return run
    monkeypatch.setattr(gpu, "elementwise_kernel", fake_kernel)
    y, u = np.ones(3, BF16), np.ones(3, np.float32)
    out = gpu.dropout_backward(y, u, 0.5)
    assert out.dtype == BF16
    assert calls[-1] == ("mpishard_dropout_bf16",
                         [np.dtype(np.uint16), np.dtype(np.float32), "float", "float"], True)
    gpu.dropout_backward(np.ones(3, np.float16), u, 0.5)
    assert calls[-1][0] == "mpishard_dropout" and calls[-1][1][0] == np.float16


# -- cuBLAS with CUDA_R_16BF ---------------------------------------------------

@pytest.mark.parametrize("trans_a,trans_b", test_gemm.TRANS)
@pytest.mark.parametrize("out_dtype", [BF16, np.dtype(np.float32)], ids=str)
def test_bfloat16_products_go_to_cublas_as_16bf(monkeypatch, trans_a, trans_b, out_dtype):
    """``CUDA_R_16BF`` operands, float32 compute (``COMPUTE_32F``), bfloat16 or float32
    out: the documented call, emulated, gives the float32 product rounded once."""
    monkeypatch.setitem(test_gemm.DTYPES, gemm.CUDA_TYPES["bfloat16"], BF16)
    monkeypatch.setattr(gemm, "_cublas",
                        lambda: (test_gemm.emulated_gemm_strided_batched_ex, 0))
    monkeypatch.setattr(gemm, "_pointer", lambda x: x.ctypes.data)
    a, b = test_gemm._operands(trans_a, trans_b, (3,), 5, 7, 4, BF16)
    out = np.zeros((3, 5, 4), dtype=out_dtype)
    args = gemm.cublas_arguments(a, b, trans_a, trans_b, out)
    assert args["Atype"] == args["Btype"] == 14 and args["computeType"] == gemm.COMPUTE_32F
    assert args["Ctype"] == gemm.CUDA_TYPES[out_dtype.name]
    gemm._call_cublas(args, a, b, out)
    want = test_gemm._want(a, b, trans_a, trans_b, np.float32)
    if out_dtype == BF16:
        _within_one_step(out, want)
    else:
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_a_bfloat16_product_cublas_cannot_take_runs_in_float32():
    """A layout the cuBLAS call does not take (every other column: no unit stride)
    falls back; on bfloat16 not to CuPy 14's batched product, which fails (the strict
    module raises as CuPy does), but to a float32 one, rounded once."""
    from mpishard.testing import strict

    r = np.random.default_rng(0)
    a = r.standard_normal((4, 3, 10)).astype(BF16)
    b = r.standard_normal((4, 3, 2)).astype(BF16)
    a_dev, b_dev = strict.asarray(a)[..., ::2], strict.asarray(b)     # (4, 3, 5) strided
    assert gemm.cublas_arguments(a_dev, b_dev, True, False,
                                 strict.empty((4, 5, 2), dtype=BF16)) is None
    with pytest.raises(NotImplementedError, match="cupy#10317"):
        a_dev.swapaxes(-1, -2) @ b_dev
    got = gemm.batched_matmul(a_dev, b_dev, trans_a=True)
    want = np.matmul(a[..., ::2].swapaxes(-1, -2).astype(np.float32),
                     b.astype(np.float32)).astype(BF16)
    assert got.dtype == BF16
    np.testing.assert_array_equal(got.get().view(np.uint16), want.view(np.uint16))


def test_the_bfloat16_kernels_on_each_array_module(array_backend, monkeypatch):
    """The GPU kernel set on bfloat16 arrays of each module against the references on
    NumPy: on CuPy the compiled kernels (a 768-wide row, rows across two attention
    tiles), on the strict module the references as one launch each, on NumPy the
    RawKernels and the ElementwiseKernels' twins compiled for the host."""
    xp = array_backend.xp
    if xp is np:
        use_host_kernels(monkeypatch)
        monkeypatch.setattr(gpu, "elementwise_kernel", lambda xp, name, sources, preamble="":
                            host_elementwise(name, *sources[name], preamble=preamble))

    def host(a):
        return a.get() if hasattr(a, "get") else a
    up = reference.up32
    x, g, res = _rand((6, 768)), _rand((6, 768), seed=1), _rand((6, 768), seed=2)
    w, b = _rand((768,), seed=3), _rand((768,), seed=4)
    dx, dg, dres, dw, db = map(xp.asarray, (x, g, res, w, b))
    y, xhat, rstd = gpu.layer_norm_forward(dx, dw, db, 1e-5)
    wy, wxhat, wrstd = reference.layer_norm_forward(up(x), up(w), up(b), 1e-5)
    _within_one_step(host(y), wy)
    np.testing.assert_allclose(host(rstd), wrstd, rtol=1e-4, atol=1e-4)
    _within_one_step(host(gpu.layer_norm_backward(dg, xhat, rstd, dw)),
                     reference.layer_norm_backward(up(g), wxhat, wrstd, up(w)))
    gw, _ = gpu.norm_param_grads(dg, xhat, True, False)
    np.testing.assert_allclose(host(gw), reference.norm_param_grads(up(g), wxhat, True,
                                                                    False)[0],
                               rtol=1e-3, atol=1e-3)
    a, t = gpu.gelu16_forward(dx, db)
    _within_one_step(host(a), reference.gelu_forward(up(x) + up(b))[0], atol=1e-6)
    gx, gb = gpu.gelu16_backward(dx, db, t, dg, True)
    want_gf = reference.gelu16_grad32(x, b, host(t), g)
    _within_one_step(host(gx), want_gf, atol=1e-6)
    np.testing.assert_allclose(host(gb), want_gf.sum(axis=0), rtol=1e-3, atol=1e-3)
    u = np.random.default_rng(5).random((6, 768), dtype=np.float32)
    out = gpu.dropout_add(dres, dx, xp.asarray(u), 0.1, db)
    assert out.dtype == BF16
    np.testing.assert_array_equal(host(out).astype(np.float32),
                                  reference.dropout_add(res, x, u, 0.1, b).astype(np.float32))
    hm = np.random.default_rng(6).standard_normal((3, 1, 2, 40, 64)).astype(BF16)
    gy = np.random.default_rng(7).standard_normal((1, 2, 40, 64)).astype(BF16)
    y, lse = gpu.flash_attention_forward(xp.asarray(hm), 0.125)
    want_y, want_lse = reference.flash_attention_forward(hm, 0.125)
    # tensor cores take the weights as bfloat16, each off by at most 2^-9 of itself
    _within_one_step(host(y), want_y.astype(np.float32),
                     atol=2.0**-9 * float(np.abs(hm[2].astype(np.float32)).max()))
    np.testing.assert_allclose(host(lse), want_lse, rtol=1e-4, atol=1e-4)
    dh = gpu.flash_attention_backward(xp.asarray(hm), y, xp.asarray(gy), lse, 0.125)
    want = reference.flash_attention_backward(hm, want_y, gy, want_lse, 0.125)
    np.testing.assert_allclose(host(dh).astype(np.float32), want.astype(np.float32),
                               rtol=2e-2, atol=2e-2)

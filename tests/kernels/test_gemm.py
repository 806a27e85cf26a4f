"""Batched products with transposes as flags (mpishard/kernels/cuda/gemm.py).

The cuBLAS path is checked here without a GPU: an emulation of
``cublasGemmStridedBatchedEx`` as cuBLAS documents it (column-major matrices at
raw addresses, leading dimensions, strides between the batch's matrices) runs on
host memory, and the arguments ``gemm.py`` computes must make it produce
NumPy's product. On a GPU the last test runs the real call.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from mpishard.kernels.cuda import gemm

DTYPES = {0: np.float32, 1: np.float64, 2: np.float16}      # CUDA_R_32F, _64F, _16F
TRANS = [(False, False), (True, False), (False, True), (True, True)]


def _memory(ptr: int, dtype, extent: int) -> np.ndarray:
    """``extent`` elements of ``dtype`` at host address ``ptr`` (writable)."""
    buf = (ctypes.c_char * (extent * np.dtype(dtype).itemsize)).from_address(ptr)
    return np.frombuffer(buf, dtype=dtype)


def _column_major(ptr, dtype, rows, cols, ld, stride, batch):
    """The batch's column-major ``rows x cols`` matrices, leading dimension ``ld``."""
    item = np.dtype(dtype).itemsize
    extent = (batch - 1) * stride + (rows - 1) + (cols - 1) * ld + 1
    flat = _memory(ptr, dtype, extent)
    return np.lib.stride_tricks.as_strided(flat, (batch, rows, cols),
                                           (stride * item, item, ld * item))


def emulated_gemm_strided_batched_ex(handle, transa, transb, m, n, k, alpha, A, Atype, lda,
                                     strideA, B, Btype, ldb, strideB, beta, C, Ctype, ldc,
                                     strideC, batchCount, computeType, algo):
    """``C[i] = alpha op(A[i]) op(B[i]) + beta C[i]``, column-major, op(A) m x k, op(B)
    k x n, as cuBLAS's documentation states; the scalars at host addresses."""
    assert algo == gemm.GEMM_DEFAULT and batchCount >= 1
    assert lda >= max(1, m if transa == gemm.OP_N else k)
    assert ldb >= max(1, k if transb == gemm.OP_N else n) and ldc >= max(1, m)
    scalar = np.float64 if computeType == gemm.COMPUTE_64F else np.float32
    a_ = _memory(alpha, scalar, 1)[0]
    b_ = _memory(beta, scalar, 1)[0]
    if transa == gemm.OP_N:
        opa = _column_major(A, DTYPES[Atype], m, k, lda, strideA, batchCount)
    else:
        opa = _column_major(A, DTYPES[Atype], k, m, lda, strideA, batchCount).swapaxes(1, 2)
    if transb == gemm.OP_N:
        opb = _column_major(B, DTYPES[Btype], k, n, ldb, strideB, batchCount)
    else:
        opb = _column_major(B, DTYPES[Btype], n, k, ldb, strideB, batchCount).swapaxes(1, 2)
    c = _column_major(C, DTYPES[Ctype], m, n, ldc, strideC, batchCount)
    acc = np.float64 if computeType == gemm.COMPUTE_64F else np.float32
    result = a_ * np.matmul(opa.astype(acc), opb.astype(acc)) + b_ * c.astype(acc)
    c[...] = result.astype(c.dtype)


@pytest.fixture
def host_cublas(monkeypatch):
    """gemm.py's cuBLAS call routed to the emulation, pointers as host addresses."""
    monkeypatch.setattr(gemm, "_cublas", lambda: (emulated_gemm_strided_batched_ex, 0))
    monkeypatch.setattr(gemm, "_pointer", lambda x: x.ctypes.data)


def _operands(trans_a, trans_b, batch, m, k, n, dtype, seed=0):
    r = np.random.default_rng(seed)
    a = r.standard_normal(batch + ((k, m) if trans_a else (m, k))).astype(dtype)
    b = r.standard_normal(batch + ((n, k) if trans_b else (k, n))).astype(dtype)
    return a, b


def _want(a, b, trans_a, trans_b, dtype=np.float64):
    op = lambda x, t: x.swapaxes(-1, -2) if t else x                        # noqa: E731
    return np.matmul(op(a, trans_a).astype(dtype), op(b, trans_b).astype(dtype))


@pytest.mark.parametrize("trans_a,trans_b", TRANS)
@pytest.mark.parametrize("batch,m,k,n", [((3,), 5, 7, 4), ((2, 3), 1, 9, 6), ((4,), 17, 1, 3),
                                         ((1,), 6, 5, 1)], ids=str)
@pytest.mark.parametrize("dtype,out_dtype", [(np.float64, np.float64), (np.float32, np.float32),
                                             (np.float16, np.float16), (np.float16, np.float32)])
def test_the_cublas_arguments_compute_the_product(host_cublas, trans_a, trans_b, batch, m, k, n,
                                                  dtype, out_dtype):
    a, b = _operands(trans_a, trans_b, batch, m, k, n, dtype)
    out = np.zeros(batch + (m, n), dtype=out_dtype)
    args = gemm.cublas_arguments(a, b, trans_a, trans_b, out)
    assert args is not None
    gemm._call_cublas(args, a, b, out)
    tol = 2e-2 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(out.astype(np.float64), _want(a, b, trans_a, trans_b),
                               rtol=tol, atol=tol)


def test_head_major_views_and_strided_rows(host_cublas):
    """Attention's operands: q, k, v as slices of one head-major buffer (the batch axes
    (B, heads) collapse into one stride), and rows with a stride longer than the row."""
    r = np.random.default_rng(3)
    hm = r.standard_normal((3, 2, 3, 11, 4)).astype(np.float32)
    q, k = hm[0], hm[1]
    scores = np.zeros((2, 3, 11, 11), np.float32)
    gemm._call_cublas(gemm.cublas_arguments(q, k, False, True, scores), q, k, scores)
    np.testing.assert_allclose(scores, q @ k.swapaxes(-1, -2), rtol=1e-5, atol=1e-5)
    wide = r.standard_normal((4, 6, 10)).astype(np.float32)[:, :, :7]   # row stride 10
    other = r.standard_normal((4, 7, 5)).astype(np.float32)
    out = np.zeros((4, 6, 5), np.float32)
    gemm._call_cublas(gemm.cublas_arguments(wide, other, False, False, out), wide, other, out)
    np.testing.assert_allclose(out, wide @ other, rtol=1e-5, atol=1e-5)


def test_layouts_cublas_cannot_take_fall_back():
    packed = np.zeros((2, 11, 3, 3, 4), np.float32)            # (B, T, 3, heads, hs)
    q = packed[:, :, 0].transpose(0, 2, 1, 3)                  # batch strides do not collapse
    out = np.zeros((2, 3, 11, 11), np.float32)
    assert gemm.cublas_arguments(q, q, False, True, out) is None
    a = np.zeros((2, 3, 4), np.float32)
    assert gemm.cublas_arguments(a, a.astype(np.float64), False, True, out[:2, 0, :3, :3]) is None
    assert gemm.cublas_arguments(a[:, :, ::2], a[:, :, ::2], False, True,
                                 np.zeros((2, 3, 3), np.float32)) is None   # strided columns
    assert gemm.cublas_arguments(a[:, :, :0], a[:, :, :0], False, True,
                                 np.zeros((2, 3, 3), np.float32)) is None   # k = 0
    assert gemm.cublas_arguments(a, a, False, True, np.zeros((2, 3, 3), np.float64)) is None


@pytest.mark.parametrize("trans_a,trans_b", TRANS)
def test_batched_matmul_on_numpy_and_strict(trans_a, trans_b):
    from mpishard.testing import strict
    a, b = _operands(trans_a, trans_b, (2, 3), 6, 5, 4, np.float32, seed=1)
    want = _want(a, b, trans_a, trans_b, np.float32)
    got = gemm.batched_matmul(a, b, trans_a, trans_b)
    np.testing.assert_array_equal(got, want)
    wide = gemm.batched_matmul(a.astype(np.float16), b.astype(np.float16), trans_a, trans_b,
                               out_dtype=np.float32)
    assert wide.dtype == np.float32
    np.testing.assert_allclose(wide, want, rtol=2e-2, atol=2e-2)
    sa, sb = strict.asarray(a), strict.asarray(b)
    strict.syncs.reset()
    got = gemm.batched_matmul(sa, sb, trans_a, trans_b)
    assert strict.syncs.launches_by_op == {"cublas_gemm_strided_batched": 1}
    np.testing.assert_allclose(got.get(), want, rtol=1e-6, atol=1e-6)
    strict.syncs.reset()
    strict.matmul(sa.swapaxes(-1, -2) if trans_a else sa, sb.swapaxes(-1, -2) if trans_b else sb)
    assert strict.syncs.launches_by_op["matmul-copy"] == trans_a + trans_b   # CuPy's copies


def test_batched_matmul_on_the_device(array_backend):
    """On CuPy the real cuBLAS call (attention-sized at T=1024 there), float32 and
    float16 in, float16 and float32 out, against NumPy in float64."""
    xp = array_backend.xp
    if xp is np:
        pytest.skip("the NumPy path is numpy.matmul (above)")
    T = 1024 if array_backend.name == "cupy" else 33
    for dtype, out_dtype, tol in ((np.float32, np.float32, 1e-3), (np.float16, np.float16, 3e-2),
                                  (np.float16, np.float32, 1e-2)):
        for trans_a, trans_b in TRANS:
            a, b = _operands(trans_a, trans_b, (2, 3), T, 64, T, dtype, seed=5)
            got = gemm.batched_matmul(xp.asarray(a), xp.asarray(b), trans_a, trans_b,
                                      out_dtype=out_dtype)
            assert got.dtype == out_dtype
            want = _want(a, b, trans_a, trans_b)
            scale = np.abs(want).max()
            np.testing.assert_allclose(got.get().astype(np.float64) / scale, want / scale,
                                       rtol=0, atol=tol)


def test_a_16bit_linear_weight_gradient_comes_out_in_float32_on_the_device():
    """Under mixed precision (``grad_dtype`` float32) a device linear layer's weight
    gradient is one cuBLAS call, float16 in and float32 out, straight into the
    strategy's buffer: the float32 product of the float16 operands, never rounded to
    16 bits (the strict module computes it as cuBLAS does)."""
    from mpishard.testing import strict
    from mpishard.autodiff import Tensor, linear

    r = np.random.default_rng(7)
    x16 = r.standard_normal((37, 24)).astype(np.float16)
    w16 = r.standard_normal((11, 24)).astype(np.float16)
    g16 = r.standard_normal((37, 11)).astype(np.float16)
    x = Tensor(strict.asarray(x16), requires_grad=False)
    w = Tensor(strict.asarray(w16), requires_grad=True)
    w.grad_dtype = np.dtype(np.float32)
    w.grad_out = strict.zeros((11, 24), dtype=np.float32)
    y, g = linear(x, w), strict.asarray(g16)
    strict.syncs.reset()
    y.backward(g)
    assert w.grad is w.grad_out
    assert strict.syncs.launches_by_op == {"cublas_gemm_strided_batched": 1}
    want = g16.astype(np.float32).T @ x16.astype(np.float32)
    np.testing.assert_allclose(w.grad.get(), want, rtol=1e-6, atol=1e-5)
    assert not np.array_equal(want.astype(np.float16).astype(np.float32), want)

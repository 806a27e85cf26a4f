"""Batched matrix products with the operands' transposes as flags, on cuBLAS.

    from mpishard.kernels.cuda.gemm import batched_matmul
    batched_matmul(q, k, trans_b=True, out=scores)     # scores[i] = q[i] @ k[i].T

Attention's four batched products per direction take an operand transposed
(``k.T``, ``p.T``, ``v.T``, ``q.T``). CuPy 14's ``matmul`` makes every operand of a
product of more than two dimensions C-contiguous first, so a transposed view is
copied (for ``p.T`` a whole T x T array), and it casts float16 operands to float32
and runs the product in float32 without tensor cores, then copies the result back
to float16 (read from ``cupy/_core/_routines_linalg.pyx``; the strict module counts
these copies, see mpishard/testing/strict/copies.py). Here, on CuPy, one
``cublasGemmStridedBatchedEx`` call does the product: the transposes are cuBLAS's
``op`` flags, 16-bit inputs (float16 as ``CUDA_R_16F``, bfloat16 as ``CUDA_R_16BF``)
run on tensor cores with float32 accumulation, and the result may be float32
(attention's scores, for a float32 softmax) or the inputs' dtype. CuPy 14's own
batched bfloat16 products fail (cupy#10317), so a bfloat16 product the cuBLAS call does
not take runs in float32 instead.

What cuBLAS is handed (it is column-major): a C-contiguous row-major ``X`` of
shape ``(r, c)`` with row stride ``ld`` is, read column-major, ``X.T`` with leading
dimension ``ld``. So ``C = op(A) @ op(B)`` is computed as ``C.T = op(B).T @ op(A).T``:
cuBLAS's first operand is ``B``'s memory (flag ``T`` when ``trans_b``), its second
``A``'s, ``m`` the columns of ``C``, ``n`` its rows, and every leading dimension
is a row stride. Each operand needs unit stride along its last axis and one
stride between its matrices (its batch axes must collapse into one); otherwise,
or for other dtypes, the product falls back to ``xp.matmul`` on the views.

On NumPy the product is ``numpy.matmul`` on the views (its BLAS takes the
transposes itself), or MKL's for 2-D products under ``MPISHARD_BLAS=mkl``
(mpishard/kernels/cpu/blas.py); on the CuPy-strict test module it counts as the one launch
it is on a GPU.
"""
from __future__ import annotations

import os

import numpy as np

from mpishard.core.backend import xp_of
from mpishard.kernels.cpu.blas import matmul as cpu_matmul
from mpishard.kernels.cuda.launch import is_strict_module

__all__ = ["batched_matmul", "matmul", "cublas_arguments"]

# cuBLAS / CUDA enums (cublas_api.h, library_types.h; also in CuPy's cupy_backends)
OP_N, OP_T = 0, 1
CUDA_TYPES = {"float16": 2, "bfloat16": 14, "float32": 0,     # CUDA_R_16F, _16BF, _32F,
              "float64": 1}                                    # _64F
COMPUTE_32F, COMPUTE_32F_FAST_TF32, COMPUTE_64F = 68, 77, 70
GEMM_DEFAULT = -1
#: (input dtype, output dtype) pairs the cuBLAS path takes (16-bit inputs accumulate in
#: float32, ``COMPUTE_32F``)
SUPPORTED = {("float16", "float16"), ("float16", "float32"), ("bfloat16", "bfloat16"),
             ("bfloat16", "float32"), ("float32", "float32"), ("float64", "float64")}


def _op(x, trans: bool):
    return x.swapaxes(-1, -2) if trans else x


def _out_shape(a, b, trans_a: bool, trans_b: bool) -> tuple:
    rows = a.shape[-1] if trans_a else a.shape[-2]
    cols = b.shape[-2] if trans_b else b.shape[-1]
    return a.shape[:-2] + (rows, cols)


def batched_matmul(a, b, trans_a: bool = False, trans_b: bool = False, out=None,
                   out_dtype=None):
    """``op(a) @ op(b)`` over the leading axes (none: one 2-D product), ``op`` a
    transpose of the last two axes where ``trans_a`` / ``trans_b``; into ``out`` when
    given, else a new array of ``out_dtype`` (default ``a``'s). ``a`` and ``b`` have the
    same leading axes and dtype. See the module docstring for the backends."""
    xp = xp_of(a)
    if out is None:
        out = xp.empty(_out_shape(a, b, trans_a, trans_b), dtype=out_dtype or a.dtype)
    if xp is np:
        if out.dtype == a.dtype:
            cpu_matmul(_op(a, trans_a), _op(b, trans_b), out=out)
        else:
            out[...] = cpu_matmul(_op(a, trans_a), _op(b, trans_b))
        return out
    args = cublas_arguments(a, b, trans_a, trans_b, out)
    if args is None and a.dtype.name == "bfloat16":    # CuPy 14 has no batched bfloat16
        out[...] = xp.matmul(_op(a, trans_a).astype(np.float32),    # products (cupy#10317)
                             _op(b, trans_b).astype(np.float32))
    elif args is None:                           # CuPy's matmul (on strict: its copies too)
        out[...] = xp.matmul(_op(a, trans_a), _op(b, trans_b))
    elif is_strict_module(xp):                   # the one cuBLAS call it is on a GPU:
        with xp.syncs.fused("cublas_gemm_strided_batched"):     # 16-bit accumulated in
            if a.dtype.itemsize == 2 or out.dtype.itemsize > a.dtype.itemsize:  # float32,
                a, b = a.astype(np.float32), b.astype(np.float32)   # rounded once into out
            out[...] = xp.matmul(_op(a, trans_a), _op(b, trans_b))
    elif out.size:
        _call_cublas(args, a, b, out)
    return out


def _matrix_strides(x):
    """``(batch stride, row stride)`` in elements for ``x``'s matrices, or None when its
    last axis is not unit-stride or its batch axes do not collapse into one stride."""
    item = x.dtype.itemsize
    if x.ndim < 2 or any(s % item or s < 0 for s in x.strides):
        return None
    strides = [s // item for s in x.strides]
    if x.shape[-1] > 1 and strides[-1] != 1:
        return None
    ld = strides[-2] if x.shape[-2] > 1 else x.shape[-1]
    if ld < max(x.shape[-1], 1):
        return None
    batch = [(n, s) for n, s in zip(x.shape[:-2], strides[:-2]) if n > 1]
    step = batch[-1][1] if batch else 0
    expect = step
    for n, s in reversed(batch):                 # each axis: the next one's span
        if s != expect:
            return None
        expect = s * n
    return step, ld


def cublas_arguments(a, b, trans_a: bool, trans_b: bool, out) -> dict | None:
    """The ``cublasGemmStridedBatchedEx`` arguments (less the pointers and scalars)
    for ``out = op(a) @ op(b)``, or None when the layouts or dtypes do not fit (see
    the module docstring)."""
    if (a.dtype != b.dtype or (a.dtype.name, out.dtype.name) not in SUPPORTED
            or a.shape[:-2] != b.shape[:-2] or out.shape != _out_shape(a, b, trans_a, trans_b)
            or a.ndim < 2):
        return None
    sa, sb, sc = _matrix_strides(a), _matrix_strides(b), _matrix_strides(out)
    if sa is None or sb is None or sc is None:
        return None
    rows, cols = out.shape[-2:]
    k = a.shape[-2] if trans_a else a.shape[-1]
    if k == 0:                                   # nothing to multiply: the fallback zeros
        return None
    batch = int(np.prod(out.shape[:-2], dtype=np.int64))
    if a.dtype.name == "float64":
        compute = COMPUTE_64F
    elif a.dtype.name == "float32" and os.environ.get("CUPY_TF32", "0") == "1":
        compute = COMPUTE_32F_FAST_TF32          # as CuPy's own products under CUPY_TF32
    else:
        compute = COMPUTE_32F
    return dict(transa=OP_T if trans_b else OP_N, transb=OP_T if trans_a else OP_N,
                m=cols, n=rows, k=k,
                Atype=CUDA_TYPES[b.dtype.name], lda=sb[1], strideA=sb[0],
                Btype=CUDA_TYPES[a.dtype.name], ldb=sa[1], strideB=sa[0],
                Ctype=CUDA_TYPES[out.dtype.name], ldc=sc[1], strideC=sc[0],
                batchCount=batch, computeType=compute, algo=GEMM_DEFAULT)


def _cublas():
    """The cuBLAS binding and handle (see :mod:`mpishard.kernels.cuda.libs`)."""
    from mpishard.kernels.cuda.libs import cublas_gemm_strided_batched
    return cublas_gemm_strided_batched()


def _pointer(x) -> int:
    return x.data.ptr


def _call_cublas(args: dict, a, b, out) -> None:
    gemm, handle = _cublas()
    scalar = np.float64 if args["computeType"] == COMPUTE_64F else np.float32
    alpha, beta = np.ones(1, scalar), np.zeros(1, scalar)     # host scalars, kept alive
    gemm(handle, args["transa"], args["transb"], args["m"], args["n"], args["k"],
         alpha.ctypes.data,
         _pointer(b), args["Atype"], args["lda"], args["strideA"],
         _pointer(a), args["Btype"], args["ldb"], args["strideB"],
         beta.ctypes.data,
         _pointer(out), args["Ctype"], args["ldc"], args["strideC"],
         args["batchCount"], args["computeType"], args["algo"])


def matmul(a, b):
    """``a @ b``: on NumPy through the CPU's BLAS choice
    (:func:`mpishard.kernels.cpu.blas.matmul`), elsewhere the array module's own operator."""
    return cpu_matmul(a, b) if isinstance(a, np.ndarray) else a @ b

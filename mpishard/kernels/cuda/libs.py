"""The CUDA library calls mpishard makes past CuPy's array API, through CuPy's bindings.

Part of the backend layer (with :mod:`mpishard.core.backend`): the layers above never
import CuPy themselves. Imported on first use, so that mpishard imports without CuPy.
"""
from __future__ import annotations

__all__ = ["cublas_gemm_strided_batched"]


def cublas_gemm_strided_batched():
    """``(gemm, handle)``: CuPy's binding of ``cublasGemmStridedBatchedEx`` (23
    positional arguments: handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA,
    B, Btype, ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo;
    it binds the handle to the current stream) and the current device's cuBLAS handle."""
    from cupy.cuda import device  # noqa: PLC0415 (optional dependency)
    from cupy_backends.cuda.libs import cublas  # noqa: PLC0415

    return cublas.gemmStridedBatchedEx, device.get_cublas_handle()

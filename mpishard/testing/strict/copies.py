"""The copies CuPy's ``matmul`` makes around its cuBLAS call, counted as launches.

A product of strided or transposed operands, or of float16 ones batched over more
than two dimensions, is not one kernel on CuPy: ``cupy/_core/_routines_linalg.pyx``
copies such operands into C-contiguous arrays of the compute dtype first and may
copy the result into ``out`` after. The strict module's ``matmul`` counts those
copies (as ``"matmul-copy"``) so that a launch count read on the CPU is the count
on a GPU.
"""
from __future__ import annotations

import numpy as np

__all__ = ["hidden_copies"]


def hidden_copies(a, b, out=None) -> int:
    """The copy kernels CuPy 14's ``matmul`` launches beside its GEMM (read from
    ``cupy/_core/_routines_linalg.pyx``). Up to two dimensions (``dot``): an operand
    neither C- nor F-contiguous is copied, and the result is copied into an ``out``
    that is not C-contiguous or not of the operands' dtype. Batched (more
    dimensions): float16 products run in float32, so every operand that is not
    C-contiguous of the compute dtype is copied (float16 ones cast), and the result
    is copied into ``out`` unless that is C-contiguous of the compute dtype (with no
    ``out``, a float16 result is one more cast)."""
    ret = np.promote_types(a.dtype, b.dtype)
    if a.ndim <= 2 and b.ndim <= 2:
        n = sum(not (x.flags.c_contiguous or x.flags.f_contiguous) for x in (a, b))
        return n + (out is not None and not (out.flags.c_contiguous and out.dtype == ret))
    compute = np.dtype(np.float32) if ret == np.float16 else ret
    n = sum(not (x.flags.c_contiguous and x.dtype == compute) for x in (a, b))
    if out is None:
        return n + (compute != ret)
    return n + (not (out.flags.c_contiguous and out.dtype == compute))

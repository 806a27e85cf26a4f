"""Row reductions as NumPy does them fastest on CPUs: sums over a short last axis
through ``einsum`` (about 3x faster than ``a.sum(1)`` on the shapes the models use),
row dot products through ``einsum``, row maxima through ``fmax.reduce``; column sums
(a bias's gradient) as a ones-vector product (BLAS beats NumPy's reduction). On other
array modules (CuPy, the strict module) each is the plain call."""
from __future__ import annotations

import numpy as np

from mpishard.core.backend import xp_of

__all__ = ["row_sum", "row_dot", "row_max", "col_sum", "col_sum_dtype"]


def row_sum(x2d):
    """Sum over the last axis of a 2-D array."""
    if isinstance(x2d, np.ndarray):
        return np.einsum("ij->i", x2d)
    return x2d.sum(axis=1)


def row_dot(a2d, b2d):
    """Row-wise dot product of two 2-D arrays."""
    return xp_of(a2d).einsum("ij,ij->i", a2d, b2d)


def row_max(x2d):
    """Maximum over the last axis of a 2-D array."""
    if isinstance(x2d, np.ndarray):
        return np.fmax.reduce(x2d, axis=1)
    return x2d.max(axis=1)


def col_sum_dtype(dtype) -> np.dtype:
    """The dtype :func:`col_sum` sums rows of ``dtype`` in and returns: float32 for
    16-bit rows, else their own."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def col_sum(x2d, out=None):
    """Sum over the first axis of a 2-D array, into ``out`` if given; 16-bit rows are
    summed (and returned) in float32 (:func:`col_sum_dtype`)."""
    if x2d.dtype != col_sum_dtype(x2d.dtype):
        x2d = x2d.astype(np.float32)
    if isinstance(x2d, np.ndarray):
        return np.matmul(np.ones(x2d.shape[0], dtype=x2d.dtype), x2d, out=out)
    return x2d.sum(axis=0, out=out)

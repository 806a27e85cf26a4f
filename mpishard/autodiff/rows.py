"""The NumPy idioms the fused ops are built from, measured to be fast on CPUs.

Reductions over a short last axis through ``einsum`` (about 3x faster than
``a.sum(1)`` on the shapes the models use), ``einsum``/``vecdot`` row dot
products, ``fmax.reduce`` for row maxima, bias gradients as a ones-vector
matmul, and row blocks that keep elementwise passes inside the CPU caches. On
CuPy each falls back to the plain call (a GPU wants few, large kernels).
"""
from __future__ import annotations

import numpy as np

from ..backend import xp_of
from ..dtypes import is_low_precision
from .tensor import Tensor

__all__ = ["row_sum", "row_dot", "row_max", "col_sum", "up", "cast", "check_last_dim",
           "row_blocks", "scatter_add"]


def row_sum(x2d):
    """Sum over the last axis of a 2-D array."""
    if isinstance(x2d, np.ndarray):
        return np.einsum("ij->i", x2d)
    return x2d.sum(axis=1)


def row_dot(a2d, b2d):
    """Row-wise dot product of two 2-D arrays."""
    return xp_of(a2d).einsum("ij,ij->i", a2d, b2d)


def row_max(x2d):
    if isinstance(x2d, np.ndarray):
        return np.fmax.reduce(x2d, axis=1)
    return x2d.max(axis=1)


def col_sum(x2d):
    """Sum over the first axis: a ones-vector matmul on NumPy (BLAS beats its
    reduction there), one reduction kernel on a GPU (where the ones would be one
    launch more)."""
    if isinstance(x2d, np.ndarray):
        return np.ones(x2d.shape[0], dtype=x2d.dtype) @ x2d
    if is_low_precision(x2d.dtype):                  # accumulate in float32
        return x2d.sum(axis=0, dtype=np.float32).astype(x2d.dtype)
    return x2d.sum(axis=0)


def up(a):
    """``a`` in float32 if it is a 16-bit float array, else ``a`` itself (see [Note: 16-bit inputs] in nn_ops.py)."""
    return a.astype(np.float32) if is_low_precision(a.dtype) else a


def cast(a, dtype):
    """``a`` cast to ``dtype`` (no copy when it already is)."""
    return a if a is None or a.dtype == dtype else a.astype(dtype)


def scatter_add(out, index, values) -> None:
    """``out[index] += values`` with repeated indices adding up: ``np.add.at`` on
    NumPy, ``cupyx.scatter_add`` on CuPy (the strict module has its own)."""
    xp = xp_of(out)
    if xp is np:
        np.add.at(out, index, values)
    elif hasattr(xp, "scatter_add"):
        xp.scatter_add(out, index, values)
    else:
        import cupyx  # noqa: PLC0415

        cupyx.scatter_add(out, index, values)


def check_last_dim(op: str, x: Tensor, n: int, what: str) -> None:
    if x.ndim == 0 or x.shape[-1] != n:
        raise ValueError(f"{op}: input of shape {tuple(x.shape)} does not end in "
                         f"{what} = {n}")



# -- cache blocking ----------------------------------------------------------

# [Note: cache blocking]
# Elementwise NumPy passes over arrays larger than the CPU caches are bound by
# memory bandwidth: on the 2-core machine this project is measured on, the ten
# passes of a GELU over an (2048, 1024) float32 array took 21 ms one array at a
# time and 10 ms when run over blocks of rows that stay in L2 (backward: 15 ms
# vs 5 ms), with bit-identical results. So the fused ops below run their passes
# block by block on NumPy. On CuPy one block covers everything (a GPU wants
# few, large kernels).
BLOCK_ELEMS = 1 << 15


def row_blocks(x2d):
    """Slices of rows that keep a block of ``x2d`` cache-sized (all rows on GPU)."""
    n_rows, n_cols = x2d.shape
    if not isinstance(x2d, np.ndarray) or n_rows == 0:
        return [slice(0, n_rows)]                       # one block (of zero rows: still one)
    step = max(1, BLOCK_ELEMS // max(n_cols, 1))
    return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]

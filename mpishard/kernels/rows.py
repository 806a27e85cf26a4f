"""Row reductions as NumPy does them fastest on CPUs: sums over a short last axis
through ``einsum`` (about 3x faster than ``a.sum(1)`` on the shapes the models use),
row dot products through ``einsum``, row maxima through ``fmax.reduce``. On other
array modules (CuPy, the strict module) each is the plain call."""
from __future__ import annotations

import numpy as np

from ..backend import xp_of

__all__ = ["row_sum", "row_dot", "row_max"]


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

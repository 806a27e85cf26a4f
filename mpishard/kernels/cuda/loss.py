"""Fused cross-entropy on a GPU: the RawKernels of :mod:`.loss_src`, launched (part of
the GPU kernel set, :mod:`.ops`).

``cross_entropy_forward(logits, targets, ignore_index)`` is one launch: a thread block
per row for its maximum, sum of exponentials and loss, and the grid's last block for
the mean; ``cross_entropy_backward`` one more, writing the gradient in the logits'
dtype. The logits are read where they lie (C-contiguous float16, bfloat16, float32 or
float64, the 16-bit ones converted per element into float32 registers), so no float32 copy of the
``(N, V)`` logits is made either way. Other inputs (another dtype, strided logits, no
rows) run the reference; on the CuPy-strict module the reference runs as the one launch
per kernel it is on a GPU.

The forward's last block is found with a ticket counter, the first of
:func:`.launch.block_tickets` (per device and stream, shared with the column sums),
handed back at 0 by every launch.
"""
from __future__ import annotations

import numpy as np

from mpishard.core.backend import xp_of
from mpishard.kernels import reference
from mpishard.kernels.cuda.launch import (ROW_THREADS, block_tickets, is_strict_module,
                                          raw_function)
from mpishard.kernels.cuda.loss_src import loss_kernel_name, loss_kernel_source
from mpishard.kernels.cuda.ops_src import STORAGE, compute_dtype, storage_dtypes

__all__ = ["cross_entropy_forward", "cross_entropy_backward", "cross_entropy_takes"]


def cross_entropy_takes(logits, targets) -> bool:
    """Whether the kernels take these logits and targets (see the module docstring)."""
    return (logits.ndim == 2 and logits.dtype.name in STORAGE and logits.flags.c_contiguous
            and 0 < logits.shape[0] < 2 ** 31 and 0 < logits.shape[1] < 2 ** 31
            and targets.shape == logits.shape[:1])


def _kernel(xp, name: str, dtype):
    T, S = storage_dtypes(dtype)
    return raw_function(xp, loss_kernel_name(name, S), lambda: loss_kernel_source(T, S))


def _int64_rows(xp, targets):
    """The targets as the kernels read them: C-contiguous int64 (a copy only if not)."""
    return xp.ascontiguousarray(targets, dtype=np.int64)


def cross_entropy_forward(logits, targets, ignore_index: int):
    xp = xp_of(logits)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_cross_entropy_forward"):
            return reference.cross_entropy_forward(logits, targets, ignore_index)
    if not cross_entropy_takes(logits, targets):
        return reference.cross_entropy_forward(logits, targets, ignore_index)
    (N, V), fd = logits.shape, compute_dtype(logits.dtype)
    stats = xp.empty((3, N), dtype=fd)          # maxima, sums of exponentials, rows' losses
    totals = xp.empty(2, dtype=fd)              # the mean loss, the rows counted
    _kernel(xp, "mpishard_cross_entropy_forward", logits.dtype)(
        (N,), (ROW_THREADS,), (logits, _int64_rows(xp, targets), np.int64(N), np.int32(V),
                               np.int64(ignore_index), stats, totals, block_tickets(xp, 1)))
    return totals[0:1].reshape(()), stats[0], stats[1], totals[1:2].reshape(())  # 0-d views


def cross_entropy_backward(logits, targets, ignore_index: int, row_max, row_sum, count, g):
    xp = xp_of(logits)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_cross_entropy_backward"):
            return reference.cross_entropy_backward(logits, targets, ignore_index, row_max,
                                                    row_sum, count, g)
    fd = compute_dtype(logits.dtype)
    kept = (row_max, row_sum, count)
    if not (cross_entropy_takes(logits, targets)
            and all(getattr(a, "dtype", None) == fd and a.flags.c_contiguous for a in kept)
            and count.size == 1):
        return reference.cross_entropy_backward(logits, targets, ignore_index, row_max,
                                                row_sum, count, g)
    N, V = logits.shape
    grad = xp.empty(logits.shape, dtype=logits.dtype)
    g = g if getattr(g, "dtype", None) == fd and g.size == 1 else xp.asarray(g, dtype=fd)
    _kernel(xp, "mpishard_cross_entropy_backward", logits.dtype)(
        (N,), (ROW_THREADS,), (logits, _int64_rows(xp, targets), np.int32(V),
                               np.int64(ignore_index), row_max, row_sum, count, g, grad))
    return grad

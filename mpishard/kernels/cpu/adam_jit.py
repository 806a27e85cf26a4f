"""The host's AdamW step as one compiled loop (numba): each element read once, updated
in registers, written once.

Imported only by :func:`mpishard.kernels.cpu.ops.compiled_adam`, and only when numba
is installed (``pip install 'mpishard[cpu-adam]'``); without it the CPU kernels run
Adam as NumPy passes over cache-sized blocks (:func:`mpishard.kernels.cpu.ops.adam_update`).

[Note: one-pass host Adam]
An AdamW step on float32 must read p, g, m and v and write p, m and v: 28 bytes of
memory traffic per element, and at 100M parameters (1.6 GB of arrays) that traffic is
the step. NumPy cannot fuse ufuncs: its cache-blocked step runs 14 passes over each
block (decay, 4 for m, 4 for v, 4 for the denominator and quotient, the subtraction),
each a separate loop with its own loads and stores, and that work, not DRAM, bounds it
(measured in benchmarks/host_adam.py: about 3x PyTorch's fused AdamW). This loop does the
same operations, in the same order and the same dtype, per element:

    g = grad * grad_scale
    m = m * beta1 + g * (1 - beta1)
    v = v * beta2 + g * g * (1 - beta2)
    p = p * decay - m / (sqrt(v) * inv_bias2 + eps) * step_size

with every scalar rounded to the arrays' dtype first (as NumPy rounds a Python float
against a float32 array) and no fast-math (no fused multiply-adds, no reassociation), so
its results are bit for bit those of the NumPy passes, and do not depend on how the
elements are split over threads. ``error_model="numpy"`` lets a division by zero give
inf, as NumPy does, without a test per element that would keep the loop from
vectorising.
"""
from __future__ import annotations

import numba
import numpy as np

__all__ = ["adam_spans"]

_JIT = dict(nogil=True, error_model="numpy", cache=True)


@numba.njit(**_JIT)
def _adam_run(p, g, m, v, lo, hi, decay, grad_scale, beta1, one_minus_beta1, beta2,
              one_minus_beta2, inv_bias2, eps, step_size):
    # slices, then indices from 0: an index known to be >= 0 needs no wrap-around test,
    # which is what lets the loop vectorise
    p, g, m, v = p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi]
    for i in range(p.size):
        gi = g[i] * grad_scale
        mi = m[i] * beta1 + gi * one_minus_beta1
        vi = v[i] * beta2 + gi * gi * one_minus_beta2
        m[i] = mi
        v[i] = vi
        p[i] = p[i] * decay - mi / (np.sqrt(vi) * inv_bias2 + eps) * step_size


@numba.njit(**_JIT)
def adam_spans(p, g, m, v, lo, hi, starts, stops, one, decay, grad_scale, beta1,
               one_minus_beta1, beta2, one_minus_beta2, inv_bias2, eps, step_size):
    """Elements ``[lo, hi)`` of one flat target: those inside the decay ranges
    (``starts``/``stops``, sorted, disjoint) times ``decay``, the rest times ``one``
    (exact), each then Adam's update (see [Note: one-pass host Adam]). Scalars in the
    arrays' dtype."""
    i = lo
    for r in range(starts.size):
        a = max(starts[r], lo)
        b = min(stops[r], hi)
        if a >= b:
            continue
        if i < a:
            _adam_run(p, g, m, v, i, a, one, grad_scale, beta1, one_minus_beta1, beta2,
                      one_minus_beta2, inv_bias2, eps, step_size)
        _adam_run(p, g, m, v, a, b, decay, grad_scale, beta1, one_minus_beta1, beta2,
                  one_minus_beta2, inv_bias2, eps, step_size)
        i = b
    if i < hi:
        _adam_run(p, g, m, v, i, hi, one, grad_scale, beta1, one_minus_beta1, beta2,
                  one_minus_beta2, inv_bias2, eps, step_size)

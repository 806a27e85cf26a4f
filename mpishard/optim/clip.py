"""Single-process gradient clipping by global norm.

Strategies compute the same norm collectively (every rank gets the same value
and makes the same decision); this is the single-process reference.
"""
from __future__ import annotations

import math
from typing import Iterable

import numpy as np

from mpishard.core.backend import xp_of
from mpishard.kernels import kernels_for

__all__ = ["grad_sq_sum", "global_grad_norm", "clip_grad_norm", "clip_coefficient"]


def grad_sq_sum(grads: Iterable):
    """Sum of squares of every element of ``grads``, accumulated in float64.

    Host arrays: each one's float64 copy dotted with itself, added in order into a
    Python float, which is returned. Device arrays: all their sums of squares in one
    multi-tensor call (on a GPU two launches, float64 accumulation, no float64 copy)
    into the slots of a small device array, added in the arrays' order (after the host
    arrays' total, if any) by one cumulative sum: the result is a 0-d float64 device
    array, never read back here (a step decides on it on the device; see [Note: device
    step decisions] in mpishard/parallel/strategy.py).
    """
    total, device = 0.0, []
    for g in grads:
        if g is None or g.size == 0:
            continue
        if isinstance(g, np.ndarray):
            flat = g.reshape(-1)
            if flat.dtype != np.float64:
                flat = flat.astype(np.float64)
            total += float(np.dot(flat, flat))
        else:
            device.append(g)
    if not device:
        return total
    xp = xp_of(device[0])
    sums = xp.zeros(len(device) + 1, dtype=np.float64)
    if total:
        sums[0] = total
    kernels_for(xp).multi_sq_sum(device, sums[1:])
    return xp.cumsum(sums)[-1]       # left to right, as the host's loop adds


def global_grad_norm(params: Iterable) -> float:
    """L2 norm of all gradients together (``inf``/``nan`` when any is non-finite); on a
    device one read of the sum."""
    return math.sqrt(float(grad_sq_sum(p.grad for p in params)))


def clip_coefficient(norm, max_norm: float, xp=None):
    """Factor to scale gradients by so their norm is at most ``max_norm`` (torch's rule):
    a Python float, or with ``xp`` (a device array module) the same arithmetic on a 0-d
    device array ``norm``, never read back."""
    coefficient = max_norm / (norm + 1e-6)
    return min(1.0, coefficient) if xp is None else xp.minimum(1.0, coefficient)


def clip_grad_norm(params, max_norm: float) -> float:
    """Scale gradients in place so their global norm is at most ``max_norm``.

    Returns:
        The norm before clipping. Gradients are left alone when it is not finite
        (callers skip such a step; see ``mpishard.parallel``).
    """
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params)
    if not math.isfinite(norm):
        return norm
    coeff = clip_coefficient(norm, max_norm)
    if coeff < 1.0:
        for p in params:
            p.grad *= coeff
    return norm

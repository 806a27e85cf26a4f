"""Finite-difference gradient checking, used by every op test.

``gradcheck(fn, inputs)`` compares the gradients backward computes for a
random projection of ``fn``'s output with central differences, in float64.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from mpishard.autodiff.tensor import Tensor


def _objective(fn, tensors, projection):
    out = fn(*tensors)
    outs = out if isinstance(out, (list, tuple)) else [out]
    total = 0.0
    for o, r in zip(outs, projection):
        total += float((o.data * r).sum())
    return total


def numerical_grad(fn: Callable, inputs: Sequence[np.ndarray], projection, eps: float = 1e-6):
    """Central-difference gradients of ``sum(fn(*inputs) * projection)`` w.r.t. each input."""
    grads = []
    for i, x in enumerate(inputs):
        g = np.zeros_like(x)
        flat, gflat = x.reshape(-1), g.reshape(-1)
        for j in range(flat.size):
            saved = flat[j]
            flat[j] = saved + eps
            plus = _objective(fn, [Tensor(a) for a in inputs], projection)
            flat[j] = saved - eps
            minus = _objective(fn, [Tensor(a) for a in inputs], projection)
            flat[j] = saved
            gflat[j] = (plus - minus) / (2 * eps)
        grads.append(g)
    return grads


def gradcheck(fn: Callable, inputs: Sequence[np.ndarray], *, seed: int = 0,
              eps: float = 1e-6) -> float:
    """Largest relative error (by norm) between backward and finite differences.

    Args:
        fn: maps Tensors to a Tensor (or a list of Tensors).
        inputs: float64 arrays; every one is differentiated.

    Returns:
        ``max_i ||analytic_i - numeric_i|| / max(||analytic_i||, ||numeric_i||, 1e-12)``.
    """
    inputs = [np.array(a, dtype=np.float64) for a in inputs]
    rng = np.random.default_rng(seed)
    tensors = [Tensor(a.copy(), requires_grad=True) for a in inputs]
    out = fn(*tensors)
    outs = out if isinstance(out, (list, tuple)) else [out]
    projection = [rng.standard_normal(o.shape) for o in outs]
    total = None
    for o, r in zip(outs, projection):
        term = (o * Tensor(r)).sum()
        total = term if total is None else total + term
    total.backward()
    numeric = numerical_grad(fn, inputs, projection, eps)
    worst = 0.0
    for t, n in zip(tensors, numeric):
        a = t.grad if t.grad is not None else np.zeros_like(n)
        scale = max(np.linalg.norm(a), np.linalg.norm(n), 1e-12)
        worst = max(worst, float(np.linalg.norm(a - n) / scale))
    return worst

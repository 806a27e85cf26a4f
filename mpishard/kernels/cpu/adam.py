"""The CPU kernels' Adam step: one compiled pass when numba is installed, NumPy passes
over cache-sized blocks otherwise; bit for bit the same either way, whatever the threads.

    from mpishard.kernels.cpu.adam import multi_adam_update, compiled_adam
    multi_adam_update([(p, g, m, v, ((0, p.size),))], 0.9, 0.999, lr / (1 - 0.9 ** t),
                      1 / math.sqrt(1 - 0.999 ** t), 1e-8, grad_scale=1.0, decay=1 - lr * wd)

:func:`multi_adam_update` (the kernel set's, see :class:`~mpishard.kernels.protocol.
KernelSet`) takes every target of an optimizer step: float32 and float64 targets whose
four arrays are contiguous go to :mod:`.adam_jit`'s loop (see [Note: one-pass host Adam]
there), the elements of all of them together cut into one contiguous share per thread
(``MPISHARD_THREADS``, :func:`.threads.for_shares`), once they hold at least
:data:`COMPILED_MIN_ELEMS` elements; anything else (another dtype, a strided view, a
small model), and everything when numba is not installed, to :func:`adam_update`'s
NumPy passes, target by target. The host optimizer that offloading uses
(``--offload optimizer``, docs/offload.md) is this kernel.
"""
from __future__ import annotations

import functools
from bisect import bisect_right

import numpy as np

from mpishard.kernels import reference
from mpishard.kernels.cpu.threads import for_rows, for_shares

__all__ = ["adam_update", "multi_adam_update", "numpy_adam_update", "numpy_multi_adam_update",
           "compiled_multi_adam_update", "compiled_adam"]

_COMPILED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
#: the fewest elements a step's compilable targets must hold for the compiled loop: below
#: it the NumPy passes run and numba is never imported (its import and the loop's load
#: from the on-disk cache cost about 1.2 s a process, what the compiled loop saves over
#: the passes in about 200 steps of 4M elements; small models would never earn it back)
COMPILED_MIN_ELEMS = 1 << 22


@functools.cache
def compiled_adam():
    """:mod:`.adam_jit` when numba imports (``pip install 'mpishard[cpu-adam]'``), else
    ``None``: the NumPy passes run instead."""
    try:
        from mpishard.kernels.cpu import adam_jit  # noqa: PLC0415 (numba: optional, slow to import)
    except ImportError:
        return None
    return adam_jit


def adam_update(param, grad, m, v, beta1: float, beta2: float, step_size: float,
                inv_bias2: float, eps: float) -> None:
    """One target's Adam step (:meth:`.KernelSet.adam_update`): :func:`multi_adam_update`
    of it alone."""
    multi_adam_update([(param, grad, m, v, ())], beta1, beta2, step_size, inv_bias2, eps)


def numpy_adam_update(param, grad, m, v, beta1: float, beta2: float, step_size: float,
                      inv_bias2: float, eps: float) -> None:
    """One target's Adam step as NumPy passes over blocks of 4096-element rows (the
    fallback, and strided views)."""
    def step(p, g, mb, vb) -> None:
        tmp = g * (1.0 - beta1)
        mb *= beta1
        mb += tmp
        np.multiply(g, g, out=tmp)
        tmp *= 1.0 - beta2
        vb *= beta2
        vb += tmp
        np.sqrt(vb, out=tmp)
        tmp *= inv_bias2
        tmp += eps
        np.divide(mb, tmp, out=tmp)
        tmp *= step_size
        p -= tmp
    arrays = (param, grad, m, v)
    if not all(a.flags.c_contiguous for a in arrays):
        step(*arrays)                   # views with strides: one pass over each
        return
    p1, g1, m1, v1 = (a.reshape(-1) for a in arrays)
    width = 1 << 12                     # flat arrays as rows of 4096 for the blocks
    full = p1.size // width * width

    def span(lo: int, hi: int) -> None:
        step(p1[lo:hi], g1[lo:hi], m1[lo:hi], v1[lo:hi])
    if full:
        for_rows(lambda rows: span(rows.start * width, rows.stop * width), full // width,
                 width)
    if full < p1.size:
        span(full, p1.size)


#: the NumPy passes for many targets: each gradient scaled, each decay range decayed, then
#: :func:`numpy_adam_update`, target by target
numpy_multi_adam_update = reference.multi_adam(numpy_adam_update)


def _compilable(target) -> bool:
    """Whether the compiled loop takes ``target``: float32 or float64, its four arrays of
    one dtype and size, contiguous, and its decay ranges sorted and disjoint."""
    param, grad, m, v, ranges = target
    dtype, size = param.dtype, param.size
    if dtype not in _COMPILED_DTYPES or not all(
            isinstance(a, np.ndarray) and a.dtype == dtype and a.size == size
            and a.flags.c_contiguous for a in (param, grad, m, v)):
        return False
    bounds = [b for r in ranges for b in r]
    return all(a <= b for a, b in zip(bounds, bounds[1:]))


def compiled_multi_adam_update(targets, beta1: float, beta2: float, step_size: float,
                               inv_bias2: float, eps: float, grad_scale: float = 1.0,
                               decay: float = 1.0) -> None:
    """:func:`multi_adam_update` through the compiled loop (every target must be one
    :func:`_compilable` takes): all targets' elements as one index space, one share per
    thread, each share one call per target it covers."""
    jit = compiled_adam()
    work, offsets = [], [0]
    for param, grad, m, v, ranges in targets:
        cast = param.dtype.type       # scalars rounded to the arrays' dtype, as NumPy does
        edges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        work.append(((param.reshape(-1), grad.reshape(-1), m.reshape(-1), v.reshape(-1)),
                     np.ascontiguousarray(edges[:, 0]), np.ascontiguousarray(edges[:, 1]),
                     tuple(cast(x) for x in (1.0, decay, grad_scale, beta1, 1.0 - beta1,
                                             beta2, 1.0 - beta2, inv_bias2, eps,
                                             step_size))))
        offsets.append(offsets[-1] + param.size)

    def share(lo: int, hi: int) -> None:
        k = bisect_right(offsets, lo) - 1
        while k < len(work) and offsets[k] < hi:
            arrays, starts, stops, scalars = work[k]
            a, b = max(lo - offsets[k], 0), min(hi - offsets[k], arrays[0].size)
            if a < b:
                jit.adam_spans(*arrays, a, b, starts, stops, *scalars)
            k += 1
    for_shares(share, offsets[-1])


def multi_adam_update(targets, beta1: float, beta2: float, step_size, inv_bias2,
                      eps: float, grad_scale=1.0, decay: float = 1.0, skip=None) -> None:
    """One AdamW step over ``(param, grad, m, v, decay_ranges)`` targets (see the module
    docstring and :meth:`.KernelSet.multi_adam_update`)."""
    step_size, inv_bias2, grad_scale, skipped = reference.step_scalars(
        step_size, inv_bias2, grad_scale, skip)
    if skipped:
        return
    args = (beta1, beta2, step_size, inv_bias2, eps, grad_scale, decay)
    fast = [t for t in targets if _compilable(t)]
    if sum(t[0].size for t in fast) < COMPILED_MIN_ELEMS or compiled_adam() is None:
        fast = []
    if fast:
        compiled_multi_adam_update(fast, *args)
    if len(fast) < len(targets):
        chosen = {id(t) for t in fast}
        numpy_multi_adam_update([t for t in targets if id(t) not in chosen], *args)

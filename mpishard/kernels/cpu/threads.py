"""A small persistent thread pool for the CPU kernels' row loops.

NumPy releases the interpreter lock inside its ufuncs, reductions and
``einsum``, so the cache-blocked row loops of the CPU kernels (see [Note: cache
blocking] below) run on several cores when their blocks are handed to threads. Each thread takes one contiguous share of the rows and
walks it block by block; the calling thread takes the first share, so one
thread means no pool at all.

The thread count is ``MPISHARD_THREADS`` (default 1: opt in). Measured on a
2-core machine, GPT config S: two threads made a GELU over (2048, 1024) float32
1.2x faster alone and the training step no faster (0.343-0.350 s against
0.331-0.346 s with BLAS on 2 threads): each pass hands the interpreter's lock
back and forth, and the BLAS library's own threads keep the second core busy
between products. ``numexpr`` measured slower still (its ``tanh`` is scalar:
55 ms against 4 ms for the blocked NumPy passes). With many cores and wide
layers, try ``MPISHARD_THREADS`` = the cores per rank.

    from mpishard.kernels.cpu.threads import for_rows
    for_rows(lambda rows: out[rows].__imul__(2.0), n_rows, n_cols)
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["thread_count", "for_rows", "for_shares", "BLOCK_ELEMS", "MIN_PARALLEL_ELEMS"]

# [Note: cache blocking]
# Elementwise NumPy passes over arrays larger than the CPU caches are bound by
# memory bandwidth: on the 2-core machine this project is measured on, the ten
# passes of a GELU over an (2048, 1024) float32 array took 21 ms one array at a
# time and 10 ms when run over blocks of rows that stay in L2 (backward: 15 ms
# vs 5 ms), with bit-identical results. So the CPU kernels run their passes
# block by block, and attention one sequence at a time; on CuPy one block
# covers everything (a GPU wants few, large kernels).

#: elements per block: 256 KiB of float32, inside a core's L2 cache with the few
#: arrays a pass reads beside it (measured best for one thread; threads take blocks
#: twice that size, halving how often they hand the interpreter's lock back and forth)
BLOCK_ELEMS = 1 << 16
#: below this many elements an op runs on the calling thread alone (a hand-off
#: costs tens of microseconds)
MIN_PARALLEL_ELEMS = 1 << 16

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def thread_count() -> int:
    """Threads the CPU kernels use: ``MPISHARD_THREADS``, default 1 (see the module
    docstring)."""
    value = os.environ.get("MPISHARD_THREADS", "").strip()
    if not value:
        return 1
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"MPISHARD_THREADS={value!r} is not a thread count; set it to a "
                         f"positive integer, e.g. MPISHARD_THREADS=2") from None
    if n < 1:
        raise ValueError(f"MPISHARD_THREADS={value!r} must be >= 1; use e.g. MPISHARD_THREADS=2")
    return n


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size != workers:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=workers,
                                       thread_name_prefix="mpishard-kernel")
            _pool_size = workers
        return _pool


def _walk(fn, start: int, stop: int, step: int) -> None:
    for i in range(start, stop, step):
        fn(slice(i, min(i + step, stop)))


def for_rows(fn, n_rows: int, n_cols: int, threads: int | None = None,
             block: int = BLOCK_ELEMS) -> None:
    """Call ``fn(rows)`` for slices of about ``block`` elements' rows covering
    ``range(n_rows)``, spread over ``threads`` threads (default :func:`thread_count`);
    returns when all are done, re-raising the first error. ``fn`` must only write its
    own rows."""
    n = thread_count() if threads is None else threads
    if n_rows * n_cols < MIN_PARALLEL_ELEMS:
        n = 1
    step = max(1, (block if n == 1 else 2 * block) // max(n_cols, 1))
    n = max(1, min(n, -(-n_rows // step)))        # no more threads than blocks
    if n == 1:
        _walk(fn, 0, n_rows, step)
        return
    blocks = -(-n_rows // step)
    bounds = [min(n_rows, (blocks * k // n) * step) for k in range(n + 1)]
    _in_parallel([(lambda lo=lo, hi=hi: _walk(fn, lo, hi, step))
                  for lo, hi in zip(bounds, bounds[1:])])


def for_shares(fn, n_items: int, threads: int | None = None, align: int = 16) -> None:
    """Call ``fn(start, stop)`` once per thread, on contiguous shares of ``range(n_items)``
    (share bounds at multiples of ``align``), for kernels that walk their share in one
    call (a compiled loop that streams through memory needs no cache blocks); below
    :data:`MIN_PARALLEL_ELEMS` items one call on the calling thread."""
    n = thread_count() if threads is None else threads
    if n_items < MIN_PARALLEL_ELEMS:
        n = 1
    n = max(1, min(n, n_items // max(align, 1)))
    if n == 1:
        if n_items:
            fn(0, n_items)
        return
    bounds = [n_items * k // n // align * align for k in range(n)] + [n_items]
    _in_parallel([(lambda lo=lo, hi=hi: fn(lo, hi)) for lo, hi in zip(bounds, bounds[1:])])


def _in_parallel(calls: list) -> None:
    """Run ``calls[0]`` on this thread and the rest on the pool; return when all are done,
    re-raising the first error."""
    pool = _executor(len(calls) - 1)
    futures = [pool.submit(call) for call in calls[1:]]
    error = None
    try:
        calls[0]()
    except BaseException as err:                  # wait for the others before raising
        error = err
    for f in futures:
        try:
            f.result()
        except BaseException as err:
            error = error or err
    if error is not None:
        raise error

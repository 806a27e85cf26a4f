"""How the GPU kernel set compiles and launches its kernels: the compiled-kernel cache,
the RawKernels' block shapes and arguments, and the checks of which arrays the
RawKernels take. Each launcher (:mod:`.ops`, :mod:`.norms`, :mod:`.multi`,
:mod:`.attention`) builds its kernels here from the sources beside it."""
from __future__ import annotations

import numpy as np

__all__ = ["ROW_THREADS", "PARAM_ROW_THREADS", "is_strict_module", "elementwise_kernel",
           "reduction_kernel", "raw_function", "raw_kernels_take", "presence_flag",
           "dropout_arguments", "copy_to_device", "COLUMN_BLOCKS_WANTED", "MIN_GROUP_ROWS",
           "column_groups", "column_launch", "block_tickets"]

#: threads per block of the kernels that take a thread block per row
ROW_THREADS = 256
#: row threads per block of the column-sum kernels (32 columns each; at most 32)
PARAM_ROW_THREADS = 32
#: thread blocks a column-sum launch aims at: 4 per multiprocessor of a 132-SM H100 or
#: H200. A constant, not the device's count, so that the row groups, and with them the
#: order of every sum, depend on the shape alone (see [Note: column sums])
COLUMN_BLOCKS_WANTED = 4 * 132
#: the fewest rows a column-sum block takes: 2 per row thread (its partial sums, written
#: and read again, are then at most half of what it reads)
MIN_GROUP_ROWS = 2 * PARAM_ROW_THREADS
_compiled: dict = {}
#: (array module, device, stream) -> the last-block-done tickets (see :func:`block_tickets`)
_tickets: dict = {}


def is_strict_module(xp) -> bool:
    """Whether ``xp`` is the CuPy-strict test module, on which each kernel runs the
    reference math inside ``xp.syncs.fused(name)``: one launch, as on a GPU."""
    return getattr(xp, "NAME", None) == "strict"


def elementwise_kernel(xp, name: str, sources: dict, preamble: str = ""):
    """The ``cupy.ElementwiseKernel`` ``name`` of ``sources`` (name -> inputs, outputs,
    body), with ``preamble`` (device functions the body calls) before it, built once and
    kept (CuPy compiles it per dtype on first use)."""
    kernel = _compiled.get(name)
    if kernel is None:
        inputs, outputs, body = sources[name]
        kernel = _compiled[name] = xp.ElementwiseKernel(inputs, outputs, body, name,
                                                        preamble=preamble)
    return kernel


def reduction_kernel(xp, name: str, reductions: dict):
    """The ``cupy.ReductionKernel`` ``name`` of ``reductions`` (name -> inputs, outputs,
    map, reduce, post-map; identity 0), built once and kept."""
    kernel = _compiled.get(name)
    if kernel is None:
        inputs, outputs, mapped, reduce, post = reductions[name]
        kernel = _compiled[name] = xp.ReductionKernel(inputs, outputs, mapped, reduce, post,
                                                      "0", name)
    return kernel


def raw_function(xp, key: str, source, options: tuple = ()):
    """The RawKernel ``key`` of the module ``source()`` builds, compiled once (with NVRTC
    ``options``) and kept."""
    kernel = _compiled.get(key)
    if kernel is None:
        kernel = _compiled[key] = xp.RawModule(code=source(), options=options).get_function(key)
    return kernel


def raw_kernels_take(*arrays, drop_u=None) -> bool:
    """Whether the RawKernels take these arrays (None: absent): one dtype, float32 or
    float64, all C-contiguous; dropout draws ``drop_u`` float32 and C-contiguous."""
    present = [a for a in arrays if a is not None]
    dtype = present[0].dtype
    return (dtype.name in ("float32", "float64")
            and all(a.dtype == dtype and a.flags.c_contiguous for a in present)
            and (drop_u is None or (drop_u.dtype.name == "float32"
                                    and drop_u.flags.c_contiguous)))


def presence_flag(a) -> np.int32:
    """A RawKernel's flag for an optional array: 1 when ``a`` is given, 0 for None."""
    return np.int32(a is not None)


def dropout_arguments(drop_u, drop_p: float, stand_in, dtype) -> tuple:
    """The row kernels' dropout arguments: the flag, draws, p and 1 / (1 - p) in T (with
    no dropout: flag 0, ``stand_in`` for the draws)."""
    return (presence_flag(drop_u), stand_in if drop_u is None else drop_u,
            np.float32(drop_p), dtype.type(1.0 / (1.0 - drop_p)))


def copy_to_device(device, host) -> None:
    """Copy host array ``host`` into ``device`` (same shape and dtype): one host-to-device
    copy on the current stream (``ndarray.set``); a plain copy where ``device`` is a
    NumPy array."""
    if hasattr(device, "set"):
        device.set(host)
    else:
        device[...] = host


def column_groups(rows: int, n: int) -> int:
    """Rows per row group of a column-sum launch over ``rows x n``: enough groups that
    the launch has about :data:`COLUMN_BLOCKS_WANTED` blocks of 32 columns, at least
    :data:`MIN_GROUP_ROWS` rows each, a multiple of :data:`PARAM_ROW_THREADS`."""
    column_blocks = max(1, -(-n // 32))
    wanted = max(1, -(-COLUMN_BLOCKS_WANTED // column_blocks))
    group = max(MIN_GROUP_ROWS, -(-rows // wanted))
    return -(-group // PARAM_ROW_THREADS) * PARAM_ROW_THREADS


def block_tickets(xp, count: int):
    """Tickets for the last-block-done pattern (the column sums, cross-entropy's mean) on
    ``xp``'s current device and stream: ``uint32`` counters, zero between launches (the
    last block to arrive resets its own), allocated zeroed once and kept (grown by powers
    of two). Launches on one stream run one after another, so every kernel on it shares
    them."""
    cuda = getattr(xp, "cuda", None)
    key = (id(xp), None if cuda is None else
           (cuda.Device().id, cuda.get_current_stream().ptr))
    tickets = _tickets.get(key)
    if tickets is None or tickets.size < count:
        size = 1 << max(10, (count - 1).bit_length())
        tickets = _tickets[key] = xp.zeros(size, dtype=np.uint32)
    return tickets


def column_launch(xp, rows: int, n: int, sums: int, dtype) -> tuple:
    """``(grid, block, tail)`` of a column-sum RawKernel over ``rows x n`` with ``sums``
    column sums (0 to 2) in compute dtype ``dtype``; ``tail`` its last three arguments:
    the rows per group, the partial sums' workspace and the tickets (see [Note: column
    sums] in :mod:`.ops_src`). Blocks of 32 columns x :data:`PARAM_ROW_THREADS` row
    threads, a grid of column blocks x row groups."""
    column_blocks = max(1, -(-n // 32))
    group = column_groups(rows, n)
    groups = max(1, -(-rows // group))
    counters = block_tickets(xp, column_blocks)
    partial = (xp.empty(sums * groups * n, dtype=dtype) if sums and groups > 1
               else counters)                   # unread (one group, or no sums)
    return ((column_blocks, groups), (32, PARAM_ROW_THREADS),
            (np.int64(group), partial, counters))

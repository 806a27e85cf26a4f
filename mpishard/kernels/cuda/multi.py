"""The optimizer's kernels on a GPU: an Adam step and the gradients' sums of squares,
each over all targets in one launch (multi-tensor; the CUDA source and the tables'
layout are :mod:`.multi_src`'s), and the one-target kernels they fall back to
(part of the GPU kernel set, :mod:`.ops`).

``multi_adam_update(targets, ...)`` takes ``(param, grad, m, v, decay_ranges)``
tuples of flat, C-contiguous arrays of one dtype (float32 or float64);
``multi_sq_sum(arrays, out)`` C-contiguous float32 or float64 arrays. Other inputs
run the GPU's one-target kernels, one launch per target (the sums of squares: those
the multi-tensor kernels take still together). The tables of addresses and chunks are
built on the host and copied to the device once for a set of targets and kept (see
[Note: multi-tensor tables]). On the CuPy-strict module the reference runs as the
launches the GPU makes: one for Adam, two for the sums of squares.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from mpishard.core.backend import xp_of
from mpishard.kernels import reference
from mpishard.kernels.cuda.multi_src import CHUNK, REDUCTIONS, SOURCES, multi_source
from mpishard.kernels.cuda.launch import (copy_to_device, elementwise_kernel, is_strict_module,
                                          raw_function, reduction_kernel)

__all__ = ["adam_update", "sq_sum", "multi_adam_update", "multi_sq_sum", "chunk_table"]

THREADS = 256
_tables: OrderedDict = OrderedDict()
_MAX_TABLES = 16


def _address(a) -> int:
    """Where ``a``'s first element lives: a device pointer (CuPy), or host memory."""
    return int(a.data.ptr) if hasattr(a.data, "ptr") else int(a.ctypes.data)


def _multi_kernel(xp, name: str, dtype):
    T = "double" if np.dtype(dtype) == np.float64 else "float"
    return raw_function(xp, f"{name}_{T}", lambda: multi_source(T))


def chunk_table(sizes, decay_ranges=None) -> tuple:
    """``(chunks, first)``: ``(target, start, stop, decays)`` rows covering every target's
    ``range(size)`` in order, at most :data:`~.multi_src.CHUNK` elements each and
    none across a boundary of the target's decay ranges; ``first[t]`` is target t's
    first row (and ``first[-1]`` the number of rows)."""
    rows, first = [], []
    for t, size in enumerate(sizes):
        first.append(len(rows))
        marks = {0, int(size)}
        decayed = set()
        for a, b in (decay_ranges[t] if decay_ranges is not None else ()):
            marks.update((int(a), int(b)))
            decayed.add((int(a), int(b)))
        cuts = sorted(m for m in marks if 0 <= m <= size)
        for a, b in zip(cuts, cuts[1:]):
            flag = int(any(lo <= a and b <= hi for lo, hi in decayed))
            rows += [(t, s, min(s + CHUNK, b), flag) for s in range(a, b, CHUNK)]
    first.append(len(rows))
    return (np.asarray(rows, dtype=np.int64).reshape(-1, 4),
            np.asarray(first, dtype=np.int64))


# [Note: multi-tensor tables]
# A launch reads its targets' addresses from a device table, and its chunks (target,
# start, stop, decays) from another. The chunks depend only on the targets' sizes and
# decay ranges, and of the addresses only the gradients' move: parameters, ZeRO shards,
# masters and the optimizer's state keep theirs for the optimizer's life, but a
# gradient may be a new array each step (p.grad reallocated by backward, cast to the
# target's dtype, scaled apart). So the tables are keyed by what stays: for Adam the
# dtype, each target's parameter, m and v addresses and size, and the decay ranges; for
# the sums of squares the dtype and the sizes. Built and copied to the device once per
# key (the chunk table walks every target in Python), they are kept, with a host copy
# of the addresses the device table holds. A later call compares its addresses with
# that copy: the same (a gradient kept in a persistent buffer, as data parallelism's
# buckets and ZeRO's flat gradients are, but for ZeRO-1's float32 shard of 16-bit
# gradients, made at each step), nothing is copied; else one host-to-device
# copy of the span that changed, the gradients' column (the table is laid out by
# column: every target's parameter, then every gradient, every m, every v). The copy
# is queued on the stream after the launches that read the old addresses, so they are
# never overwritten under a running kernel.
class _Tables:
    """One set of targets' device tables (see [Note: multi-tensor tables]): ``ptrs``
    the addresses by column, ``chunks`` and ``first`` as :func:`chunk_table` gives them,
    ``host_ptrs`` what ``ptrs`` holds."""

    def __init__(self, xp, addresses, sizes, decay_ranges=None):
        chunks, first = chunk_table(sizes, decay_ranges)
        self.host_ptrs = addresses.copy()
        self.ptrs = xp.array(addresses)
        self.chunks, self.first = xp.array(chunks), xp.array(first)
        self.n_chunks = len(chunks)

    def point_at(self, addresses) -> None:
        """Make the device table hold ``addresses``: nothing when it does, else one copy
        of the span from the first to the last address that changed."""
        changed = np.flatnonzero(addresses != self.host_ptrs)
        if changed.size:
            a, b = int(changed[0]), int(changed[-1]) + 1
            copy_to_device(self.ptrs[a:b], addresses[a:b])
            self.host_ptrs[a:b] = addresses[a:b]


def _tables_for(xp, key, columns: list, sizes: list, decay_ranges=None) -> _Tables:
    """The tables for ``key`` (built on first use, then kept; the least recently used of
    more than :data:`_MAX_TABLES` dropped), pointing at the arrays of ``columns`` (lists
    of arrays, one per target, in the table's column order)."""
    addresses = np.asarray([_address(a) for column in columns for a in column],
                           dtype=np.uint64)
    found = _tables.get(key)
    if found is None:
        found = _tables[key] = _Tables(xp, addresses, sizes, decay_ranges)
        while len(_tables) > _MAX_TABLES:
            _tables.popitem(last=False)
    else:
        _tables.move_to_end(key)
        found.point_at(addresses)
    return found


def _takes(arrays, dtype) -> bool:
    return (dtype.name in ("float32", "float64")
            and all(a.dtype == dtype and a.flags.c_contiguous and a.ndim == 1 for a in arrays))


def multi_adam_update(targets, beta1: float, beta2: float, step_size, inv_bias2, eps: float,
                      grad_scale=1.0, decay: float = 1.0, skip=None) -> None:
    targets = [t for t in targets if t[0].size]
    if not targets:
        return
    xp, dtype = xp_of(targets[0][0]), targets[0][0].dtype
    if not _takes([a for t in targets for a in t[:4]], dtype):   # float16 targets, views:
        _one_by_one(targets, beta1, beta2, step_size, inv_bias2, eps,   # one kernel per
                    grad_scale, decay, skip)                            # target
        return
    on_device = skip is not None or any(hasattr(x, "shape") for x in
                                        (step_size, inv_bias2, grad_scale))
    if on_device:       # every scalar from device memory (Python ones put there)
        step_size, inv_bias2, grad_scale = (
            x if hasattr(x, "shape") else xp.full((), x, dtype=np.float64)
            for x in (step_size, inv_bias2, grad_scale))
        skip = xp.zeros((), dtype=bool) if skip is None else skip
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_multi_adam"):     # the kernel reads its scalars
            if on_device:
                step_size, inv_bias2, grad_scale, skipped = (
                    xp.syncs.peek(a).item() for a in (step_size, inv_bias2, grad_scale, skip))
                if skipped:
                    return
            reference.multi_adam_update(targets, beta1, beta2, step_size, inv_bias2, eps,
                                        grad_scale, decay)
        return
    ranges = [tuple(t[4]) if decay != 1.0 else () for t in targets]
    key = ("adam", dtype.name,          # what stays (see [Note: multi-tensor tables])
           tuple((_address(t[0]), _address(t[2]), _address(t[3]), t[0].size) for t in targets),
           tuple(ranges))
    tables = _tables_for(xp, key, [[t[k] for t in targets] for k in range(4)],
                         [t[0].size for t in targets], ranges)
    c = dtype.type
    if on_device:
        host = (1.0, 1.0, 1.0)
        device = (step_size, inv_bias2, grad_scale, skip)
    else:
        host = (step_size, inv_bias2, grad_scale)
        device = (_no_array(xp),) * 4   # another dtype than the pointers': never read
    _multi_kernel(xp, "mpishard_multi_adam", dtype)(
        (tables.n_chunks,), (THREADS,),
        (tables.ptrs, np.int32(len(targets)), tables.chunks, c(beta1), c(1.0 - beta1), c(beta2),
         c(1.0 - beta2), c(host[0]), c(host[1]), c(eps), np.int32(host[2] != 1.0),
         c(host[2]), c(decay), np.int32(on_device), *device))


def _no_array(xp):
    """A one-byte array standing in for the absent device scalars (``on_device`` 0)."""
    return xp.empty(1, dtype=np.int8)


def multi_sq_sum(arrays, out):
    xp = xp_of(out)
    flat = [a.reshape(-1) if a.flags.c_contiguous else a for a in arrays]
    dtype = next((a.dtype for a in flat if a.dtype.name in ("float32", "float64")),
                 np.dtype(np.float32))
    if not flat or not _takes(flat, dtype):
        # one kernel per array, but those the multi-tensor kernels take together
        taken = [i for i, a in enumerate(flat) if _takes([a], dtype)]
        if len(taken) > 1:
            sums = multi_sq_sum([flat[i] for i in taken],
                                xp.empty(len(taken), dtype=np.float64))
            out[xp.asarray(np.asarray(taken, dtype=np.int64))] = sums
        else:
            taken = []
        for i in sorted(set(range(len(flat))) - set(taken)):
            sq_sum(arrays[i], out[i:i + 1])
        return out
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_multi_sq_sum"):         # the chunks' sums, then
            reference.multi_sq_sum(arrays, out)
        with xp.syncs.fused("mpishard_multi_sq_total"):       # each array's (counted)
            pass
        return out
    sizes = [a.size for a in flat]
    tables = _tables_for(xp, ("sq", dtype.name, tuple(sizes)), [flat], sizes)
    partial = xp.empty(max(tables.n_chunks, 1), dtype=np.float64)
    if tables.n_chunks:
        _multi_kernel(xp, "mpishard_multi_sq_sum", dtype)(
            (tables.n_chunks,), (THREADS,), (tables.ptrs, tables.chunks, partial))
    _multi_kernel(xp, "mpishard_multi_sq_total", dtype)(
        (-(-len(flat) // THREADS),), (THREADS,),
        (partial, tables.first, np.int32(len(flat)), out))
    return out


def adam_update(param, grad, m, v, beta1: float, beta2: float, step_size: float,
                inv_bias2: float, eps: float) -> None:
    xp = xp_of(param)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_adam_update"):
            reference.adam_update(param, grad, m, v, beta1, beta2, step_size, inv_bias2, eps)
        return
    elementwise_kernel(xp, "mpishard_adam_update", SOURCES)(
        grad, beta1, beta2, step_size, inv_bias2, eps, param, m, v)


def sq_sum(x, out):
    xp = xp_of(x)
    if x.dtype.name not in ("float32", "float64"):  # 16-bit: the copy, the product
        return reference.sq_sum(x, out)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_sq_sum"):
            return reference.sq_sum(x, out)
    return reduction_kernel(xp, "mpishard_sq_sum", REDUCTIONS)(x.reshape(-1), axis=0,
                                                              keepdims=True, out=out)


#: :func:`multi_adam_update`'s fallback: :func:`adam_update` target by target
_one_by_one = reference.multi_adam(adam_update)

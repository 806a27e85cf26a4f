"""Rotary embeddings packed with grouped key/value heads on a GPU: the RawKernels of
:mod:`.rotary_src`, launched (part of the GPU kernel set, :mod:`.ops`).

``rope_qkv_forward`` is one launch: q, k and v read once where they lie (C-contiguous
float16, bfloat16, float32 or float64), the packed ``[q | k | v]`` rows written once.
The reference takes about 8 passes over q and k (casts up, the rotation's product,
swap, product and sum, the cast down) and a copy each for k and v. Backward is one
launch too: the packed gradient read once, q's, k's and v's gradients written. They
take the usual grouped-query layouts (:func:`~mpishard.kernels.reference.even_groups`:
query head ``j`` reads key/value head ``first + j // g``, on a tensor-parallel rank
too); other maps, another dtype or strided rows run the reference. On the CuPy-strict
module the reference runs as the one launch per kernel it is on a GPU.
"""
from __future__ import annotations

import numpy as np

from mpishard.core.backend import xp_of
from mpishard.kernels import reference
from mpishard.kernels.cuda.launch import ROW_THREADS, is_strict_module, raw_function
from mpishard.kernels.cuda.ops_src import STORAGE, compute_dtype, storage_dtypes
from mpishard.kernels.cuda.rotary_src import rotary_kernel_name, rotary_kernel_source

__all__ = ["rope_qkv_forward", "rope_qkv_backward"]

#: the most blocks a launch takes (its threads then stride over the rest)
MAX_BLOCKS = 65535


def _kernel(xp, name: str, dtype):
    T, S = storage_dtypes(dtype)
    return raw_function(xp, rotary_kernel_name(name, S), lambda: rotary_kernel_source(T, S))


def _groups(heads, n_kv: int, tables, *rows):
    """``(first, g)`` where the kernels take these rows (one dtype of :data:`STORAGE`,
    C-contiguous, 32-bit head and sequence sizes), tables (``(T, hs)`` each) and heads
    map, else None."""
    first = rows[0]
    T, hs = first.shape[1], first.shape[-1]
    if not (first.dtype.name in STORAGE and max(first.shape[1:], default=0) < 2 ** 31
            and all(a.dtype == first.dtype and a.flags.c_contiguous for a in rows)
            and all(tuple(t.shape) == (T, hs) for t in tables)):
        return None
    return reference.even_groups(heads, n_kv)


def _tables(xp, cos, sin, dtype) -> tuple:
    """The tables as the kernels read them: C-contiguous in the compute dtype (a copy
    only if not)."""
    return tuple(xp.ascontiguousarray(t, dtype=dtype) for t in (cos, sin))


def _launch(n: int) -> tuple:
    return (min(MAX_BLOCKS, max(1, -(-n // ROW_THREADS))),), (ROW_THREADS,)


def rope_qkv_forward(q, k, v, cos, sin, heads):
    xp = xp_of(q)
    groups = _groups(heads, k.shape[2], (cos, sin), q, k, v)
    if groups is None:
        return reference.rope_qkv_forward(q, k, v, cos, sin, heads)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_rope_qkv_forward"):
            return reference.rope_qkv_forward(q, k, v, cos, sin, heads)
    B, T, H, hs = q.shape
    c, s = _tables(xp, cos, sin, compute_dtype(q.dtype))
    out = xp.empty((B, T, 3, H, hs), dtype=q.dtype)
    if out.size:
        _kernel(xp, "mpishard_rope_qkv_forward", q.dtype)(
            *_launch(out.size), (q, k, v, c, s, out, np.int64(out.size), np.int32(T),
                                 np.int32(H), np.int32(k.shape[2]), np.int32(hs),
                                 np.int32(groups[0]), np.int32(groups[1])))
    return out


def rope_qkv_backward(d, cos, sin, heads, n_kv: int, need_q: bool = True, need_k: bool = True,
                      need_v: bool = True):
    xp = xp_of(d)
    groups = _groups(heads, n_kv, (cos, sin), d)
    if groups is None:
        return reference.rope_qkv_backward(d, cos, sin, heads, n_kv, need_q, need_k, need_v)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_rope_qkv_backward"):
            return reference.rope_qkv_backward(d, cos, sin, heads, n_kv, need_q, need_k,
                                               need_v)
    B, T, _, H, hs = d.shape
    c, s = _tables(xp, cos, sin, compute_dtype(d.dtype))
    gq = xp.empty((B, T, H, hs), dtype=d.dtype) if need_q else None
    gk, gv = (xp.empty((B, T, n_kv, hs), dtype=d.dtype) if need else None
              for need in (need_k, need_v))
    n = B * T * (H + 2 * n_kv) * hs
    if n and (need_q or need_k or need_v):
        _kernel(xp, "mpishard_rope_qkv_backward", d.dtype)(
            *_launch(n), (d, c, s, d if gq is None else gq, d if gk is None else gk,
                          d if gv is None else gv, np.int64(n), np.int32(T), np.int32(H),
                          np.int32(n_kv), np.int32(hs), np.int32(groups[0]),
                          np.int32(groups[1]),
                          np.int32(need_q | (need_k << 1) | (need_v << 2))))
    return gq, gk, gv

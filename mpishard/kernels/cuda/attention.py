"""Fused causal attention on a GPU: the flash-style RawKernels of
:mod:`.attention_src`, launched (part of the GPU kernel set, :mod:`.ops`).

``flash_attention_forward(hm, scale)`` and ``flash_attention_backward(hm, y, gy, lse,
scale)`` take head-major q, k and v (``(3, B, heads, T, hs)``, C-contiguous, float16,
bfloat16, float32 or float64, a head size of at most :data:`MAX_HEAD_SIZE`) and keep no
``T x T`` array: forward returns the output and one float per query row. Other
inputs run the reference (:func:`.reference.flash_attention_forward`), which makes
the scores whole; on the CuPy-strict module the reference runs as the one launch per
kernel it is on a GPU (backward: two, the query rows' and the key rows').

float16 and bfloat16 rows at a head size that is a multiple of 16 run the tensor-core
kernels (:data:`.attention_tc_src.TC_FLASH_KERNELS`, blocks of 64 rows over four warps)
where they compile (their CUDA headers: :mod:`.headers`); other rows the kernels of a
thread per row. Both take the same arguments and keep the
same: the output and the rows' float log-sum-exp.
"""
from __future__ import annotations

import numpy as np

from mpishard.core.backend import xp_of
from mpishard.kernels import reference
from mpishard.kernels.cuda.attention_src import flash_source, flash_suffix, flash_tile
from mpishard.kernels.cuda.attention_tc_src import TC_ROWS, TC_WARPS, tensor_cores
from mpishard.kernels.cuda.headers import tensor_core_options
from mpishard.kernels.cuda.ops_src import STORAGE, compute_dtype, storage_dtypes
from mpishard.kernels.cuda.launch import is_strict_module, raw_function

__all__ = ["flash_attention_forward", "flash_attention_backward", "fused_attention_takes",
           "MAX_HEAD_SIZE"]

#: the largest head size the kernels take (the thread-a-row kernels keep rows in arrays
#: of the head size; every kernel's tiles must fit 48 KiB of static shared memory)
MAX_HEAD_SIZE = 128


def fused_attention_takes(hm) -> bool:
    """Whether the kernels take head-major ``hm`` (see the module docstring)."""
    return (hm.dtype.name in STORAGE and hm.flags.c_contiguous and hm.ndim == 5
            and 0 < hm.shape[-1] <= MAX_HEAD_SIZE
            and -(-hm.shape[-2] // flash_tile(storage_dtypes(hm.dtype)[0])) <= 65535)  # grid's y


def _tensor_cores(xp, S: str, hs: int):
    """The NVRTC options of the tensor-core kernels when rows stored as ``S`` at head
    size ``hs`` run them on ``xp`` (the shapes they take, and they compile there: see
    :mod:`.headers`), else None (the kernels of a thread per row)."""
    return tensor_core_options(xp) if tensor_cores(S, hs) else None


def _flash_kernel(xp, name: str, dtype, hs: int):
    """The compiled kernel ``name`` for rows of ``dtype`` and head size ``hs``."""
    T, S = storage_dtypes(dtype)
    options = _tensor_cores(xp, S, hs)
    return raw_function(xp, f"{name}_{flash_suffix(S, hs)}",
                        lambda: flash_source(T, S, hs, tensor_core_kernels=options is not None),
                        options or ())


def _launch(hm):
    """``(grid, block, BH, T, compute dtype)`` of the kernels for ``hm``: the tensor-core
    kernels' blocks of :data:`TC_ROWS` rows over :data:`TC_WARPS` warps for the rows they
    take, else a thread a row."""
    _, B, heads, T, hs = hm.shape
    ctype, fd = storage_dtypes(hm.dtype)[0], compute_dtype(hm.dtype)
    if _tensor_cores(xp_of(hm), STORAGE[hm.dtype.name], hs) is not None:
        return (B * heads, -(-T // TC_ROWS)), (TC_WARPS * 32,), B * heads, T, fd
    return (B * heads, -(-T // flash_tile(ctype))), (flash_tile(ctype),), B * heads, T, fd


def flash_attention_forward(hm, scale: float):
    xp = xp_of(hm)
    if not fused_attention_takes(hm):
        return reference.flash_attention_forward(hm, scale)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_flash_forward"):
            return reference.flash_attention_forward(hm, scale)
    grid, block, BH, T, fd = _launch(hm)
    y = xp.empty(hm.shape[1:], dtype=hm.dtype)
    lse = xp.empty(hm.shape[1:-1], dtype=fd)
    if BH and T:
        _flash_kernel(xp, "mpishard_flash_forward", hm.dtype, hm.shape[-1])(
            grid, block, (hm, y, lse, np.int32(BH), np.int32(T), fd.type(scale)))
    return y, lse


def flash_attention_backward(hm, y, gy, lse, scale: float):
    xp = xp_of(hm)
    ready = (fused_attention_takes(hm) and all(a.dtype == hm.dtype and a.flags.c_contiguous
                                               for a in (y, gy))
             and lse.flags.c_contiguous and lse.dtype == compute_dtype(hm.dtype))
    if not ready:
        return reference.flash_attention_backward(hm, y, gy, lse, scale)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_flash_dq"):       # the query rows' kernel, then the
            dh = reference.flash_attention_backward(hm, y, gy, lse, scale)
        with xp.syncs.fused("mpishard_flash_dkv"):      # key rows' (counted, no math)
            pass
        return dh
    grid, block, BH, T, fd = _launch(hm)
    dh = xp.empty(hm.shape, dtype=hm.dtype)
    dsum = xp.empty(lse.shape, dtype=fd)
    if BH and T:
        hs = hm.shape[-1]
        _flash_kernel(xp, "mpishard_flash_dq", hm.dtype, hs)(
            grid, block, (hm, y, gy, lse, dsum, dh, np.int32(BH), np.int32(T), fd.type(scale)))
        _flash_kernel(xp, "mpishard_flash_dkv", hm.dtype, hs)(
            grid, block, (hm, gy, lse, dsum, dh, np.int32(BH), np.int32(T), fd.type(scale)))
    return dh

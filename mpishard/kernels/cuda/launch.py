"""How the GPU kernel set compiles and launches its kernels: the compiled-kernel cache,
the RawKernels' block shapes and arguments, and the checks of which arrays the
RawKernels take. Each launcher (:mod:`.ops`, :mod:`.norms`, :mod:`.multi`,
:mod:`.attention`) builds its kernels here from the sources beside it."""
from __future__ import annotations

import numpy as np

__all__ = ["ROW_THREADS", "PARAM_ROW_THREADS", "is_strict_module", "elementwise_kernel",
           "reduction_kernel", "raw_function", "raw_kernels_take", "presence_flag",
           "dropout_arguments", "column_blocks"]

#: threads per block of the kernels that take a thread block per row
ROW_THREADS = 256
#: row threads per block of the column-sum kernels (32 columns each; at most 32)
PARAM_ROW_THREADS = 32
_compiled: dict = {}


def is_strict_module(xp) -> bool:
    """Whether ``xp`` is the CuPy-strict test module, on which each kernel runs the
    reference math inside ``xp.syncs.fused(name)``: one launch, as on a GPU."""
    return getattr(xp, "NAME", None) == "strict"


def elementwise_kernel(xp, name: str, sources: dict):
    """The ``cupy.ElementwiseKernel`` ``name`` of ``sources`` (name -> inputs, outputs,
    body), built once and kept (CuPy compiles it per dtype on first use)."""
    kernel = _compiled.get(name)
    if kernel is None:
        inputs, outputs, body = sources[name]
        kernel = _compiled[name] = xp.ElementwiseKernel(inputs, outputs, body, name)
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


def raw_function(xp, key: str, source):
    """The RawKernel ``key`` of the module ``source()`` builds, compiled once and kept."""
    kernel = _compiled.get(key)
    if kernel is None:
        kernel = _compiled[key] = xp.RawModule(code=source()).get_function(key)
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


def column_blocks(n: int) -> tuple:
    """Grid and block of the column-sum RawKernels: 32 columns per block."""
    return (-(-n // 32),), (32, PARAM_ROW_THREADS)

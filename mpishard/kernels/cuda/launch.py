"""How the GPU kernel set compiles and launches its kernels (see :mod:`.gpu`): the
compiled-kernel cache, the RawKernels' block shapes, and the checks of which arrays
the RawKernels take."""
from __future__ import annotations

import numpy as np

from mpishard.kernels.cuda.ops_src import REDUCTIONS, SOURCES, row_kernel_source

ROW_THREADS = 256
#: row threads per block of :func:`norm_param_grads` (32 columns each; at most 32)
PARAM_ROW_THREADS = 32
_compiled: dict = {}


def _is_strict(xp) -> bool:
    return getattr(xp, "NAME", None) == "strict"


def _kernel(xp, name: str):
    """The compiled kernel ``name`` (CuPy caches the binaries per dtype)."""
    kernel = _compiled.get(name)
    if kernel is None:
        if name in SOURCES:
            inputs, outputs, body = SOURCES[name]
            kernel = xp.ElementwiseKernel(inputs, outputs, body, name)
        else:
            inputs, outputs, mapped, reduce, post = REDUCTIONS[name]
            kernel = xp.ReductionKernel(inputs, outputs, mapped, reduce, post, "0", name)
        _compiled[name] = kernel
    return kernel


def _raw_function(xp, key: str, source):
    """The RawKernel ``key`` of the module ``source()`` builds, compiled once and kept."""
    kernel = _compiled.get(key)
    if kernel is None:
        kernel = _compiled[key] = xp.RawModule(code=source()).get_function(key)
    return kernel


def _row_kernel(xp, name: str, dtype, rows16: bool = False):
    """The RawKernel ``name`` of :data:`ROW_KERNELS` for ``dtype`` (float32 or float64;
    with ``rows16``, float32 with the norms' rows in float16)."""
    T = "float" if dtype == "float32" else "double"
    return _raw_function(xp, f"{name}_{T}_h" if rows16 else f"{name}_{T}",
                         lambda: row_kernel_source(T, "__half" if rows16 else None))


def _raw_ready(*arrays, drop_u=None) -> bool:
    """Whether the RawKernels take these arrays (None: absent): one dtype, float32 or
    float64, all C-contiguous; dropout draws ``drop_u`` float32 and C-contiguous."""
    present = [a for a in arrays if a is not None]
    dtype = present[0].dtype
    return (dtype.name in ("float32", "float64")
            and all(a.dtype == dtype and a.flags.c_contiguous for a in present)
            and (drop_u is None or (drop_u.dtype.name == "float32"
                                    and drop_u.flags.c_contiguous)))


def _flag(a) -> np.int32:
    return np.int32(a is not None)


def _dropout_args(drop_u, drop_p: float, stand_in, dtype) -> tuple:
    """The row kernels' dropout arguments: the flag, draws, p and 1 / (1 - p) in T (with
    no dropout: flag 0, ``stand_in`` for the draws)."""
    return (_flag(drop_u), stand_in if drop_u is None else drop_u, np.float32(drop_p),
            dtype.type(1.0 / (1.0 - drop_p)))


def _column_blocks(n: int) -> tuple:
    """Grid and block of the column-sum RawKernels: 32 columns per block."""
    return (-(-n // 32),), (32, PARAM_ROW_THREADS)

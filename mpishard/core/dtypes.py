"""Floating dtypes by name, including the two 16-bit ones mixed precision uses.

NumPy has ``float16`` but no ``bfloat16``; the ``ml_dtypes`` package (the one
JAX uses) adds it as a NumPy dtype. CuPy computes in ``float16`` natively; its
``bfloat16`` is experimental and refused here (see :func:`resolve_dtype`). Nothing here depends on MPI.

    >>> resolve_dtype("bfloat16").itemsize
    2
    >>> is_low_precision(np.dtype("float16"))
    True
"""
from __future__ import annotations

import numpy as np

__all__ = ["LOW_PRECISION", "FLOAT_DTYPES", "resolve_dtype", "is_low_precision",
           "matmul_dtype"]

#: 16-bit floating dtypes: stored and communicated in 16 bits, accumulated in float32.
LOW_PRECISION = ("float16", "bfloat16")
#: Every floating dtype name mpishard accepts for parameters or compute.
FLOAT_DTYPES = ("float64", "float32") + LOW_PRECISION


def resolve_dtype(name, xp=np) -> np.dtype:
    """The NumPy dtype object for ``name`` (``"float32"``, ``"bfloat16"``, a dtype, ...).

    Raises:
        ValueError: an unknown name, or ``bfloat16`` without ``ml_dtypes``
            installed (the message names the fix), or ``bfloat16`` on CuPy.
    """
    if isinstance(name, np.dtype):
        name = name.name
    elif not isinstance(name, str):
        name = np.dtype(name).name
    if name not in FLOAT_DTYPES:
        raise ValueError(f"unknown floating dtype {name!r}; use one of {', '.join(FLOAT_DTYPES)}")
    if name != "bfloat16":
        return np.dtype(name)
    if xp is not np:
        raise ValueError("bfloat16 on CuPy: CuPy's bfloat16 support is experimental and "
                         "lacks what mpishard needs (batched bfloat16 matrix products, "
                         "cupyx.scatter_add; see docs/gpu.md); use precision 'float16' "
                         "(with loss scaling) on CuPy, or bfloat16 on NumPy")
    try:
        import ml_dtypes  # noqa: PLC0415 (optional dependency)
    except ImportError:
        raise ValueError("bfloat16 needs the ml_dtypes package (NumPy has no bfloat16): "
                         "pip install ml_dtypes, or use precision 'float16'") from None
    return np.dtype(ml_dtypes.bfloat16)


def is_low_precision(dtype) -> bool:
    """Whether ``dtype`` is a 16-bit float (``float16`` or ``bfloat16``)."""
    if isinstance(dtype, np.dtype):         # the hot path: dtype.name builds a string
        return dtype.itemsize == 2 and dtype.name in LOW_PRECISION
    return getattr(dtype, "name", str(dtype)) in LOW_PRECISION


def matmul_dtype(array) -> np.dtype:
    """The dtype a matrix product of ``array`` runs in.

    16-bit inputs are multiplied in float32 on NumPy (it has no 16-bit BLAS:
    a float16 matmul ran 10x slower than casting to float32 and back) and
    natively on CuPy, whose cuBLAS float16 products accumulate in float32.
    Anything else runs in its own dtype.
    """
    dtype = array.dtype
    if is_low_precision(dtype) and isinstance(array, np.ndarray):
        return np.dtype(np.float32)
    return dtype

"""Floating dtypes by name, including the two 16-bit ones mixed precision uses.

NumPy has ``float16`` but no ``bfloat16``; the ``ml_dtypes`` package (the one
JAX uses) adds it as a NumPy dtype. Nothing here depends on MPI.

[Note: bfloat16 on devices]
A bfloat16 array is an array of dtype ``ml_dtypes.bfloat16`` on every array
module: NumPy, the CuPy-strict test module, and CuPy 14 or later, which takes
that dtype ("minimal support for bfloat16 via ml_dtypes"); an older CuPy is
refused by :func:`resolve_dtype` with the fix. So the dtype travels with the
data (``a.dtype.name == "bfloat16"``) and no code keeps it on the side. In
memory an element is a 16-bit word, the top half of a float32. mpishard's
kernels read and write those words and compute in float32: RawKernels take
``__nv_bfloat16`` pointers (``cuda_bf16.h``), ElementwiseKernels take the words
(:func:`bfloat16_words`) and convert them, so they depend on no CuPy type name.
What CuPy 14 lacks for bfloat16 runs elsewhere: batched matrix products go to
cuBLAS with ``CUDA_R_16BF`` inputs and float32 compute
(mpishard/kernels/cuda/gemm.py), ``cupyx.scatter_add`` (no bfloat16) is fed
float32, MPI (no bfloat16 datatype) moves the words and reduces in float32,
NCCL reduces ``ncclBfloat16`` itself. Two CuPy 14 results differ from NumPy's
(seen on an H100): ``where`` has no bfloat16 loop, so bfloat16 choices come out
float32 (:func:`where_kept` picks their words instead), and a Python float meets a
bfloat16 array as a float16, so ``a * 0.5`` is float32 (a scalar of the array's
dtype, ``a.dtype.type(0.5)``, keeps bfloat16: :func:`weak_scalar`). The CuPy-strict
module types both as CuPy does, so the CPU suite catches them.

    >>> resolve_dtype("bfloat16").itemsize
    2
    >>> is_low_precision(np.dtype("float16"))
    True
"""
from __future__ import annotations

import numpy as np

__all__ = ["LOW_PRECISION", "FLOAT_DTYPES", "resolve_dtype", "is_low_precision",
           "matmul_dtype", "bfloat16_words", "where_kept", "weak_scalar"]

#: 16-bit floating dtypes: stored and communicated in 16 bits, accumulated in float32.
LOW_PRECISION = ("float16", "bfloat16")
#: Every floating dtype name mpishard accepts for parameters or compute.
FLOAT_DTYPES = ("float64", "float32") + LOW_PRECISION


def resolve_dtype(name, xp=np) -> np.dtype:
    """The NumPy dtype object for ``name`` (``"float32"``, ``"bfloat16"``, a dtype, ...).

    ``xp`` is the array module the dtype is for: bfloat16 is ``ml_dtypes.bfloat16``
    on every module that takes it (see [Note: bfloat16 on devices]).

    Raises:
        ValueError: an unknown name, or ``bfloat16`` without ``ml_dtypes``
            installed, or on a CuPy older than 14 (each message names the fix).
    """
    if isinstance(name, np.dtype):
        name = name.name
    elif not isinstance(name, str):
        name = np.dtype(name).name
    if name not in FLOAT_DTYPES:
        raise ValueError(f"unknown floating dtype {name!r}; use one of {', '.join(FLOAT_DTYPES)}")
    if name != "bfloat16":
        return np.dtype(name)
    bfloat16 = _bfloat16()
    if xp is not np and not _takes_bfloat16(xp, bfloat16):
        module = getattr(xp, "__name__", type(xp).__name__)
        raise ValueError(f"bfloat16 on {module} {getattr(xp, '__version__', '')}: this "
                         f"array module has no bfloat16 arrays; install CuPy 14 or later "
                         f"(pip install 'cupy-cuda12x>=14' ml_dtypes), or use precision "
                         f"'float16'")
    return bfloat16


def _bfloat16() -> np.dtype:
    try:
        import ml_dtypes  # noqa: PLC0415 (optional dependency)
    except ImportError:
        raise ValueError("bfloat16 needs the ml_dtypes package (NumPy has no bfloat16): "
                         "pip install ml_dtypes, or use precision 'float16'") from None
    return np.dtype(ml_dtypes.bfloat16)


def _takes_bfloat16(xp, bfloat16) -> bool:
    """Whether array module ``xp`` makes arrays of ``bfloat16`` (CuPy from 14 on; the
    strict module always)."""
    try:
        return xp.empty(1, dtype=bfloat16).dtype == bfloat16
    except (AttributeError, TypeError, ValueError, KeyError, NotImplementedError):
        return False                    # CuPy 13: an unknown dtype


def bfloat16_words(a):
    """The 16-bit words of bfloat16 array ``a`` (a view, as ``uint16``), as kernels that
    convert them themselves take them (see [Note: bfloat16 on devices])."""
    return a.view(np.uint16)


def weak_scalar(value, like):
    """Python float ``value`` as it meets array ``like`` in NumPy (NEP 50: in ``like``'s
    dtype): for a bfloat16 ``like``, a bfloat16 scalar, which CuPy 14 also keeps
    bfloat16 (it takes a bare Python float as float16 and computes in float32; see
    [Note: bfloat16 on devices]); anything else as it is."""
    if isinstance(value, float) and like.dtype.name == "bfloat16":
        return like.dtype.type(value)
    return value


def where_kept(xp, condition, x, y):
    """``xp.where(condition, x, y)`` typed as NumPy types it, on every array module:
    bfloat16 choices (arrays, or a bfloat16 array and a scalar) stay bfloat16. CuPy
    14's ``where`` makes them float32 (see [Note: bfloat16 on devices]); their 16-bit
    words are picked instead, which is exact."""
    bf16 = [getattr(v, "dtype", None) is not None and v.dtype.name == "bfloat16"
            for v in (x, y)]
    if not any(bf16) or not all(b or type(v) in (int, float, bool) for v, b in zip((x, y), bf16)):
        return xp.where(condition, x, y)       # not bfloat16 choices: NumPy's types
    dtype = (x if bf16[0] else y).dtype
    x, y = (v.view(np.uint16) if b else np.asarray(v, dtype=dtype).view(np.uint16)[()]
            for v, b in zip((x, y), bf16))     # a Python number's word
    return xp.where(condition, x, y).view(dtype)


#: the 16-bit float dtype objects (bfloat16's where ml_dtypes is installed), filled on
#: first use by :func:`is_low_precision`
_LOW_DTYPES: frozenset = frozenset()


def is_low_precision(dtype) -> bool:
    """Whether ``dtype`` is a 16-bit float (``float16`` or ``bfloat16``)."""
    if isinstance(dtype, np.dtype):         # the hot path (every op asks): a set lookup,
        if dtype in _LOW_DTYPES:            # where dtype.name builds a string (2 us for
            return True                     # float16)
        if dtype.itemsize != 2:
            return False
        if dtype.name in LOW_PRECISION:     # the first 16-bit float seen: remember it
            _remember_low(dtype)
            return True
        return False
    return getattr(dtype, "name", str(dtype)) in LOW_PRECISION


def _remember_low(dtype: np.dtype) -> None:
    global _LOW_DTYPES
    _LOW_DTYPES = _LOW_DTYPES | {dtype}


def matmul_dtype(array) -> np.dtype:
    """The dtype a matrix product of ``array`` runs in.

    16-bit inputs are multiplied in float32 on NumPy (it has no 16-bit BLAS:
    a float16 matmul ran 10x slower than casting to float32 and back) and
    natively on CuPy, whose cuBLAS float16 and bfloat16 products accumulate in float32.
    Anything else runs in its own dtype.
    """
    dtype = array.dtype
    if is_low_precision(dtype) and isinstance(array, np.ndarray):
        return np.dtype(np.float32)
    return dtype

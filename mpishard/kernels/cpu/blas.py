"""The CPU's 2-D matrix products: NumPy's BLAS, or Intel's MKL where asked for.

    from mpishard.kernels.cpu.blas import matmul
    matmul(x, w.T, out=y)                 # y = x @ w.T, the transpose a BLAS flag

NumPy's wheels link OpenBLAS. Measured side by side on a 2-core Intel Xeon
(AVX-512), one thread, the four products of GPT config S's layers (2,048 rows,
widths 256 to 1,024), forward and both gradients: OpenBLAS 93.3 ms, MKL (called
here) 80.5 ms, PyTorch (MKL inside) 80.9 ms. Those products are most of a CPU
training step, so the BLAS decides much of mpishard's speed against torch.

``MPISHARD_BLAS`` picks the library:

* ``numpy`` (the default): ``numpy.matmul``, whatever BLAS NumPy was built with;
* ``mkl``: ``cblas_sgemm`` / ``cblas_dgemm`` of MKL's single dynamic library
  (``libmkl_rt``; ``pip install mkl`` puts it in the environment's ``lib/``;
  ``MPISHARD_MKL_LIB`` names another file), called through ``ctypes`` (which
  lets go of the interpreter lock during the call). MKL runs sequentially
  when ``MKL_NUM_THREADS`` (else ``OMP_NUM_THREADS``) is 1, as multi-rank runs set
  it, else on its OpenMP threads (``libiomp5``, from the ``intel-openmp`` wheel
  ``mkl`` depends on; ``KMP_BLOCKTIME`` defaults to 0 then, so that MKL's idle
  threads do not spin against NumPy's). On 2 cores with 2 threads, MKL with
  ``OPENBLAS_NUM_THREADS=1`` measured no faster than NumPy's BLAS on 2 threads
  (GPT config S: 0.489 s a step against 0.480; Llama 0.486 against 0.383; without
  ``KMP_BLOCKTIME=0`` and with OpenBLAS's threads too, 0.9-1.2 s); with one thread
  per rank, as multi-rank runs have, 0.99x (GPT) and 0.90x (Llama) NumPy's step
  time, within the machine's noise (docs/performance.md).

Products MKL's row-major interface cannot take as they are (operands that are
neither rows nor transposed rows with unit stride, other dtypes, empty ones)
go to ``numpy.matmul``. MKL sums in another order than OpenBLAS, so results
differ in the last bits between the two settings (never between ranks or
layouts of one run: every rank reads the same setting).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

import numpy as np

from mpishard.kernels.choice import env_choice

__all__ = ["matmul", "blas_choice", "describe", "mkl_library"]

_CHOICES = ("numpy", "mkl")
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_MKL_THREADING_INTEL, _MKL_THREADING_SEQUENTIAL = 0, 1
_state: dict = {}          # "lib": the loaded CDLL, "path": its file, per process


def blas_choice() -> str:
    """``MPISHARD_BLAS``: ``"numpy"`` (the default) or ``"mkl"``."""
    return env_choice("MPISHARD_BLAS", _CHOICES, "'mkl' needs `pip install mkl`")


def _candidates() -> list:
    named = os.environ.get("MPISHARD_MKL_LIB")
    if named:
        return [named]
    found = []
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        for version in ("3", "2", ""):
            path = Path(prefix) / "lib" / f"libmkl_rt.so{'.' + version if version else ''}"
            if path.exists():
                found.append(str(path))
    system = ctypes.util.find_library("mkl_rt")
    return found + ([system] if system else [])


def mkl_library():
    """The loaded MKL (a ``ctypes.CDLL``), loading it on first use; raises with the
    fix when it is not found."""
    lib = _state.get("lib")
    if lib is not None:
        return lib
    errors = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError as exc:
            errors.append(f"{path}: {exc}")
    if lib is None:
        tried = "; ".join(errors) or f"no libmkl_rt.so under {sys.prefix}/lib"
        raise RuntimeError(f"MPISHARD_BLAS=mkl, but MKL did not load ({tried}): run "
                           f"`pip install mkl` in this environment, set MPISHARD_MKL_LIB "
                           f"to its libmkl_rt.so, or unset MPISHARD_BLAS")
    threads = os.environ.get("MKL_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or ""
    layer = _MKL_THREADING_SEQUENTIAL if threads.strip() == "1" else _MKL_THREADING_INTEL
    if layer == _MKL_THREADING_INTEL:   # idle OpenMP threads yield the cores at once
        os.environ.setdefault("KMP_BLOCKTIME", "0")        # (see the module docstring)
    lib.MKL_Set_Threading_Layer.argtypes = [ctypes.c_int]
    lib.MKL_Set_Threading_Layer(layer)              # before any other MKL call
    scalar = {np.float32: ctypes.c_float, np.float64: ctypes.c_double}
    for name, dtype in (("cblas_sgemm", np.float32), ("cblas_dgemm", np.float64)):
        fn = getattr(lib, name)
        fn.argtypes = ([ctypes.c_int] * 6 + [scalar[dtype], ctypes.c_void_p, ctypes.c_int,
                                            ctypes.c_void_p, ctypes.c_int, scalar[dtype],
                                            ctypes.c_void_p, ctypes.c_int])
        fn.restype = None
    _state.update(lib=lib, path=path,
                  threads="sequential" if layer == _MKL_THREADING_SEQUENTIAL else "OpenMP")
    return lib


def describe() -> str:
    """One line for ``mpishard info``: which BLAS the CPU's products use."""
    try:
        if blas_choice() == "numpy":
            return "NumPy's (MPISHARD_BLAS=numpy; MPISHARD_BLAS=mkl for MKL)"
        mkl_library()
    except (RuntimeError, ValueError) as exc:
        return f"unusable: {exc}"
    return f"MKL ({_state['path']}, {_state['threads']}; MPISHARD_BLAS=mkl)"


def _rows(x, item: int):
    """``(transposed, leading dimension)`` under which row-major BLAS reads the 2-D
    ``x``, or None: rows with unit stride, or the transpose of such rows."""
    r, c = x.shape
    s0, s1 = x.strides
    if s0 % item or s1 % item:
        return None
    s0, s1 = s0 // item, s1 // item
    if (s1 == 1 or c == 1) and (r == 1 or s0 >= c):
        return False, max(s0 if r > 1 else c, c, 1)
    if (s0 == 1 or r == 1) and (c == 1 or s1 >= r):
        return True, max(s1 if c > 1 else r, r, 1)
    return None


def _mkl_gemm(a, b, out) -> bool:
    """``out = a @ b`` through MKL when it takes these arrays; whether it did."""
    dtype = a.dtype
    if (dtype not in (np.float32, np.float64) or b.dtype != dtype or out.dtype != dtype
            or a.ndim != 2 or b.ndim != 2 or out.ndim != 2 or 0 in a.shape + b.shape
            or max(a.shape + b.shape) >= 2 ** 31 or np.may_share_memory(out, a)
            or np.may_share_memory(out, b)):
        return False
    item = dtype.itemsize
    ra, rb, rc = _rows(a, item), _rows(b, item), _rows(out, item)
    if ra is None or rb is None or rc is None or rc[0]:
        return False
    (m, k), n = a.shape, b.shape[1]
    lib = mkl_library()
    fn = lib.cblas_sgemm if dtype == np.float32 else lib.cblas_dgemm
    fn(_ROW_MAJOR, _TRANS if ra[0] else _NO_TRANS, _TRANS if rb[0] else _NO_TRANS, m, n, k,
       1.0, a.ctypes.data, ra[1], b.ctypes.data, rb[1], 0.0, out.ctypes.data, rc[1])
    return True


def matmul(a, b, out=None):
    """``a @ b`` for NumPy arrays (into ``out`` if given): 2-D products through the BLAS
    ``MPISHARD_BLAS`` picks, everything else through ``numpy.matmul``."""
    if blas_choice() == "mkl" and a.ndim == 2 and b.ndim == 2:
        if out is None:
            out = np.empty((a.shape[0], b.shape[1]), dtype=np.result_type(a, b))
        if out.shape == (a.shape[0], b.shape[1]) and _mkl_gemm(a, b, out):
            return out
    return np.matmul(a, b, out=out)

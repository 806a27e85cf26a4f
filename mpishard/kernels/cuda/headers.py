"""Where NVRTC finds the CUDA headers the tensor-core kernels include.

``<mma.h>`` (the ``nvcuda::wmma`` fragments of :mod:`.attention_tc_src`) includes
``"crt/mma.h"``. A CUDA toolkit has both; CUDA 13's pip wheels, which CuPy compiles
against when there is no toolkit, put ``mma.h`` in ``nvidia-cuda-runtime`` and the
``crt/`` headers in a wheel of their own, ``nvidia-cuda-crt``, that CuPy does not
require. Without it NVRTC stops with "cannot open source file crt/mma.h".

:func:`crt_directory` looks for a ``crt/mma.h`` where CUDA headers live (``CUDA_PATH``,
``CUDA_HOME``, the ``nvcc`` on the path, ``/usr/local/cuda``, and the ``nvidia`` wheels
on ``sys.path``); :func:`header_options` gives a module that includes ``<mma.h>`` an
include folder holding only that ``crt`` (a link to it), so every other header still
comes from where CuPy takes it. Where no ``crt/mma.h`` is found,
:func:`tensor_core_headers` says so once and the attention kernels of a thread per
row run instead (:mod:`.attention`).
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import tempfile
import warnings

__all__ = ["crt_directory", "header_options", "tensor_core_headers", "CRT_FIX"]

#: what a user does when no ``crt/mma.h`` is found
CRT_FIX = ("pip install nvidia-cuda-crt (the version of your CUDA 13 runtime wheels), "
           "or set CUDA_PATH to a CUDA toolkit")


def _candidates() -> list:
    """The include folders that may hold ``crt/mma.h``, most explicit first."""
    found = [os.path.join(os.environ[v], "include") for v in ("CUDA_PATH", "CUDA_HOME")
             if os.environ.get(v)]
    nvcc = shutil.which("nvcc")
    if nvcc:
        found.append(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
                                  "include"))
    found.append("/usr/local/cuda/include")
    for entry in sys.path:
        for wheel in ("cu13", "cuda_runtime", "cuda_nvcc", "cuda_crt"):
            found.append(os.path.join(entry or ".", "nvidia", wheel, "include"))
    return found


@functools.lru_cache(maxsize=None)
def crt_directory():
    """The first ``crt`` folder holding ``mma.h`` among :func:`_candidates`, or None."""
    for include in _candidates():
        crt = os.path.join(include, "crt")
        if os.path.isfile(os.path.join(crt, "mma.h")):
            return os.path.realpath(crt)
    return None


@functools.lru_cache(maxsize=None)
def _crt_only_include(crt: str) -> str:
    """A folder holding one entry, ``crt``, a link to ``crt``: its path stays the same
    from process to process (so CuPy's cache of compiled modules, keyed by the options,
    keeps hitting)."""
    tag = hashlib.sha1(crt.encode()).hexdigest()[:12]
    folder = os.path.join(tempfile.gettempdir(), f"mpishard-cuda-crt-{os.getuid()}", tag)
    link = os.path.join(folder, "crt")
    if not os.path.isdir(link):
        os.makedirs(folder, exist_ok=True)
        try:
            os.symlink(crt, link)
        except FileExistsError:         # another rank made it first
            pass
    return folder


def header_options(code: str) -> tuple:
    """NVRTC options ``code`` needs beyond CuPy's own: for ``<mma.h>``, the folder of
    :func:`_crt_only_include` when a ``crt/mma.h`` was found (else none: the compile
    then fails as it would have, naming the header)."""
    if "<mma.h>" not in code or crt_directory() is None:
        return ()
    return (f"-I{_crt_only_include(crt_directory())}",)


@functools.lru_cache(maxsize=None)
def tensor_core_headers() -> bool:
    """Whether the tensor-core kernels can compile here (a ``crt/mma.h`` was found);
    the first call that finds none warns once, naming the fix."""
    if crt_directory() is not None:
        return True
    warnings.warn("fused attention: no CUDA header crt/mma.h was found, so the "
                  "tensor-core kernels are off and 16-bit attention runs the slower kernels "
                  f"of a thread per row; to turn them on: {CRT_FIX}", RuntimeWarning,
                  stacklevel=3)
    return False

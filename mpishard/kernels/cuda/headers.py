"""Whether, and with which NVRTC options, the tensor-core kernels compile here.

``<mma.h>`` (the ``nvcuda::wmma`` fragments of :mod:`.attention_tc_src`) includes
``"crt/mma.h"``. A CUDA toolkit has both; CUDA 13's pip wheels, which CuPy compiles
against when there is no toolkit, put ``mma.h`` in ``nvidia-cuda-runtime`` and the
``crt/`` headers in a wheel of their own, ``nvidia-cuda-crt``, that CuPy does not
require. Without it NVRTC stops with "cannot open source file crt/mma.h" (seen on an
H100 with CuPy 14.2).

:func:`tensor_core_options` decides once per process, by compiling a module that
includes ``<mma.h>``: as CuPy compiles it (no options); else with an include folder
holding only a link to the first ``crt`` with an ``mma.h`` that :func:`crt_directory`
finds (``CUDA_PATH``, ``CUDA_HOME``, the ``nvidia`` wheels on ``sys.path``, the
``nvcc`` on the path, ``/usr/local/cuda``), so every other header still comes from
where CuPy takes it; else not at all, and the attention kernels of a thread per row
run instead (:mod:`.attention`), after one warning that names the fix.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import warnings

__all__ = ["crt_directory", "crt_only_include", "tensor_core_options", "describe", "CRT_FIX"]

#: what a user does when the tensor-core kernels do not compile for want of crt/mma.h
CRT_FIX = ("pip install nvidia-cuda-crt (the version of your CUDA 13 runtime wheels), "
           "or set CUDA_PATH to a CUDA toolkit")
_PROBE = '#include <mma.h>\nextern "C" __global__ void mpishard_mma_probe() {}\n'


def _candidates() -> list:
    """The include folders that may hold ``crt/mma.h``, the user's choice first, then
    the wheels CuPy may be compiling against, then a toolkit's usual places."""
    found = [os.path.join(os.environ[v], "include") for v in ("CUDA_PATH", "CUDA_HOME")
             if os.environ.get(v)]
    for entry in sys.path:
        for wheel in ("cu13", "cuda_runtime", "cuda_nvcc", "cuda_crt"):
            found.append(os.path.join(entry or ".", "nvidia", wheel, "include"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        found.append(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
                                  "include"))
    found.append("/usr/local/cuda/include")
    return found


@functools.lru_cache(maxsize=None)
def crt_directory():
    """The first ``crt`` folder holding ``mma.h`` among :func:`_candidates`, or None."""
    for include in _candidates():
        crt = os.path.join(include, "crt")
        if os.path.isfile(os.path.join(crt, "mma.h")):
            return os.path.realpath(crt)
    return None


def _link_root() -> str:
    """Where the include folders live: beside CuPy's kernel cache (a folder of the
    user's own, kept between jobs, so the options, and with them CuPy's cache keys,
    stay the same from run to run)."""
    cache = os.environ.get("CUPY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cupy",
                                                             "kernel_cache")
    return os.path.join(cache, "mpishard-crt")


def crt_only_include(crt: str) -> str:
    """A folder holding one entry, ``crt``, a link to ``crt`` (made if missing or
    pointing elsewhere; ranks making it at once all end with the same link)."""
    folder = os.path.join(_link_root(), hashlib.sha1(crt.encode()).hexdigest()[:12])
    link = os.path.join(folder, "crt")
    if os.path.islink(link) and os.readlink(link) == crt:
        return folder
    os.makedirs(folder, exist_ok=True)
    staged = f"{link}.{os.getpid()}"
    os.symlink(crt, staged)
    os.replace(staged, link)            # atomic: another rank's identical link is replaced
    return folder


def _compiles(xp, options: tuple) -> bool:
    try:
        xp.RawModule(code=_PROBE, options=options).get_function("mpishard_mma_probe")
    except Exception:  # noqa: BLE001 (NVRTC's CompileException, or no such header)
        return False
    return True


@functools.lru_cache(maxsize=None)
def tensor_core_options(xp):
    """The NVRTC options the tensor-core kernels compile with on ``xp`` (CuPy): ``()``
    when CuPy's own headers do, the crt folder's when that is what they lack; None
    when neither compiles, after one ``RuntimeWarning`` naming the fix."""
    if _compiles(xp, ()):
        return ()
    crt = crt_directory()
    if crt is not None:
        try:
            options = (f"-I{crt_only_include(crt)}",)
        except OSError as err:          # a folder we may not write: say so below
            crt = f"{crt} (its include folder could not be made: {err})"
        else:
            if _compiles(xp, options):
                return options
    found = f"found {crt}, which did not compile" if crt else "found none"
    warnings.warn("fused attention: the tensor-core kernels do not compile here "
                  f"(<mma.h> needs crt/mma.h; {found}), so 16-bit attention runs the "
                  f"slower kernels of a thread per row; to turn them on: {CRT_FIX}",
                  RuntimeWarning, stacklevel=2)
    return None


def describe(xp) -> str:
    """One line for ``mpishard info``: whether 16-bit fused attention runs on tensor
    cores on ``xp`` (CuPy), and with which include folder."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)    # the line says it instead
        options = tensor_core_options(xp)
    if options is None:
        return f"off: <mma.h> does not compile (needs crt/mma.h; {CRT_FIX})"
    return "on" + (f" (crt/ from {crt_directory()})" if options else "")

"""Device (CuPy) buffers and MPI: stream synchronisation, CUDA-aware detection,
and pinned host staging (what each rank runs on is reported by :mod:`.launch`).

Nothing here imports CuPy at module level; NumPy-only runs never touch it.

[Note: device buffers]
MPI knows nothing about CUDA streams. Before any MPI call reads or writes a
CuPy array, the kernels that produce (or still read) it must have finished, so
:meth:`DevicePath.for_mpi` -- the one place this happens -- synchronises the
current CuPy stream. Then one of two things:

* **CUDA-aware MPI** (``MPIX_Query_cuda_support() == 1`` in the libmpi that
  mpi4py loaded, a vendor hint, or ``MPISHARD_CUDA_AWARE=1``): the device array
  goes to mpi4py as is (it reads ``__cuda_array_interface__``);
* **otherwise** the array is copied into a pinned host buffer
  (``cupyx.empty_pinned``, served by CuPy's pinned memory pool), MPI runs on
  that, and outputs are copied back to the device before the call returns (or,
  for non-blocking calls, in ``Handle.wait``).

Open MPI runs every non-blocking collective (``iall_reduce``,
``ireduce_scatter``, ``iall_gather``, ``ibroadcast``, ``iall_to_all``) in
libnbc, which reads and writes the buffers as host memory even in a CUDA build
(it crashes on device pointers), so on Open MPI those stage anyway; its
point-to-point calls take device buffers. And Open MPI's
``OMPI_MCA_opal_cuda_support=true`` is a request that a build without CUDA
ignores, so it is not taken as a hint: on Open MPI only
``MPIX_Query_cuda_support() == 1`` (or ``MPISHARD_CUDA_AWARE=1``) makes MPI
CUDA-aware. The NCCL backend (:mod:`mpishard.comm.backends.nccl`) bypasses all of this
for its collectives.
"""
from __future__ import annotations

import ctypes
import os

from mpi4py import MPI

from mpishard.core.backend import cupy_or_none, xp_of

__all__ = [
    "DevicePath",
    "mpi_vendor",
    "loaded_libmpi",
    "query_cuda_support",
    "detect_cuda_aware",
    "nccl_available",
]

#: Environment variables that vendors use to switch GPU support on, checked
#: only when the library has no ``MPIX_Query_cuda_support``.
_VENDOR_HINTS = (
    ("MPICH_GPU_SUPPORT_ENABLED", "1", "Cray MPICH"),
    ("MV2_USE_CUDA", "1", "MVAPICH2-GDR"),
    ("I_MPI_OFFLOAD", "1", "Intel MPI"),
)
#: Set to ask for CUDA support, but a build without it ignores the setting: not a hint.
_UNTRUSTED_HINTS = (("OMPI_MCA_opal_cuda_support", "true", "Open MPI"),)


def mpi_vendor() -> str:
    """The MPI library's vendor name (``MPI.get_vendor()[0]``: ``"Open MPI"``, ``"MPICH"``)."""
    return MPI.get_vendor()[0]


class DevicePath:
    """How device arrays reach MPI on one communicator (see [Note: device buffers]).

    Args:
        cuda_aware: whether the MPI library reads device memory.
        how: how ``cuda_aware`` was decided, for reports.
        stage_nonblocking: stage non-blocking collectives even when CUDA-aware
            (true on Open MPI, whose libnbc treats buffers as host memory).
    """

    def __init__(self, cuda_aware: bool, how: str, stage_nonblocking: bool = False):
        self.cuda_aware = cuda_aware
        self.how = how
        self.stage_nonblocking = stage_nonblocking

    def for_mpi(self, a, *, copy_in: bool, copy_out: bool, nonblocking: bool = False):
        """Return ``(buffer for mpi4py, copy_back or None)`` for device array ``a``.

        Args:
            a: a C-contiguous CuPy array.
            copy_in: MPI reads ``a`` (its values must reach the staging buffer).
            copy_out: MPI writes ``a`` (``copy_back()`` moves them to ``a``).
            nonblocking: the call is a non-blocking collective (``iall_reduce``,
                ``ireduce_scatter``, ``iall_gather``, ``ibroadcast``,
                ``iall_to_all``; not ``isend``/``irecv``).
        """
        stage = getattr(xp_of(a), "stage_for_mpi", None)
        if stage is not None:   # mpishard.testing.strict (tests): host memory under CuPy's rules
            return stage(a, copy_in=copy_in, copy_out=copy_out)
        import cupy  # noqa: PLC0415 (a device array exists, so CuPy imports)

        stream = cupy.cuda.get_current_stream()
        stream.synchronize()
        direct = self.cuda_aware and not (nonblocking and self.stage_nonblocking)
        if direct:
            return a, None
        import cupyx  # noqa: PLC0415

        host = cupyx.empty_pinned(a.shape, a.dtype)
        if copy_in:
            a.get(stream=stream, out=host)
            stream.synchronize()
        if not copy_out:
            return host, None

        def copy_back():
            a.set(host, stream=stream)
            stream.synchronize()  # the pinned block returns to the pool after this
        return host, copy_back


def loaded_libmpi() -> str | None:
    """Path of the MPI library mpi4py loaded (as ``python -m mpi4py --mpi-library``)."""

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    try:
        dladdr = ctypes.CDLL(None).dladdr
        dladdr.restype = ctypes.c_int
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
        symbol = ctypes.CDLL(MPI.__file__).MPI_Init
        info = DlInfo()
        if not dladdr(ctypes.cast(symbol, ctypes.c_void_p), ctypes.byref(info)):
            return None
        return os.fsdecode(info.dli_fname)
    except (OSError, AttributeError):
        return None


def query_cuda_support(libmpi: str) -> int | None:
    """Call ``MPIX_Query_cuda_support()`` in an already loaded ``libmpi``.

    mpi4py loads libmpi with ``RTLD_LOCAL``, so its symbols are not global;
    opening the same file with ``RTLD_NOLOAD`` returns that very library (and
    fails rather than load a second copy).

    Returns:
        The function's answer (1: CUDA-aware, 0: not), or ``None`` when the
        library is not loaded or has no such function.
    """
    try:
        lib = ctypes.CDLL(libmpi, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        query = lib.MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    query.restype = ctypes.c_int
    query.argtypes = []
    return int(query())


def detect_cuda_aware(override: bool | None = None,
                      override_source: str = "the cuda_aware argument",
                      environ=None) -> tuple[bool, str]:
    """Decide whether MPI can take device buffers; return ``(answer, how)``.

    Order: an explicit ``override``; ``MPIX_Query_cuda_support()`` in the
    loaded libmpi; a vendor's GPU-support environment variable (Cray MPICH,
    MVAPICH2-GDR, Intel MPI; not Open MPI's ``OMPI_MCA_opal_cuda_support``,
    which a build without CUDA ignores); otherwise not CUDA-aware.

    Args:
        override: ``True``/``False`` to skip detection.
        override_source: named in ``how`` (``"MPISHARD_CUDA_AWARE=1"``).
        environ: where vendor hints are read (default ``os.environ``).
    """
    if override is not None:
        return bool(override), f"set by {override_source}"
    libmpi = loaded_libmpi()
    answer = query_cuda_support(libmpi) if libmpi else None
    if answer is not None:
        return answer == 1, f"MPIX_Query_cuda_support() = {answer} in {libmpi}"
    environ = os.environ if environ is None else environ
    for var, value, vendor in _VENDOR_HINTS:
        if environ.get(var, "").lower() == value:
            return True, (f"{var}={environ[var]} ({vendor} GPU support); no "
                          f"MPIX_Query_cuda_support in {libmpi}")
    ignored = "".join(
        f"; {var}={environ[var]} is set, but {vendor} builds without CUDA ignore it, "
        f"so it proves nothing" for var, value, vendor in _UNTRUSTED_HINTS
        if environ.get(var, "").lower() == value)
    return False, (f"no MPIX_Query_cuda_support in {libmpi or 'the loaded MPI library'} "
                   f"and no vendor hint{ignored}; assuming not CUDA-aware, device "
                   f"buffers are staged (set MPISHARD_CUDA_AWARE=1 if it is)")


def nccl_available() -> tuple[bool, str]:
    """Whether CuPy's NCCL binding loads; return ``(answer, why)``."""
    cupy = cupy_or_none()
    if cupy is None:
        return False, "CuPy is not importable"
    try:
        from cupy.cuda import nccl  # noqa: PLC0415

        if not getattr(nccl, "available", True):
            return False, ("CuPy found no NCCL library (cupy.cuda.nccl.available is False: "
                           "libnccl.so.2 did not load; pip install nvidia-nccl-cu12 or "
                           "-cu13 to match CuPy, or use comm_backend='mpi')")
        return True, f"NCCL {nccl.get_version()}"
    except Exception as exc:  # ImportError, or libnccl missing at load time
        return False, f"cupy.cuda.nccl does not load: {exc}"

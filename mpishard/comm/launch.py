"""Launch facts: where each rank runs (node-local rank, host, MPI library, device).

    mpiexec -n 4 python -m mpi4py -m mpishard info     # prints format_rank_reports(...)

Collective helpers for entry points; nothing here moves array data.
"""
from __future__ import annotations

import socket

from mpi4py import MPI

from ..backend import cupy_or_none
from .gpu import loaded_libmpi, nccl_available

__all__ = ["node_local_rank", "rank_report", "format_rank_reports"]


def node_local_rank(comm) -> int:
    """This rank's index among the ranks of ``comm`` on the same node.

    Used to bind a GPU (``local_rank % visible_devices``). Collective over
    ``comm`` (a shared-memory ``Split_type``), except at size 1.

    Args:
        comm: a :class:`~mpishard.comm.Communicator` or an mpi4py intracommunicator.
    """
    mpi_comm = getattr(comm, "mpi", comm)
    if mpi_comm.Get_size() == 1:
        return 0
    local = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
    try:
        return local.Get_rank()
    finally:
        local.Free()


def _device_description(local_rank: int, backend) -> str:
    if backend is not None:
        return backend.describe()
    cupy = cupy_or_none()
    if cupy is None:
        return "cpu (CuPy not importable)"
    try:
        gpus = int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        gpus = 0
    return f"cuda:{local_rank % gpus} of {gpus}" if gpus else "cpu (no GPU visible)"


def rank_report(comm, backend=None) -> dict:
    """What this rank runs on; collective over ``comm`` (it finds node-local ranks).

    Args:
        comm: a :class:`~mpishard.comm.Communicator`.
        backend: the :class:`~mpishard.backend.Backend` in use, if one was
            built (else the device a ``"cupy"`` backend would bind is reported).

    Returns:
        ``rank``, ``size``, ``host``, ``local_rank``, ``mpi_library``,
        ``mpi_vendor``, ``comm_backend``, ``device``, ``cuda_aware``,
        ``cuda_aware_how``, ``nccl_available``, ``nccl_how``.
    """
    local_rank = node_local_rank(comm)
    aware, how = comm.cuda_aware
    nccl_ok, nccl_how = nccl_available()
    vendor, version = MPI.get_vendor()
    return {
        "rank": comm.rank,
        "size": comm.size,
        "host": socket.gethostname(),
        "local_rank": local_rank,
        "mpi_library": loaded_libmpi() or "?",
        "mpi_vendor": f"{vendor} {'.'.join(map(str, version))}",
        "comm_backend": comm.comm_backend,
        "device": _device_description(local_rank, backend),
        "cuda_aware": aware,
        "cuda_aware_how": how,
        "nccl_available": nccl_ok,
        "nccl_how": nccl_how,
    }


def format_rank_reports(reports: list[dict]) -> str:
    """One block per rank, for ``mpishard info``."""
    lines = []
    for r in reports:
        lines.append(
            f"rank {r['rank']}/{r['size']} on {r['host']} (local {r['local_rank']}): "
            f"{r['mpi_vendor']} ({r['mpi_library']}), comm backend {r['comm_backend']}, "
            f"device {r['device']}")
        lines.append(f"    CUDA-aware MPI: {'yes' if r['cuda_aware'] else 'no'} "
                     f"({r['cuda_aware_how']})")
        lines.append(f"    NCCL: {'yes' if r['nccl_available'] else 'no'} ({r['nccl_how']})")
    return "\n".join(lines)

"""Launch facts: where each rank runs (node-local rank, host, MPI library, device).

    mpiexec -n 4 python -m mpi4py -m mpishard info     # prints format_rank_reports(...)

Collective helpers for entry points; nothing here moves array data.
"""
from __future__ import annotations

import json
import os
import socket
import warnings

from mpi4py import MPI

from mpishard.comm.gpu import loaded_libmpi, nccl_available
from mpishard.core.backend import cupy_or_none

__all__ = ["node_local_rank", "rank_report", "format_rank_reports", "device_before_mpi"]

#: Set by ``python -m mpishard`` (mpishard/__main__.py, [Note: GPU before MPI]).
_DEVICE_BEFORE_MPI = "MPISHARD_DEVICE_BEFORE_MPI"


def device_before_mpi(environ=None) -> dict | None:
    """The GPU this process made current before MPI started, or ``None``.

    ``{"device", "gpus", "local_rank", "source", "pid"}`` as recorded by
    ``python -m mpishard`` (a record left by another process is ignored).
    """
    environ = os.environ if environ is None else environ
    try:
        record = json.loads(environ.get(_DEVICE_BEFORE_MPI) or "null")
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("pid") != os.getpid():
        return None
    return record


def _cross_check(local_rank: int, mpi_comm, environ=None) -> None:
    """Warn when the GPU bound before MPI is not the one MPI's node-local rank gives."""
    record = device_before_mpi(environ)
    if record is None or mpi_comm.Get_size() != MPI.COMM_WORLD.Get_size():
        return
    if record["local_rank"] == local_rank:
        return
    later = local_rank % record["gpus"]
    effect = (f"which binds GPU {later}: this process holds a CUDA context on both"
              if later != record["device"] else f"which binds the same GPU {later}")
    warnings.warn(
        f"rank {MPI.COMM_WORLD.Get_rank()}: the launcher's node-local rank is "
        f"{record['local_rank']} ({record['source']}), and GPU {record['device']} was made "
        f"current before MPI started, but MPI's node-local rank is {local_rank}, {effect}; "
        f"check how the launcher places tasks (and {record['source']})",
        RuntimeWarning, stacklevel=3)


def node_local_rank(comm) -> int:
    """This rank's index among the ranks of ``comm`` on the same node.

    Used to bind a GPU (``local_rank % visible_devices``). Collective over
    ``comm`` (a shared-memory ``Split_type``), except at size 1. Over the whole
    world it is also compared with the GPU bound before MPI started, if one
    was ([Note: GPU before MPI] in mpishard/__main__.py): a warning names both
    when they differ.

    Args:
        comm: a :class:`~mpishard.comm.Communicator` or an mpi4py intracommunicator.
    """
    mpi_comm = getattr(comm, "mpi", comm)
    if mpi_comm.Get_size() == 1:
        local_rank = 0
    else:
        local = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
        try:
            local_rank = local.Get_rank()
        finally:
            local.Free()
    _cross_check(local_rank, mpi_comm)
    return local_rank


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
        backend: the :class:`~mpishard.core.backend.Backend` in use, if one was
            built (else the device a ``"cupy"`` backend would bind is reported).

    Returns:
        ``rank``, ``size``, ``host``, ``local_rank``, ``mpi_library``,
        ``mpi_vendor``, ``comm_backend``, ``comm_backend_how``, ``device``,
        ``device_before_mpi``, ``cuda_aware``, ``cuda_aware_how``,
        ``nccl_available``, ``nccl_how``.
    """
    local_rank = node_local_rank(comm)
    aware, how = comm.cuda_aware
    nccl_ok, nccl_how = nccl_available()
    vendor, version = MPI.get_vendor()
    early = device_before_mpi()
    return {
        "rank": comm.rank,
        "size": comm.size,
        "host": socket.gethostname(),
        "local_rank": local_rank,
        "mpi_library": loaded_libmpi() or "?",
        "mpi_vendor": f"{vendor} {'.'.join(map(str, version))}",
        "comm_backend": comm.comm_backend,
        "comm_backend_how": comm.backend_how_once_bound(local_rank),
        "device": _device_description(local_rank, backend),
        "device_before_mpi": None if early is None else (
            f"cuda:{early['device']} ({early['source']}={early['local_rank']})"),
        "cuda_aware": aware,
        "cuda_aware_how": how,
        "nccl_available": nccl_ok,
        "nccl_how": nccl_how,
    }


def format_rank_reports(reports: list[dict], gpu_lines: bool = True) -> str:
    """One block per rank, for ``mpishard info`` and the plan of ``mpishard train``;
    without ``gpu_lines``, no CUDA-aware MPI and NCCL lines (a run on CPUs only)."""
    lines = []
    for r in reports:
        early = r.get("device_before_mpi")
        lines.append(
            f"rank {r['rank']}/{r['size']} on {r['host']} (local {r['local_rank']}): "
            f"{r['mpi_vendor']} ({r['mpi_library']}), comm backend {r['comm_backend']}, "
            f"device {r['device']}" + (f", bound before MPI: {early}" if early else ""))
        how = r.get("comm_backend_how")
        if how and how != "comm_backend='mpi'":
            lines.append(f"    comm backend: {how}")
        if gpu_lines:
            lines.append(f"    CUDA-aware MPI: {'yes' if r['cuda_aware'] else 'no'} "
                         f"({r['cuda_aware_how']})")
            lines.append(f"    NCCL: {'yes' if r['nccl_available'] else 'no'} ({r['nccl_how']})")
    return "\n".join(lines)

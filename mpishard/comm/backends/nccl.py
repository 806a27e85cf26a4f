"""The NCCL backend: reductions, gathers and broadcasts of CuPy arrays through NCCL.

One :class:`NcclGroup` per :class:`~mpishard.comm.Communicator`, created the
first time that communicator reduces, gathers or broadcasts a device array:
rank 0 draws a unique id, the id is broadcast over MPI, and every rank builds a
``cupy.cuda.nccl.NcclCommunicator`` for the same group. Host arrays, dtypes
NCCL lacks, all-to-all and point to point go to the MPI backend the NCCL
backend is built over (see [Note: collective backends]).

[Note: NCCL streams]
NCCL kernels run on the group's own stream, ordered after the caller's work and
before the caller's later work by events, so communication can overlap compute
that does not depend on it:

    caller stream:  ... produce buf ─┐                ┌─► consume buf ...
                                     ▼ (event)        │ (event)
    NCCL stream:                   all_reduce(buf) ───┘

A blocking call makes the caller's current stream wait for the result and
returns without blocking the host; a handle's ``wait()`` does the same. So the
result is ready *in stream order*, which is all CuPy code needs. With a
watchdog timeout the host also waits for the event, so a hang becomes visible.
Point-to-point ``send``/``recv`` and the ``*_obj`` forms always use MPI.

Because the host does not wait, the wall time from issue to return says
nothing about an NCCL collective. Its statistics use the device time between
two CUDA events recorded on the NCCL stream around it, read when the
statistics are read (see [Note: bus bytes] in :mod:`~mpishard.comm.stats`).

[Note: one GPU per rank]
NCCL refuses a group in which two ranks use the same GPU ("Duplicate GPU
detected", ``ncclInvalidUsage``). So ``comm_backend="auto"`` decides at the
first device collective, when every rank has bound its GPU: the ranks
all-gather (host, PCI bus id of the current device) and, when two ranks of one
node share a device, the communicator falls back to MPI, says why in a warning
(rank 0 of the group) and in ``comm_backend_how``, and never builds the NCCL
group. An explicit ``"nccl"`` is left to fail in NCCL with its own message.
"""
from __future__ import annotations

import socket
import warnings

import numpy as np

from mpishard.comm.backends.base import BackendSetup, CollectiveBackend, Pending
from mpishard.comm.debug import caller_stacklevel
from mpishard.comm.gpu import nccl_available
from mpishard.comm.handles import EventRequest
from mpishard.core.backend import cupy_or_none

__all__ = ["NcclBackend", "NcclGroup", "nccl_dtype", "device_identity", "shared_gpu",
           "gather_devices"]


class NcclBackend(CollectiveBackend):
    """NCCL for device arrays it has a datatype for; ``fallback`` (MPI) for the rest.

    Args:
        setup: the group, why NCCL was chosen, whether ``auto`` chose it (then
            the first device collective checks [Note: one GPU per rank]) and
            whether the host waits for NCCL (a watchdog is on).
        fallback: the group's MPI backend.
    """

    label = "NCCL"
    install_hint = "install CuPy with NCCL (pip install 'mpishard[cuda12]' nvidia-nccl-cu12)"
    auto_caveat = (", unless ranks of one node share a GPU (checked at the first device "
                   "collective)")

    def __init__(self, setup: BackendSetup, fallback: CollectiveBackend):
        self.fallback = fallback
        self.group: NcclGroup | None = None     # built at the first device collective
        self._setup = setup
        self._rank = setup.mpi_comm.Get_rank()
        self.how = setup.how
        self._undecided = setup.auto            # auto: the shared-GPU check is still owed
        self._stepped_back = False              # auto found a shared GPU: MPI from now on

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return nccl_available()

    @property
    def name(self) -> str:
        return self.fallback.name if self._stepped_back else "nccl"

    @property
    def takes_device_arrays(self) -> tuple[bool, str]:
        return True, "NCCL runs on device memory"

    def check_dtype(self, a, where: str) -> None:
        if not self._has_dtype(a):  # else NCCL's dtypes are NCCL's, whatever MPI has
            self.fallback.check_dtype(a, where)

    def all_reduce(self, buf, op: str, *, blocking: bool) -> Pending:
        group = self._group_for(buf)
        if group is None:
            return self.fallback.all_reduce(buf, op, blocking=blocking)
        return self._issued(group.all_reduce(buf, op, host_sync=self._setup.host_sync))

    def reduce_scatter(self, send, recv, op: str, *, blocking: bool) -> Pending:
        group = self._group_for(send)
        if group is None:
            return self.fallback.reduce_scatter(send, recv, op, blocking=blocking)
        return self._issued(group.reduce_scatter(send, recv, op,
                                                 host_sync=self._setup.host_sync))

    def all_gather(self, send, recv, *, in_place: bool, blocking: bool) -> Pending:
        group = self._group_for(recv)
        if group is None:
            return self.fallback.all_gather(send, recv, in_place=in_place, blocking=blocking)
        return self._issued(group.all_gather(send, recv, host_sync=self._setup.host_sync))

    def broadcast(self, buf, root: int, *, blocking: bool) -> Pending:
        group = self._group_for(buf)
        if group is None:
            return self.fallback.broadcast(buf, root, blocking=blocking)
        return self._issued(group.broadcast(buf, root, host_sync=self._setup.host_sync))

    # NCCL has no all-to-all here, and point to point stays on MPI (CUDA-aware or staged)
    def all_to_all(self, send, recv, *, blocking: bool) -> Pending:
        return self.fallback.all_to_all(send, recv, blocking=blocking)

    def all_to_all_v(self, send, send_rows: list, recv, recv_rows: list, *,
                     blocking: bool) -> Pending:
        return self.fallback.all_to_all_v(send, send_rows, recv, recv_rows, blocking=blocking)

    def isend(self, buf, dest: int, tag: int) -> Pending:
        return self.fallback.isend(buf, dest, tag)

    def irecv(self, buf, source: int, tag: int) -> Pending:
        return self.fallback.irecv(buf, source, tag)

    def how_once_bound(self, local_rank: int, all_gather_obj) -> str:
        """For an undecided ``auto``: whether the GPUs the ranks will bind collide."""
        if not self._undecided:
            return self.how
        try:
            gpus = int(cupy_or_none().cuda.runtime.getDeviceCount())
            mine = (socket.gethostname(), device_identity(local_rank % gpus))
        except Exception:  # noqa: BLE001 (no GPU here: nothing to collide)
            mine = (socket.gethostname(), f"none (rank {self._rank})")
        clash = shared_gpu(all_gather_obj(mine))
        if clash is None:
            return self.how
        return (f"auto: will fall back to MPI at the first device collective: {clash} "
                f"(NCCL refuses two ranks on one GPU)")

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    # -- choosing NCCL or MPI, call by call --------------------------------------
    def _has_dtype(self, a) -> bool:
        return type(a) is not np.ndarray and nccl_dtype(a.dtype) is not None

    def _group_for(self, a):
        """The NCCL group if ``a`` goes through NCCL, else ``None`` (collective the
        first time: the group is built, after the check of [Note: one GPU per rank])."""
        if self._stepped_back or type(a) is np.ndarray:
            return None
        if self.group is None:
            if self._undecided and self._step_back_if_gpus_shared():
                return None
            self.group = NcclGroup(self._setup.mpi_comm)
        return self.group if self.group.supports(a) else None

    def _step_back_if_gpus_shared(self) -> bool:
        """For ``auto``: use MPI when two ranks of one node use one GPU (collective).
        Returns whether it stepped back."""
        clash = shared_gpu(gather_devices(self._setup.mpi_comm))
        self._undecided = False
        if clash is None:
            self.how += "; no two ranks share a GPU"
            return False
        self._stepped_back = True
        self.how = f"auto: MPI, not NCCL: {clash}, and NCCL refuses two ranks on one GPU"
        if self._rank == 0:
            warnings.warn(f"communicator {self._setup.comm_name!r}: {self.how} (bind one "
                          f"GPU per rank, or set comm_backend='mpi')", RuntimeWarning,
                          stacklevel=caller_stacklevel())
        return True

    @staticmethod
    def _issued(request) -> Pending:
        """An NCCL request: complete in stream order, timed on the device."""
        return Pending(request, device_seconds=getattr(request, "device_seconds", None))


def device_identity(device: int | None = None) -> str:
    """What tells GPUs apart across processes: the PCI bus id of ``device`` (default:
    the current CuPy device), which stays the same whatever each process's
    ``CUDA_VISIBLE_DEVICES`` numbers it."""
    import cupy  # noqa: PLC0415

    index = cupy.cuda.runtime.getDevice() if device is None else int(device)
    try:
        return str(cupy.cuda.Device(index).pci_bus_id)
    except Exception:  # noqa: BLE001 (an old CuPy: fall back to the index)
        return f"cuda:{index}"


def shared_gpu(entries: list) -> str | None:
    """The first two ranks on one host with one GPU, described; ``None`` if none.

    Args:
        entries: ``(host, device identity)`` per rank, indexed by rank.
    """
    seen: dict = {}
    for rank, key in enumerate(entries):
        key = tuple(key)
        if key in seen:
            host, device = key
            return f"ranks {seen[key]} and {rank} on host {host} share GPU {device}"
        seen[key] = rank
    return None


def gather_devices(mpi_comm) -> list:
    """``(host, device identity)`` of every rank (collective over ``mpi_comm``)."""
    return mpi_comm.allgather((socket.gethostname(), device_identity()))


#: ``ncclBfloat16`` in nccl.h's ``ncclDataType_t``
NCCL_BFLOAT16 = 9


def nccl_dtype(dtype):
    """The NCCL datatype for a NumPy dtype, or ``None`` if NCCL has none."""
    from cupy.cuda import nccl  # noqa: PLC0415

    table = {
        "int8": nccl.NCCL_INT8, "uint8": nccl.NCCL_UINT8,
        "int32": nccl.NCCL_INT32, "uint32": nccl.NCCL_UINT32,
        "int64": nccl.NCCL_INT64, "uint64": nccl.NCCL_UINT64,
        "float16": nccl.NCCL_FLOAT16, "float32": nccl.NCCL_FLOAT32,
        "float64": nccl.NCCL_FLOAT64,
        # ncclBfloat16 (nccl.h, NCCL 2.10 on), which CuPy's binding may not name
        "bfloat16": getattr(nccl, "NCCL_BFLOAT16", NCCL_BFLOAT16),
    }
    return table.get(str(dtype))


class _StreamEvent(EventRequest):
    """Completion of an NCCL operation, waited for in stream order.

    ``start`` is the event recorded on the NCCL stream just before the
    operation: :meth:`device_seconds` is the device time between the two.
    """

    def __init__(self, event, host_sync: bool, start=None):
        super().__init__(event)
        self.host_sync = host_sync
        self.start = start

    def device_seconds(self) -> float:
        """Seconds the operation took on the device (waits for it to finish)."""
        import cupy  # noqa: PLC0415

        self.event.synchronize()
        if self.start is None:
            return 0.0
        return float(cupy.cuda.get_elapsed_time(self.start, self.event)) / 1e3

    def Wait(self) -> None:  # noqa: N802 (MPI naming)
        import cupy  # noqa: PLC0415

        cupy.cuda.get_current_stream().wait_event(self.event)
        if self.host_sync:
            self.event.synchronize()


class NcclGroup:
    """The NCCL communicator for one MPI communicator's group.

    Args:
        mpi_comm: the mpi4py communicator (collective: every rank constructs).
    """

    def __init__(self, mpi_comm):
        import cupy  # noqa: PLC0415
        from cupy.cuda import nccl  # noqa: PLC0415

        self._cupy = cupy
        self._nccl = nccl
        self.size = mpi_comm.Get_size()
        self.rank = mpi_comm.Get_rank()
        unique_id = nccl.get_unique_id() if self.rank == 0 else None
        unique_id = mpi_comm.bcast(unique_id, root=0)
        self.comm = nccl.NcclCommunicator(self.size, unique_id, self.rank)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._ops = {"sum": nccl.NCCL_SUM, "avg": nccl.NCCL_SUM, "max": nccl.NCCL_MAX}

    def supports(self, a) -> bool:
        """Whether NCCL has a datatype for ``a`` (else the MPI path is used)."""
        return nccl_dtype(a.dtype) is not None

    def _enter(self):
        """Order the NCCL stream after everything already queued by the caller;
        return the event that starts the operation's timing."""
        self.stream.wait_event(self._cupy.cuda.get_current_stream().record())
        return self.stream.record()

    def _leave(self, host_sync: bool, start=None) -> _StreamEvent:
        return _StreamEvent(self.stream.record(), host_sync, start)

    def all_reduce(self, buf, op: str, host_sync: bool = False) -> _StreamEvent:
        """Reduce ``buf`` in place over the group (``avg`` divides after)."""
        start = self._enter()
        ptr = buf.data.ptr
        self.comm.allReduce(ptr, ptr, buf.size, nccl_dtype(buf.dtype),
                            self._ops[op], self.stream.ptr)
        if op == "avg":
            with self.stream:
                buf /= self.size
        return self._leave(host_sync, start)

    def reduce_scatter(self, send, recv, op: str, host_sync: bool = False) -> _StreamEvent:
        """Reduce ``send``'s blocks; this rank's block lands in ``recv``."""
        start = self._enter()
        self.comm.reduceScatter(send.data.ptr, recv.data.ptr, recv.size,
                                nccl_dtype(send.dtype), self._ops[op], self.stream.ptr)
        if op == "avg":
            with self.stream:
                recv /= self.size
        return self._leave(host_sync, start)

    def all_gather(self, send, recv, host_sync: bool = False) -> _StreamEvent:
        """Gather every rank's ``send`` into ``recv`` (rank-major; in place allowed)."""
        start = self._enter()
        self.comm.allGather(send.data.ptr, recv.data.ptr, send.size,
                            nccl_dtype(send.dtype), self.stream.ptr)
        return self._leave(host_sync, start)

    def broadcast(self, buf, root: int, host_sync: bool = False) -> _StreamEvent:
        """Copy root's ``buf`` into every rank's ``buf``."""
        start = self._enter()
        ptr = buf.data.ptr
        self.comm.broadcast(ptr, ptr, buf.size, nccl_dtype(buf.dtype), root,
                            self.stream.ptr)
        return self._leave(host_sync, start)

    def close(self) -> None:
        """Release the NCCL communicator (collective)."""
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None

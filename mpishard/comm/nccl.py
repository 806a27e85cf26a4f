"""NCCL collectives for CuPy arrays (``comm_backend="nccl"``).

One :class:`NcclGroup` per :class:`~mpishard.comm.Communicator`, created the
first time that communicator reduces, gathers or broadcasts a device array:
rank 0 draws a unique id, the id is broadcast over MPI, and every rank builds a
``cupy.cuda.nccl.NcclCommunicator`` for the same group.

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
"""
from __future__ import annotations

from .gpu import nccl_available
from .handles import EventRequest

__all__ = ["NcclGroup", "nccl_dtype", "resolve_comm_backend", "COMM_BACKENDS"]

COMM_BACKENDS = ("mpi", "nccl", "auto")


def resolve_comm_backend(comm_backend: str) -> str:
    """``"mpi"`` or ``"nccl"`` for a requested backend (``"auto"``: NCCL if it loads).

    Raises:
        ValueError: an unknown name, or ``"nccl"`` where NCCL does not load.
    """
    if comm_backend not in COMM_BACKENDS:
        raise ValueError(f"unknown comm_backend {comm_backend!r}; use one of {COMM_BACKENDS}")
    if comm_backend == "mpi":
        return "mpi"
    ok, why = nccl_available()
    if comm_backend == "nccl" and not ok:
        raise ValueError(f"comm_backend='nccl' but NCCL is unavailable ({why}); install "
                         f"CuPy with NCCL (pip install 'mpishard[cuda12]' nvidia-nccl-cu12) "
                         f"or use comm_backend='mpi'")
    return "nccl" if ok else "mpi"


def nccl_dtype(dtype):
    """The NCCL datatype for a NumPy dtype, or ``None`` if NCCL has none."""
    from cupy.cuda import nccl  # noqa: PLC0415

    table = {
        "int8": nccl.NCCL_INT8, "uint8": nccl.NCCL_UINT8,
        "int32": nccl.NCCL_INT32, "uint32": nccl.NCCL_UINT32,
        "int64": nccl.NCCL_INT64, "uint64": nccl.NCCL_UINT64,
        "float16": nccl.NCCL_FLOAT16, "float32": nccl.NCCL_FLOAT32,
        "float64": nccl.NCCL_FLOAT64,
    }
    return table.get(str(dtype))


class _StreamEvent(EventRequest):
    """Completion of an NCCL operation, waited for in stream order."""

    def __init__(self, event, host_sync: bool):
        super().__init__(event)
        self.host_sync = host_sync

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
        # Order the NCCL stream after everything already queued by the caller.
        self.stream.wait_event(self._cupy.cuda.get_current_stream().record())

    def _leave(self, host_sync: bool) -> _StreamEvent:
        return _StreamEvent(self.stream.record(), host_sync)

    def all_reduce(self, buf, op: str, host_sync: bool = False) -> _StreamEvent:
        """Reduce ``buf`` in place over the group (``avg`` divides after)."""
        self._enter()
        ptr = buf.data.ptr
        self.comm.allReduce(ptr, ptr, buf.size, nccl_dtype(buf.dtype),
                            self._ops[op], self.stream.ptr)
        if op == "avg":
            with self.stream:
                buf /= self.size
        return self._leave(host_sync)

    def reduce_scatter(self, send, recv, op: str, host_sync: bool = False) -> _StreamEvent:
        """Reduce ``send``'s blocks; this rank's block lands in ``recv``."""
        self._enter()
        self.comm.reduceScatter(send.data.ptr, recv.data.ptr, recv.size,
                                nccl_dtype(send.dtype), self._ops[op], self.stream.ptr)
        if op == "avg":
            with self.stream:
                recv /= self.size
        return self._leave(host_sync)

    def all_gather(self, send, recv, host_sync: bool = False) -> _StreamEvent:
        """Gather every rank's ``send`` into ``recv`` (rank-major; in place allowed)."""
        self._enter()
        self.comm.allGather(send.data.ptr, recv.data.ptr, send.size,
                            nccl_dtype(send.dtype), self.stream.ptr)
        return self._leave(host_sync)

    def broadcast(self, buf, root: int, host_sync: bool = False) -> _StreamEvent:
        """Copy root's ``buf`` into every rank's ``buf``."""
        self._enter()
        ptr = buf.data.ptr
        self.comm.broadcast(ptr, ptr, buf.size, nccl_dtype(buf.dtype), root,
                            self.stream.ptr)
        return self._leave(host_sync)

    def close(self) -> None:
        """Release the NCCL communicator (collective)."""
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None

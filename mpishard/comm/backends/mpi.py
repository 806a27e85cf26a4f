"""The MPI backend: mpi4py's buffer API, on host arrays and on device arrays.

Host arrays go to MPI as they are, with no copies. Device arrays go as they
are when MPI is CUDA-aware and through pinned host buffers otherwise
(:class:`~mpishard.comm.gpu.DevicePath`, [Note: device buffers]). float16 and
bfloat16 travel as uint16, and both reduce in float32 ([Note: 16-bit
floats on MPI] in :mod:`~mpishard.comm.checks`). Every communicator has this
backend; another backend hands it what it does not run itself.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpishard.comm import checks, gpu
from mpishard.comm.backends.base import BackendSetup, CollectiveBackend, Pending

__all__ = ["MpiBackend"]


class MpiBackend(CollectiveBackend):
    """The collectives of one MPI communicator (see [Note: collective backends]).

    Args:
        setup: the group (``setup.mpi_comm``) and why MPI was chosen.
        cuda_aware: ``True``/``False`` to skip CUDA-aware detection (``None``:
            detect at the first device array).
        cuda_aware_source: what set ``cuda_aware``, named in the report.
    """

    name = "mpi"
    label = "MPI"

    def __init__(self, setup: BackendSetup, cuda_aware: bool | None = None,
                 cuda_aware_source: str = "the cuda_aware argument"):
        self.mpi = setup.mpi_comm
        self.rank = self.mpi.Get_rank()
        self.size = self.mpi.Get_size()
        self.how = setup.how
        self._cuda_aware_override = cuda_aware
        self._cuda_aware_source = cuda_aware_source
        self._cuda_aware: tuple[bool, str] | None = None
        self._device_path: gpu.DevicePath | None = None   # once a device array is seen

    @classmethod
    def build(cls, setup: BackendSetup, mpi: CollectiveBackend) -> CollectiveBackend:
        return mpi  # every communicator has its MPI backend already

    @property
    def takes_device_arrays(self) -> tuple[bool, str]:
        """Whether MPI is CUDA-aware, and how that was decided (detected once)."""
        if self._cuda_aware is None:
            self._cuda_aware = gpu.detect_cuda_aware(self._cuda_aware_override,
                                                     self._cuda_aware_source)
        return self._cuda_aware

    def check_dtype(self, a, where: str) -> None:
        checks.check_wire_dtype(a, where)

    # -- collectives ---------------------------------------------------------
    def all_reduce(self, buf, op: str, *, blocking: bool) -> Pending:
        mpi_op = checks.REDUCE_OPS[op]
        return self._issue(self.mpi.Allreduce if blocking else self.mpi.Iallreduce,
                           ((buf, True, True),), lambda v, _: (MPI.IN_PLACE, v[0], mpi_op),
                           blocking, reduction=True, divide=buf if op == "avg" else None)

    def reduce_scatter(self, send, recv, op: str, *, blocking: bool) -> Pending:
        mpi_op = checks.REDUCE_OPS[op]
        primitive = (self.mpi.Reduce_scatter_block if blocking
                     else self.mpi.Ireduce_scatter_block)
        return self._issue(primitive, ((send, True, False), (recv, False, True)),
                           lambda v, _: (v[0], v[1], mpi_op), blocking, reduction=True,
                           divide=recv if op == "avg" else None)

    def all_gather(self, send, recv, *, in_place: bool, blocking: bool) -> Pending:
        def args(views, backs):  # unstaged in place: MPI reads our block of recv itself
            return (MPI.IN_PLACE if in_place and backs[0] is None else views[1], views[0])
        return self._issue(self.mpi.Allgather if blocking else self.mpi.Iallgather,
                           ((recv, False, True), (send, True, False)), args, blocking)

    def broadcast(self, buf, root: int, *, blocking: bool) -> Pending:
        return self._issue(self.mpi.Bcast if blocking else self.mpi.Ibcast,
                           ((buf, self.rank == root, self.rank != root),),
                           lambda v, _: (v[0], root), blocking)

    def all_to_all(self, send, recv, *, blocking: bool) -> Pending:
        return self._issue(self.mpi.Alltoall if blocking else self.mpi.Ialltoall,
                           ((send, True, False), (recv, False, True)),
                           lambda v, _: (v[0], v[1]), blocking)

    def all_to_all_v(self, send, send_rows: list, recv, recv_rows: list, *,
                     blocking: bool) -> Pending:
        row = int(np.prod(send.shape[1:], dtype=np.int64))

        def counts_and_displacements(rows):  # in elements, as MPI_Alltoallv takes them
            n = [c * row for c in rows]
            return n, [sum(n[:j]) for j in range(len(n))]
        sent, received = counts_and_displacements(send_rows), counts_and_displacements(recv_rows)
        return self._issue(self.mpi.Alltoallv if blocking else self.mpi.Ialltoallv,
                           ((send, True, False), (recv, False, True)),
                           lambda v, _: ([v[0], sent], [v[1], received]), blocking)

    # -- point to point --------------------------------------------------------
    def isend(self, buf, dest: int, tag: int) -> Pending:
        view, _ = self._for_mpi(buf, copy_in=True, copy_out=False)
        return Pending(self.mpi.Isend(view, dest, tag), keep=(view,))

    def irecv(self, buf, source: int, tag: int) -> Pending:
        view, copy_back = self._for_mpi(buf, copy_in=False, copy_out=True)
        return Pending(self.mpi.Irecv(view, source, tag),
                       after=() if copy_back is None else (copy_back,), keep=(view,))

    # -- the one path every collective takes -------------------------------------
    def _issue(self, primitive, buffers, args, blocking: bool, *, reduction: bool = False,
               divide=None) -> Pending:
        """Call ``primitive`` on ``buffers`` as MPI sees them.

        Args:
            primitive: the bound mpi4py method (``Allreduce`` or ``Iallreduce``).
            buffers: ``(array, mpi_reads, mpi_writes)`` per array MPI touches.
            args: maps the buffers as MPI sees them (and their copy-back steps,
                ``None`` where not staged) to ``primitive``'s arguments.
            reduction: the call reduces (float16 and bfloat16 then reduce in float32).
            divide: the array an ``avg`` divides by the size after completion.
        """
        narrow = None
        if reduction and checks.reduces_in_float32(buffers[0][0]):
            buffers, divide, narrow = checks.widened(buffers, divide)
        views, backs = [], []
        for array, reads, writes in buffers:
            view, back = self._for_mpi(array, copy_in=reads, copy_out=writes,
                                       nonblocking=not blocking)
            views.append(view)
            backs.append(back)
        request = primitive(*args(views, backs))
        after = [back for back in backs if back is not None]
        if divide is not None:
            after.append(self._divider(divide))
        if narrow is not None:
            after.append(narrow)
        return Pending(request, tuple(after), tuple(views) + tuple(a for a, _, _ in buffers))

    def _for_mpi(self, a, *, copy_in: bool, copy_out: bool, nonblocking: bool = False):
        """``(buffer for mpi4py, copy_back or None)`` for ``a`` (see [Note: device buffers])."""
        a = checks.wire_view(a)
        if type(a) is np.ndarray:
            return a, None
        if self._device_path is None:
            aware, how = self.takes_device_arrays
            self._device_path = gpu.DevicePath(
                aware, how, stage_nonblocking=gpu.mpi_vendor() == "Open MPI")
        return self._device_path.for_mpi(a, copy_in=copy_in, copy_out=copy_out,
                                         nonblocking=nonblocking)

    def _divider(self, out):
        """The completion step of an ``avg``: divide ``out`` by the size, in place."""
        def divide():
            out[...] /= self.size
        return divide

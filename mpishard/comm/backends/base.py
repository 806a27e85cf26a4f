"""What a collective backend does, and what it hands back.

[Note: collective backends]
A backend moves the bytes of the array collectives of one communicator's group;
everything around that stays with the :class:`~mpishard.comm.Communicator`:
argument checks (:mod:`~mpishard.comm.checks`, so a backend receives buffers
that are C-contiguous and agree on dtype, device and size), the call history,
debug fingerprints and watchdog (:class:`~mpishard.comm.debug.CallLog`), the
statistics, and the :class:`~mpishard.comm.Handle` a non-blocking call
returns. A backend implements :class:`CollectiveBackend`: each collective
issues the operation and returns a :class:`Pending` (blocking or not, as
asked), and :meth:`~CollectiveBackend.check_dtype` says which dtypes it can
move. Every communicator has the MPI backend; another one is built over it
(``fallback``) and hands it whatever it does not run itself, as the NCCL
backend does with host arrays, dtypes NCCL lacks, all-to-all and point to
point. A group of one rank runs on :class:`~.one_rank.OneRank` whatever the
backend: nothing leaves the rank.

Adding a backend: one module in this folder with a :class:`CollectiveBackend`
subclass, and one line in the registry (:data:`mpishard.comm.backends.BACKENDS`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

__all__ = ["BackendSetup", "CollectiveBackend", "Pending", "DONE"]


@dataclass(frozen=True)
class BackendSetup:
    """What a backend is built with.

    Attributes:
        mpi_comm: the mpi4py communicator of the group (what a backend
            bootstraps over, as NCCL broadcasts its unique id).
        comm_name: the Communicator's name, for messages.
        how: why this backend was chosen (``Communicator.comm_backend_how``).
        auto: ``comm_backend="auto"`` chose it (here or for the communicator
            this one was split from): it may still step back to MPI at its
            first collective.
        host_sync: the host waits for device collectives too (a watchdog
            timeout is set, so a stuck one shows).
    """

    mpi_comm: object
    comm_name: str
    how: str
    auto: bool = False
    host_sync: bool = False


class Pending:
    """An operation a backend has issued.

    Args:
        request: ``Test()``/``Wait()`` of an operation still in flight (an
            ``MPI.Request``, a CUDA event), or ``None`` when it completed
            before the backend returned (a blocking MPI call).
        after: steps run at completion, in order (the copy back from a
            staging buffer, the division of an ``avg``, float16 rounding).
        keep: what must stay alive until completion (staging buffers, views).
        device_seconds: for an operation the host does not wait for (NCCL),
            its device time, called when the statistics are read.
    """

    __slots__ = ("request", "after", "keep", "device_seconds")

    def __init__(self, request=None, after: tuple = (), keep: tuple = (),
                 device_seconds: Callable[[], float] | None = None):
        self.request = request
        self.after = after
        self.keep = keep
        self.device_seconds = device_seconds


#: A completed operation with nothing left to do.
DONE = Pending()


class CollectiveBackend(ABC):
    """The array collectives of one group (see [Note: collective backends]).

    Buffers arrive checked; ``op`` is ``"sum"``, ``"avg"`` (sum, then divide
    by the group size) or ``"max"``; ``blocking=False`` asks for the
    non-blocking form (the returned :class:`Pending` carries its request).

    Attributes: ``name`` (what ``comm_backend`` says), ``how`` (why this
    backend runs the group's collectives: ``comm_backend_how``); of the class,
    ``label`` (for messages), ``install_hint`` (what to install when
    :meth:`available` says no) and ``auto_caveat`` (what ``comm_backend="auto"``
    still checks later).
    """

    name = ""
    how = ""
    label = ""
    install_hint = ""
    auto_caveat = ""

    @classmethod
    def available(cls) -> tuple[bool, str]:
        """``(whether this backend can run here, why)``, asked before one is built."""
        return True, ""

    @classmethod
    def build(cls, setup: BackendSetup, mpi: "CollectiveBackend") -> "CollectiveBackend":
        """The backend for one group, built over the group's MPI backend ``mpi``
        (its ``fallback``)."""
        return cls(setup, fallback=mpi)

    @property
    @abstractmethod
    def takes_device_arrays(self) -> tuple[bool, str]:
        """``(whether device arrays reach the library as they are, how that was
        decided)``; where they do not, they are staged through host memory."""

    @abstractmethod
    def check_dtype(self, a, where: str) -> None:
        """Raise ``ValueError`` if the backend cannot move ``a``'s dtype.

        Asked before every collective, also on a group of one rank, so one
        rank refuses what a larger group would.
        """

    @abstractmethod
    def all_reduce(self, buf, op: str, *, blocking: bool) -> Pending:
        """Reduce ``buf`` over the group, in place."""

    @abstractmethod
    def reduce_scatter(self, send, recv, op: str, *, blocking: bool) -> Pending:
        """Reduce ``send``'s equal blocks; this rank's block lands in ``recv``."""

    @abstractmethod
    def all_gather(self, send, recv, *, in_place: bool, blocking: bool) -> Pending:
        """Every rank's ``send`` into ``recv``, rank-major (``in_place``: ``send``
        is this rank's block of ``recv``)."""

    @abstractmethod
    def broadcast(self, buf, root: int, *, blocking: bool) -> Pending:
        """Rank ``root``'s ``buf`` into every rank's ``buf``."""

    @abstractmethod
    def all_to_all(self, send, recv, *, blocking: bool) -> Pending:
        """Block ``j`` of ``send`` to rank ``j``; block ``r`` of ``recv`` from rank ``r``."""

    @abstractmethod
    def all_to_all_v(self, send, send_rows: list, recv, recv_rows: list, *,
                     blocking: bool) -> Pending:
        """``send_rows[j]`` rows of ``send`` to rank ``j``; ``recv`` gets
        ``recv_rows[r]`` rows from each rank ``r``, in rank order."""

    @abstractmethod
    def isend(self, buf, dest: int, tag: int) -> Pending:
        """Start sending ``buf`` to rank ``dest``."""

    @abstractmethod
    def irecv(self, buf, source: int, tag: int) -> Pending:
        """Start receiving into ``buf`` from rank ``source``."""

    def how_once_bound(self, local_rank: int, all_gather_obj) -> str:
        """What :attr:`how` will say once each rank has bound GPU ``local_rank %
        visible GPUs``, for ``mpishard info`` before any collective. Collective
        over ``all_gather_obj`` where the backend must ask the other ranks
        (every rank of the group calls it or none); decides nothing."""
        return self.how

    def close(self) -> None:
        """Release what the backend holds for its group (collective; idempotent)."""

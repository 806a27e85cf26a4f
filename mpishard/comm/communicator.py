"""The Communicator: one MPI communicator, every operation mpishard needs.

    from mpi4py import MPI
    from mpishard.comm import Communicator

    world = Communicator.from_env(MPI.COMM_WORLD)   # entry points; libraries take it as an argument
    grad = world.all_reduce(grad, op="avg")          # in place, returns grad
    shard = world.reduce_scatter(flat_grads)         # this rank's reduced block
    full = world.all_gather(shard)                   # rank-major concatenation
    handle = world.iall_reduce(bucket); ...; handle.wait()

Run anything that uses it as ``mpiexec -n 4 python -m mpi4py script.py`` (see
docs/comm.md). Method names follow MPI in snake case; ``*_obj`` forms pickle
small Python objects, every other form moves array bytes through mpi4py's
buffer API (``Allreduce``, ``Reduce_scatter_block``, ``Allgather``, ...) with no
copies on the NumPy path. ``size == 1`` returns early without MPI calls.

[Note: one collective runner]
Every array collective is a :class:`Call` -- its buffers (what MPI reads and
writes), the MPI primitive's blocking and non-blocking names with their
arguments, and optionally a size-1 shortcut and an NCCL form -- handed to
:meth:`Communicator._run`, which does the four steps once for all of them:
begin the call (:class:`~mpishard.comm.debug.CallLog`: call history, watchdog,
debug fingerprints, see [Note: collective order]); move the bytes (the size-1
shortcut, NCCL, or MPI on host memory or, per [Note: device buffers], on
device memory); and finish, now or in ``Handle.wait`` (copy back from staging,
the ``avg`` division, statistics). Argument checks
(:mod:`~mpishard.comm.checks`) run before, so misuse raises before any MPI call.
A new collective is its checks plus one ``Call`` (see :meth:`all_to_all`).
"""
from __future__ import annotations

import os
import numpy as np
from mpi4py import MPI

from mpishard.comm import checks
from mpishard.comm.alltoall import AllToAll
from mpishard.comm.debug import CallHistory, CallLog, Family
from mpishard.comm.env import settings_from_env
from mpishard.comm.handles import Handle
from mpishard.comm.nccl import COMM_BACKENDS, choose_comm_backend
from mpishard.comm.messages import Messages
from mpishard.comm.runner import Call, Runner
from mpishard.comm.stats import CommStats

__all__ = ["Communicator", "COMM_BACKENDS", "Call"]


class Communicator(Runner, Messages, AllToAll):
    """A wrapper around one mpi4py communicator.

    Args:
        mpi_comm: the mpi4py intracommunicator (``MPI.COMM_WORLD``, a ``Dup()``,
            ``MPI.COMM_SELF``, ...). It is used as is; pass a ``Dup()`` to keep
            mpishard's traffic apart from your own.
        name: shown in the call history and in error messages.
        debug: fingerprint every collective across ranks (see
            [Note: collective order]).
        timeout: seconds after which a stuck collective aborts the job
            (``None``: no watchdog).
        comm_backend: ``"mpi"``, ``"nccl"`` (CuPy arrays via NCCL) or ``"auto"``
            (NCCL when it loads and no two ranks of a node share a GPU, else
            MPI; ``comm_backend_how`` says which and why, see [Note: one GPU
            per rank]).
        cuda_aware: ``True``/``False`` to skip CUDA-aware detection.
        history_size: how many calls the call history keeps.

    Raises:
        TypeError: ``mpi_comm`` is not an mpi4py intracommunicator.
        ValueError: a bad ``timeout`` or ``comm_backend``.
    """

    def __init__(self, mpi_comm, name: str = "world", *, debug: bool = False,
                 timeout: float | None = None, comm_backend: str = "mpi",
                 cuda_aware: bool | None = None, history_size: int = 64,
                 _family: Family | None = None, _owned: bool = False,
                 _cuda_aware_source: str = "the cuda_aware argument"):
        if not isinstance(mpi_comm, MPI.Intracomm) or mpi_comm == MPI.COMM_NULL:
            raise TypeError(f"Communicator needs an mpi4py intracommunicator such as "
                            f"MPI.COMM_WORLD, got {mpi_comm!r}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout={timeout!r} must be a positive number of "
                             f"seconds, or None for no watchdog")
        self.mpi = mpi_comm
        self.name = name
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.debug = bool(debug)
        self.timeout = None if timeout is None else float(timeout)
        self.comm_backend, self.comm_backend_how = choose_comm_backend(comm_backend)
        self.stats = CommStats()
        self.history = CallHistory(history_size)
        self._cuda_aware_override = cuda_aware
        self._cuda_aware_source = _cuda_aware_source
        self._cuda_aware: tuple[bool, str] | None = None
        self._device_path_cache = None          # a gpu.DevicePath once a device array is seen
        self._nccl = None
        self._owned = _owned
        if _family is None:
            _family = Family(self.timeout)
            _family.auto_backend = comm_backend == "auto"
        self._family = _family
        self._family.add(self)
        # split/dup children of an "auto" communicator inherit its choice so far
        # ("nccl"), and still check for shared GPUs in their own group
        self._auto_backend = self.comm_backend == "nccl" and (
            comm_backend == "auto" or _family.auto_backend)
        self._calls = CallLog(mpi_comm, name, debug=self.debug, watchdog=self._family.watchdog,
                              history=self.history, stats=self.stats)

    @classmethod
    def from_env(cls, mpi_comm, name: str = "world", environ=None, **overrides):
        """Build a Communicator configured from the environment (entry points only).

        Reads ``MPISHARD_DEBUG`` (0/1), ``MPISHARD_TIMEOUT`` (seconds; 0 or empty:
        none), ``MPISHARD_CUDA_AWARE`` (0/1; unset: detect) and
        ``MPISHARD_COMM_BACKEND`` (mpi/nccl/auto); see :mod:`mpishard.comm.env`.
        Keyword ``overrides`` win.

        Raises:
            ValueError: a variable has a value that does not parse; the message
                names it.
        """
        settings = settings_from_env(os.environ if environ is None else environ)
        settings.update(overrides)
        if "cuda_aware" in overrides:
            settings.pop("_cuda_aware_source", None)
        return cls(mpi_comm, name, **settings)

    # -- derived communicators -------------------------------------------
    def _child(self, mpi_comm, name: str, owned: bool = True) -> "Communicator":
        return Communicator(mpi_comm, name, debug=self.debug, timeout=self.timeout,
                            comm_backend=self.comm_backend,
                            cuda_aware=self._cuda_aware_override,
                            history_size=self.history.maxlen,
                            _family=self._family, _owned=owned,
                            _cuda_aware_source=self._cuda_aware_source)

    def single(self, name: str) -> "Communicator":
        """A one-rank communicator named ``name`` over ``MPI.COMM_SELF`` (local: no MPI
        call, no new MPI communicator; ``free`` leaves ``COMM_SELF`` alone)."""
        return self._child(MPI.COMM_SELF, name, owned=False)

    def split(self, color, key: int | None = None, name: str | None = None):
        """Split into sub-communicators (collective over this communicator).

        Args:
            color: ranks with equal ``color`` (an int >= 0) share a new
                communicator; ``None`` or ``MPI.UNDEFINED`` joins none.
            key: orders ranks in the new communicator (default: this rank).
            name: its name (default ``"<name>.<color>"``).

        Returns:
            The new :class:`Communicator`, or ``None`` for ``color=None``.
        """
        undefined = color is None or color == MPI.UNDEFINED
        if not undefined and (not isinstance(color, (int, np.integer)) or color < 0):
            raise ValueError(f"split: color {color!r} must be an int >= 0, or None "
                             f"for ranks that join no group")
        entry = self._calls.begin("split", None, None)
        try:
            new = self.mpi.Split(MPI.UNDEFINED if undefined else int(color),
                                 self.rank if key is None else int(key))
        finally:
            self._calls.end(entry, None, 0)
        if new == MPI.COMM_NULL:
            return None
        return self._child(new, name or f"{self.name}.{color}")

    def dup(self, name: str | None = None) -> "Communicator":
        """Duplicate (collective): same group, separate message space."""
        entry = self._calls.begin("dup", None, None)
        try:
            new = self.mpi.Dup()
        finally:
            self._calls.end(entry, None, 0)
        return self._child(new, name or f"{self.name}.dup")

    def free(self) -> None:
        """Free a communicator made by ``split``/``dup`` (collective; idempotent)."""
        if self._nccl is not None:
            self._nccl.close()
            self._nccl = None
        if self._owned and self.mpi != MPI.COMM_NULL:
            self.mpi.Free()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __repr__(self) -> str:
        extras = "".join([", debug" if self.debug else "",
                          f", timeout={self.timeout:g}s" if self.timeout else "",
                          f", {self.comm_backend}" if self.comm_backend != "mpi" else ""])
        return f"Communicator({self.name!r}, rank {self.rank} of {self.size}{extras})"

    # -- reductions -------------------------------------------------------
    def all_reduce(self, buf, op: str = "sum"):
        """Reduce ``buf`` over all ranks, in place; every rank gets the result.

        Args:
            buf: a C-contiguous array (overwritten with the result).
            op: ``"sum"``, ``"avg"`` (sum, then divide by ``size``) or ``"max"``.

        Returns:
            ``buf``.
        """
        return self._run(self._all_reduce(buf, op, "all_reduce"), blocking=True)

    def iall_reduce(self, buf, op: str = "sum") -> Handle:
        """Non-blocking :meth:`all_reduce`; ``handle.wait()`` returns ``buf``."""
        return self._run(self._all_reduce(buf, op, "iall_reduce"), blocking=False)

    def _all_reduce(self, buf, op, where) -> Call:
        def check():
            checks.check_array(buf, where, "buf", output=True)
            return checks.check_reduction(buf, op, where)
        mpi_op = self._checked(where, check)
        return Call("all_reduce", "all_reduce", buf.nbytes, buf, ((buf, True, True),),
                    ("Allreduce", "Iallreduce"), lambda v, _: (MPI.IN_PLACE, v[0], mpi_op),
                    buf.shape, buf.dtype, f"op={op}", reduction=True,
                    nccl=lambda g, sync: g.all_reduce(buf, op, host_sync=sync),
                    divide=buf if op == "avg" else None)

    def reduce_scatter(self, send, recv=None, op: str = "sum"):
        """Reduce ``send``'s ``size`` equal blocks; rank ``r`` gets block ``r``.

        Args:
            send: a C-contiguous array whose size is a multiple of ``size`` (pad it).
            recv: ``send.size // size`` elements of the same dtype, or ``None``
                to allocate (shape ``(send.shape[0] // size, *rest)`` when the
                first dimension divides, else flat).
            op: ``"sum"``, ``"avg"`` or ``"max"``.

        Returns:
            ``recv``.
        """
        return self._run(self._reduce_scatter(send, recv, op, "reduce_scatter"), blocking=True)

    def ireduce_scatter(self, send, recv=None, op: str = "sum") -> Handle:
        """Non-blocking :meth:`reduce_scatter`; ``handle.wait()`` returns ``recv``."""
        return self._run(self._reduce_scatter(send, recv, op, "ireduce_scatter"),
                         blocking=False)

    def _reduce_scatter(self, send, recv, op, where) -> Call:
        def check():
            checks.check_array(send, where, "send")
            mpi_op = checks.check_reduction(send, op, where)
            return mpi_op, checks.reduce_scatter_recv(send, recv, self.size, where)
        mpi_op, recv = self._checked(where, check)

        def local():
            recv.reshape(-1)[...] = send.reshape(-1)
        return Call("reduce_scatter", "reduce_scatter", send.nbytes, recv,
                    ((send, True, False), (recv, False, True)),
                    ("Reduce_scatter_block", "Ireduce_scatter_block"),
                    lambda v, _: (v[0], v[1], mpi_op), send.shape, send.dtype, f"op={op}",
                    local=local, reduction=True, divide=recv if op == "avg" else None,
                    nccl=lambda g, sync: g.reduce_scatter(send, recv, op, host_sync=sync))

    # -- gathers, broadcasts, all-to-all ------------------------------------
    def all_gather(self, send, recv=None):
        """Concatenate every rank's ``send`` (rank-major) on every rank.

        Args:
            send: a C-contiguous array, the same size on every rank. It may be
                exactly this rank's block of ``recv`` (gathered in place).
            recv: ``send.size * size`` elements, or ``None`` to allocate shape
                ``(size * send.shape[0], *rest)``.

        Returns:
            ``recv``.
        """
        return self._run(self._all_gather(send, recv, "all_gather"), blocking=True)

    def iall_gather(self, send, recv=None) -> Handle:
        """Non-blocking :meth:`all_gather`; ``handle.wait()`` returns ``recv``."""
        return self._run(self._all_gather(send, recv, "iall_gather"), blocking=False)

    def _all_gather(self, send, recv, where) -> Call:
        def check():
            checks.check_array(send, where, "send")
            return checks.all_gather_recv(send, recv, self.size, self.rank, where)
        recv, in_place = self._checked(where, check)

        def local():
            if not in_place:
                recv.reshape(-1)[...] = send.reshape(-1)

        def args(views, backs):  # unstaged in place: MPI reads our block of recv itself
            return (MPI.IN_PLACE if in_place and backs[0] is None else views[1], views[0])
        return Call("all_gather", "all_gather", recv.nbytes, recv,
                    ((recv, False, True), (send, True, False)), ("Allgather", "Iallgather"),
                    args, send.shape, send.dtype, local=local,
                    nccl=lambda g, sync: g.all_gather(send, recv, host_sync=sync))

    def broadcast(self, buf, root: int = 0):
        """Copy ``root``'s ``buf`` into every rank's ``buf`` (in place); returns ``buf``."""
        return self._run(self._broadcast(buf, root, "broadcast"), blocking=True)

    def ibroadcast(self, buf, root: int = 0) -> Handle:
        """Non-blocking :meth:`broadcast`; ``handle.wait()`` returns ``buf``."""
        return self._run(self._broadcast(buf, root, "ibroadcast"), blocking=False)

    def _broadcast(self, buf, root, where) -> Call:
        def check():
            checks.check_array(buf, where, "buf", output=True)
            return checks.check_root(root, self.size, where)
        root = self._checked(where, check)
        return Call("broadcast", "broadcast", buf.nbytes, buf,
                    ((buf, self.rank == root, self.rank != root),), ("Bcast", "Ibcast"),
                    lambda v, _: (v[0], root), buf.shape, buf.dtype, f"root={root}",
                    nccl=lambda g, sync: g.broadcast(buf, root, host_sync=sync))

    def barrier(self) -> None:
        """Wait until every rank has reached the barrier."""
        entry = self._calls.begin("barrier", None, None)
        try:
            if self.size > 1:
                self.mpi.Barrier()
        finally:
            self._calls.end(entry, "barrier", 0)

    # -- reports -----------------------------------------------------------
    def format_history(self) -> str:
        """The recent calls of this communicator and its family, oldest first."""
        return self._family.report()

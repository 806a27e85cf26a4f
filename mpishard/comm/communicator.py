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
small Python objects, every other form moves array bytes through the
communicator's backend (mpi4py's buffer API with no copies on the NumPy path,
or NCCL for device arrays). ``size == 1`` returns early without MPI calls.

The Communicator is the public face; it owns the parts: the call log (history,
fingerprints, watchdog, statistics), the backend ([Note: collective
backends]) and the :class:`~mpishard.comm.runner.Runner` that joins them
([Note: one collective runner]). Checks live in :mod:`.collectives`, point to
point and ``*_obj`` in :mod:`.messages`.
"""
from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

from mpishard.comm import collectives, messages
from mpishard.comm.backends import AUTO, BACKENDS, DEFAULT_COMM_BACKEND, choose_comm_backend
from mpishard.comm.backends.base import BackendSetup, CollectiveBackend
from mpishard.comm.backends.mpi import MpiBackend
from mpishard.comm.backends.one_rank import OneRank
from mpishard.comm.debug import CallHistory, CallLog, Family
from mpishard.comm.env import SettingError, settings_from_env
from mpishard.comm.handles import Handle
from mpishard.comm.runner import Runner
from mpishard.comm.stats import CommStats

__all__ = ["Communicator"]


class Communicator:
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
                 timeout: float | None = None, comm_backend: str = DEFAULT_COMM_BACKEND,
                 cuda_aware: bool | None = None, history_size: int = 64,
                 _family: Family | None = None, _owned: bool = False,
                 _cuda_aware_source: str = "the cuda_aware argument", _auto: bool = False):
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
        backend_name, how = choose_comm_backend(comm_backend)
        self.stats = CommStats()
        self.history = CallHistory(history_size)
        self._cuda_aware_override = cuda_aware
        self._cuda_aware_source = _cuda_aware_source
        # split/dup children of an "auto" communicator inherit its choice so far,
        # and a backend chosen by auto may still check their own group
        self._auto = _auto or comm_backend == AUTO
        self._owned = _owned
        self._family = Family(self.timeout) if _family is None else _family
        self._family.add(self)
        self._calls = CallLog(mpi_comm, name, debug=self.debug, watchdog=self._family.watchdog,
                              history=self.history, stats=self.stats)
        setup = BackendSetup(mpi_comm, name, how, auto=self._auto,
                             host_sync=self.timeout is not None)
        self._mpi_backend = MpiBackend(setup, cuda_aware, _cuda_aware_source)
        self._backend = BACKENDS[backend_name].build(setup, self._mpi_backend)
        self._runner = Runner(self._carrier(self._backend), self._calls, self.rank, self.size)

    def _carrier(self, backend: CollectiveBackend) -> CollectiveBackend:
        """What runs this communicator's collectives: ``backend``, or for a group
        of one rank :class:`~mpishard.comm.backends.one_rank.OneRank` (no MPI call)."""
        return OneRank(backend) if self.size == 1 else backend

    @classmethod
    def from_env(cls, mpi_comm, name: str = "world", environ=None, **overrides):
        """Build a Communicator configured from the environment (entry points only).

        Reads ``MPISHARD_DEBUG`` (0/1), ``MPISHARD_TIMEOUT`` (seconds; 0 or empty:
        none), ``MPISHARD_CUDA_AWARE`` (0/1; unset: detect) and
        ``MPISHARD_COMM_BACKEND`` (mpi/nccl/auto); see :mod:`mpishard.comm.env`.
        Keyword ``overrides`` win.

        Raises:
            SettingError: a variable has a value that does not parse on some rank of
                ``mpi_comm``, raised on all of them alike (the message names it, and the
                ranks where not all have it): a rank alone would leave the others waiting.
        """
        environ = os.environ if environ is None else environ
        try:
            settings, problem = settings_from_env(environ), None
            if environ.get("MPISHARD_COMM_BACKEND") and "comm_backend" not in overrides:
                try:                        # a backend this rank cannot run: said alike
                    choose_comm_backend(settings["comm_backend"])
                except ValueError as err:
                    raise SettingError(f"MPISHARD_COMM_BACKEND="
                                       f"{settings['comm_backend']}: {err}") from None
        except SettingError as err:
            settings, problem = {}, str(err)
        problems = mpi_comm.allgather(problem)
        bad = [r for r, text in enumerate(problems) if text is not None]
        if bad:
            where = "" if len(bad) == len(problems) else \
                f" (on rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))})"
            raise SettingError(problems[bad[0]] + where)
        settings.update(overrides)
        if "cuda_aware" in overrides:
            settings.pop("_cuda_aware_source", None)
        return cls(mpi_comm, name, **settings)

    # -- what moves the bytes ------------------------------------------------
    @property
    def comm_backend(self) -> str:
        """The backend of the array collectives (``"mpi"``, ``"nccl"``)."""
        return self._backend.name

    @property
    def comm_backend_how(self) -> str:
        """Why that backend: what ``"auto"`` chose and, after its first device
        collective, what it found."""
        return self._backend.how

    def backend_how_once_bound(self, local_rank: int) -> str:
        """:attr:`comm_backend_how`, or what a backend still to decide will say once
        each rank has bound GPU ``local_rank % visible GPUs`` (collective; decides
        nothing; ``mpishard info`` prints it)."""
        return self._backend.how_once_bound(local_rank, self.all_gather_obj)

    @property
    def cuda_aware(self) -> tuple[bool, str]:
        """``(whether MPI takes device buffers, how that was decided)``."""
        return self._mpi_backend.takes_device_arrays

    # -- derived communicators -------------------------------------------
    def _child(self, mpi_comm, name: str, owned: bool = True) -> "Communicator":
        return Communicator(mpi_comm, name, debug=self.debug, timeout=self.timeout,
                            comm_backend=self.comm_backend,
                            cuda_aware=self._cuda_aware_override,
                            history_size=self.history.maxlen,
                            _family=self._family, _owned=owned,
                            _cuda_aware_source=self._cuda_aware_source, _auto=self._auto)

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
        return self._child(self._dup_mpi(), name or f"{self.name}.dup")

    def _dup_mpi(self):
        """``MPI_Comm_dup`` of this communicator, recorded as a call (collective)."""
        entry = self._calls.begin("dup", None, None)
        try:
            return self.mpi.Dup()
        finally:
            self._calls.end(entry, None, 0)

    def dup_for_thread(self, name: str) -> "Communicator":
        """Duplicate (collective) for use by another thread of each rank: the same
        group, a separate message space, MPI transport of host buffers, and no share
        in this communicator's watchdog or debug fingerprints (their one armed call
        and their call order belong to this thread). Needs MPI_THREAD_MULTIPLE
        (:meth:`thread_level`) where the two threads communicate at once."""
        return Communicator(self._dup_mpi(), name, comm_backend="mpi", _owned=True)

    @staticmethod
    def thread_level() -> str:
        """The thread support MPI was started with: ``"single"``, ``"funneled"``,
        ``"serialized"`` or ``"multiple"``."""
        return {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                MPI.THREAD_SERIALIZED: "serialized",
                MPI.THREAD_MULTIPLE: "multiple"}[MPI.Query_thread()]

    def free(self) -> None:
        """Free a communicator made by ``split``/``dup`` (collective; idempotent)."""
        self._backend.close()
        if self._owned and self.mpi != MPI.COMM_NULL:
            self.mpi.Free()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __repr__(self) -> str:
        backend = self.comm_backend
        extras = "".join([", debug" if self.debug else "",
                          f", timeout={self.timeout:g}s" if self.timeout else "",
                          f", {backend}" if backend != DEFAULT_COMM_BACKEND else ""])
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
        return self._runner.run("all_reduce", True, collectives.all_reduce, buf, op)

    def iall_reduce(self, buf, op: str = "sum") -> Handle:
        """Non-blocking :meth:`all_reduce`; ``handle.wait()`` returns ``buf``."""
        return self._runner.run("iall_reduce", False, collectives.all_reduce, buf, op)

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
        return self._runner.run("reduce_scatter", True, collectives.reduce_scatter,
                                send, recv, op, self.size)

    def ireduce_scatter(self, send, recv=None, op: str = "sum") -> Handle:
        """Non-blocking :meth:`reduce_scatter`; ``handle.wait()`` returns ``recv``."""
        return self._runner.run("ireduce_scatter", False, collectives.reduce_scatter,
                                send, recv, op, self.size)

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
        return self._runner.run("all_gather", True, collectives.all_gather, send, recv,
                                self.size, self.rank)

    def iall_gather(self, send, recv=None) -> Handle:
        """Non-blocking :meth:`all_gather`; ``handle.wait()`` returns ``recv``."""
        return self._runner.run("iall_gather", False, collectives.all_gather, send, recv,
                                self.size, self.rank)

    def broadcast(self, buf, root: int = 0):
        """Copy ``root``'s ``buf`` into every rank's ``buf`` (in place); returns ``buf``."""
        return self._runner.run("broadcast", True, collectives.broadcast, buf, root, self.size)

    def ibroadcast(self, buf, root: int = 0) -> Handle:
        """Non-blocking :meth:`broadcast`; ``handle.wait()`` returns ``buf``."""
        return self._runner.run("ibroadcast", False, collectives.broadcast, buf, root,
                                self.size)

    def all_to_all(self, send, recv=None):
        """Rank ``r`` sends block ``j`` of ``send`` to rank ``j``, receiving into block ``r``.

        Both buffers hold ``size`` equal blocks along the flattened array;
        afterwards block ``j`` of ``recv`` on rank ``r`` is block ``r`` of rank
        ``j``'s ``send`` (MPI_Alltoall). This is how context and expert
        parallelism exchange a sequence or the tokens routed to each expert. It
        runs through MPI (CUDA-aware or staged) also with ``comm_backend="nccl"``.

        Args:
            send: a C-contiguous array whose size is a multiple of ``size``.
            recv: an array of the same size and dtype, not overlapping
                ``send``, or ``None`` to allocate one shaped like ``send``.

        Returns:
            ``recv``.
        """
        return self._runner.run("all_to_all", True, collectives.all_to_all, send, recv,
                                self.size)

    def iall_to_all(self, send, recv=None) -> Handle:
        """Non-blocking :meth:`all_to_all`; ``handle.wait()`` returns ``recv``."""
        return self._runner.run("iall_to_all", False, collectives.all_to_all, send, recv,
                                self.size)

    def all_to_all_v(self, send, send_counts, recv_counts=None, recv=None):
        """Rank ``r`` sends ``send_counts[j]`` rows of ``send`` to rank ``j`` (MPI_Alltoallv).

        ``send``'s rows are grouped by destination (those for rank 0 first);
        afterwards ``recv`` holds the rows from rank 0, then from rank 1, ...
        Counts may be zero (nothing to some rank, or everything to one). This is
        how expert parallelism sends each token to the ranks holding its experts
        and back. It runs through MPI (CUDA-aware or staged) also with
        ``comm_backend="nccl"``.

        Args:
            send: a C-contiguous array of ``sum(send_counts)`` rows.
            send_counts: rows for each rank (``size`` integers).
            recv_counts: rows from each rank, or ``None`` to exchange the counts
                first (one small :meth:`all_to_all` of integers).
            recv: ``sum(recv_counts)`` rows shaped like ``send``'s, or ``None``.

        Returns:
            ``recv``.
        """
        if recv_counts is None:
            recv_counts = self.exchange_counts(send_counts)
        return self._runner.run("all_to_all_v", True, collectives.all_to_all_v, send,
                                send_counts, recv_counts, recv, self.size, self.rank)

    def exchange_counts(self, send_counts) -> list:
        """What each rank will send this one: an all-to-all of one integer per rank."""
        counts = np.asarray([int(c) for c in send_counts], dtype=np.int64)
        if counts.size != self.size:
            raise ValueError(f"exchange_counts: {counts.size} counts for {self.size} ranks; "
                             f"pass one per rank")
        return self.all_to_all(counts).tolist()

    # -- point to point and small objects (see :mod:`.messages`) -------------
    def send(self, buf, dest: int, tag: int = 0) -> None:
        """Send ``buf`` to rank ``dest`` (blocking)."""
        self.isend(buf, dest, tag).wait()

    def recv(self, buf, source: int, tag: int = 0):
        """Receive into ``buf`` from rank ``source`` (blocking); returns ``buf``."""
        return self.irecv(buf, source, tag).wait()

    def isend(self, buf, dest: int, tag: int = 0) -> Handle:
        """Non-blocking :meth:`send`; ``handle.wait()`` returns ``buf``."""
        return messages.isend(self._runner, buf, dest, tag)

    def irecv(self, buf, source: int, tag: int = 0) -> Handle:
        """Non-blocking :meth:`recv`; ``handle.wait()`` returns ``buf``."""
        return messages.irecv(self._runner, buf, source, tag)

    def barrier(self) -> None:
        """Wait until every rank has reached the barrier."""
        entry = self._calls.begin("barrier", None, None)
        try:
            if self.size > 1:
                self.mpi.Barrier()
        finally:
            self._calls.end(entry, "barrier", 0)

    def all_reduce_obj(self, obj, op: str = "sum"):
        """Reduce a small Python value over all ranks (``sum``, ``prod``,
        ``max``, ``min``, ``and``, ``or``); every rank gets the result."""
        return messages.all_reduce_obj(self._calls, self.mpi, obj, op)

    def all_gather_obj(self, obj) -> list:
        """Every rank's ``obj``, as a list indexed by rank, on every rank."""
        return messages.all_gather_obj(self._calls, self.mpi, obj)

    def broadcast_obj(self, obj, root: int = 0):
        """``root``'s ``obj`` on every rank."""
        return messages.broadcast_obj(self._calls, self.mpi, obj, root)

    def gather_obj(self, obj, root: int = 0):
        """Every rank's ``obj`` as a list on ``root``; ``None`` elsewhere."""
        return messages.gather_obj(self._calls, self.mpi, obj, root)

    # -- reports -----------------------------------------------------------
    def format_history(self) -> str:
        """The recent calls of this communicator and its family, oldest first."""
        return self._family.report()

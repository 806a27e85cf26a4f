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

Each array collective goes through the same four steps, in one private method
that serves its blocking and non-blocking forms: check the arguments
(:mod:`~mpishard.comm.checks`; misuse raises before any MPI call); begin the
call (:class:`~mpishard.comm.debug.CallLog`: ledger entry, watchdog, debug
fingerprints, see [Note: collective order]); start the transfer (NCCL, or MPI
on host memory or, per [Note: device buffers], on device memory); finish it
(now, or in ``Handle.wait``: copy back, ``avg`` division, statistics).
"""
from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

from . import checks
from .debug import CallLog, Family, Ledger
from .gpu import DevicePath, detect_cuda_aware
from .handles import Handle
from .nccl import COMM_BACKENDS, NcclGroup, resolve_comm_backend
from .stats import CommStats

__all__ = ["Communicator", "COMM_BACKENDS"]

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _env_flag(environ, var: str) -> bool | None:
    value = environ.get(var)
    if value is None:
        return None
    if value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{var}={value!r} is not a flag; use {var}=1 or {var}=0")


class Communicator:
    """A wrapper around one mpi4py communicator.

    Args:
        mpi_comm: the mpi4py intracommunicator (``MPI.COMM_WORLD``, a ``Dup()``,
            ``MPI.COMM_SELF``, ...). It is used as is; pass a ``Dup()`` to keep
            mpishard's traffic apart from your own.
        name: shown in the ledger and in error messages.
        debug: fingerprint every collective across ranks (see
            [Note: collective order]).
        timeout: seconds after which a stuck collective aborts the job
            (``None``: no watchdog).
        comm_backend: ``"mpi"``, ``"nccl"`` (CuPy arrays via NCCL) or ``"auto"``
            (NCCL when it loads, else MPI).
        cuda_aware: ``True``/``False`` to skip CUDA-aware detection.
        ledger_size: how many collectives the ledger keeps.

    Raises:
        TypeError: ``mpi_comm`` is not an mpi4py intracommunicator.
        ValueError: a bad ``timeout`` or ``comm_backend``.
    """

    def __init__(self, mpi_comm, name: str = "world", *, debug: bool = False,
                 timeout: float | None = None, comm_backend: str = "mpi",
                 cuda_aware: bool | None = None, ledger_size: int = 64,
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
        self.comm_backend = resolve_comm_backend(comm_backend)
        self.stats = CommStats()
        self.ledger = Ledger(ledger_size)
        self._cuda_aware_override = cuda_aware
        self._cuda_aware_source = _cuda_aware_source
        self._cuda_aware: tuple[bool, str] | None = None
        self._device_path_cache: DevicePath | None = None
        self._nccl = None
        self._owned = _owned
        self._family = _family if _family is not None else Family(self.timeout)
        self._family.add(self)
        self._calls = CallLog(mpi_comm, name, debug=self.debug, watchdog=self._family.watchdog,
                              ledger=self.ledger, stats=self.stats)

    @classmethod
    def from_env(cls, mpi_comm, name: str = "world", environ=None, **overrides):
        """Build a Communicator configured from the environment (entry points only).

        Reads ``MPISHARD_DEBUG`` (0/1), ``MPISHARD_TIMEOUT`` (seconds; 0 or empty:
        none), ``MPISHARD_CUDA_AWARE`` (0/1; unset: detect) and
        ``MPISHARD_COMM_BACKEND`` (mpi/nccl/auto). Keyword ``overrides`` win.

        Raises:
            ValueError: a variable has a value that does not parse; the message
                names it.
        """
        environ = os.environ if environ is None else environ
        settings = {"debug": bool(_env_flag(environ, "MPISHARD_DEBUG")),
                    "comm_backend": environ.get("MPISHARD_COMM_BACKEND") or "mpi"}
        raw = environ.get("MPISHARD_TIMEOUT", "").strip()
        try:
            seconds = float(raw) if raw else 0.0
        except ValueError:
            raise ValueError(f"MPISHARD_TIMEOUT={raw!r} is not a number of seconds; "
                             f"use e.g. MPISHARD_TIMEOUT=600 (0: no timeout)") from None
        settings["timeout"] = seconds if seconds > 0 else None
        if environ.get("MPISHARD_CUDA_AWARE", "").strip():
            aware = _env_flag(environ, "MPISHARD_CUDA_AWARE")
            settings["cuda_aware"] = aware
            settings["_cuda_aware_source"] = f"MPISHARD_CUDA_AWARE={int(aware)}"
        settings.update(overrides)
        if "cuda_aware" in overrides:
            settings.pop("_cuda_aware_source", None)
        return cls(mpi_comm, name, **settings)

    # -- derived communicators -------------------------------------------
    def _child(self, mpi_comm, name: str) -> "Communicator":
        return Communicator(mpi_comm, name, debug=self.debug, timeout=self.timeout,
                            comm_backend=self.comm_backend,
                            cuda_aware=self._cuda_aware_override,
                            ledger_size=self.ledger.maxlen,
                            _family=self._family, _owned=True,
                            _cuda_aware_source=self._cuda_aware_source)

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

    # -- device arrays ----------------------------------------------------
    @property
    def cuda_aware(self) -> tuple[bool, str]:
        """``(whether MPI takes device buffers, how that was decided)``."""
        if self._cuda_aware is None:
            self._cuda_aware = detect_cuda_aware(self._cuda_aware_override,
                                                 self._cuda_aware_source)
        return self._cuda_aware

    def _for_mpi(self, a, *, copy_in: bool, copy_out: bool, nonblocking_reduction=False):
        a = checks.wire_view(a)
        if type(a) is np.ndarray:
            return a, None
        if self._device_path_cache is None:
            aware, how = self.cuda_aware
            self._device_path_cache = DevicePath(
                aware, how, stage_nonblocking_reductions=MPI.get_vendor()[0] == "Open MPI")
        return self._device_path_cache.for_mpi(
            a, copy_in=copy_in, copy_out=copy_out,
            nonblocking_reduction=nonblocking_reduction)

    def _nccl_for(self, a):
        """The NCCL group if ``a`` goes through NCCL, else ``None``."""
        if self.comm_backend != "nccl" or type(a) is np.ndarray:
            return None
        if self._nccl is None:
            self._nccl = NcclGroup(self.mpi)
        return self._nccl if self._nccl.supports(a) else None

    # -- completion -------------------------------------------------------
    def _finish(self, entry, kind: str, nbytes: int, result, request=None, after=(),
                keep=(), blocking: bool = True):
        """Complete (blocking) or wrap (non-blocking) a started operation.

        ``request`` is ``None`` once a blocking MPI call has returned; ``after``
        runs at completion (copy back from staging, ``avg`` division), then the
        ledger and statistics are updated.
        """
        def finish():
            for step in after:
                if step is not None:
                    step()
            self._calls.end(entry, kind, nbytes)
        if blocking and request is None:  # the common case: done, no Handle needed
            finish()
            return result
        handle = Handle(request, result, finish, watchdog=self._calls.watchdog, entry=entry,
                        keep=keep)
        return handle.wait() if blocking else handle

    def _divider(self, out, op: str):
        """The completion step of an ``avg``: divide ``out`` by the size, in place."""
        if op != "avg":
            return None

        def divide():
            out[...] /= self.size
        return divide

    # -- reductions -------------------------------------------------------
    # Each array collective is one private method serving its blocking and
    # non-blocking forms: checks, self._calls.begin, start the transfer (NCCL,
    # or MPI on host or device memory), self._finish.
    def all_reduce(self, buf, op: str = "sum"):
        """Reduce ``buf`` over all ranks, in place; every rank gets the result.

        Args:
            buf: a C-contiguous array (overwritten with the result).
            op: ``"sum"``, ``"avg"`` (sum, then divide by ``size``) or ``"max"``.

        Returns:
            ``buf``.
        """
        return self._all_reduce(buf, op, blocking=True)

    def iall_reduce(self, buf, op: str = "sum") -> Handle:
        """Non-blocking :meth:`all_reduce`; ``handle.wait()`` returns ``buf``."""
        return self._all_reduce(buf, op, blocking=False)

    def _all_reduce(self, buf, op, blocking):
        where = "all_reduce" if blocking else "iall_reduce"
        try:
            checks.check_array(buf, where, "buf", output=True)
            mpi_op = checks.check_reduction(buf, op, where)
        except (TypeError, ValueError) as exc:
            self._calls.reject(where, exc)
        entry = self._calls.begin(where, buf.shape, buf.dtype, f"op={op}", nonblocking=not blocking)
        request, after, keep = None, (), ()
        try:
            if self.size > 1:
                group = self._nccl_for(buf)
                if group is not None:
                    request = group.all_reduce(buf, op, host_sync=self.timeout is not None)
                else:
                    view, copy_back = self._for_mpi(buf, copy_in=True, copy_out=True,
                                                    nonblocking_reduction=not blocking)
                    if blocking:
                        self.mpi.Allreduce(MPI.IN_PLACE, view, mpi_op)
                    else:
                        request = self.mpi.Iallreduce(MPI.IN_PLACE, view, mpi_op)
                    after, keep = (copy_back, self._divider(buf, op)), (view,)
        except BaseException:
            self._calls.end(entry, None, 0)
            raise
        return self._finish(entry, "all_reduce", buf.nbytes, buf, request, after, keep, blocking)

    def reduce_scatter(self, send, recv=None, op: str = "sum"):
        """Reduce ``send``'s ``size`` equal blocks; rank ``r`` gets block ``r``.

        Args:
            send: a C-contiguous array whose size is a multiple of ``size``
                (pad it: :func:`mpishard.comm.bucket.padded_size`).
            recv: ``send.size // size`` elements of the same dtype, or ``None``
                to allocate (shape ``(send.shape[0] // size, *rest)`` when the
                first dimension divides, else flat).
            op: ``"sum"``, ``"avg"`` or ``"max"``.

        Returns:
            ``recv``.
        """
        return self._reduce_scatter(send, recv, op, blocking=True)

    def ireduce_scatter(self, send, recv=None, op: str = "sum") -> Handle:
        """Non-blocking :meth:`reduce_scatter`; ``handle.wait()`` returns ``recv``."""
        return self._reduce_scatter(send, recv, op, blocking=False)

    def _reduce_scatter(self, send, recv, op, blocking):
        where = "reduce_scatter" if blocking else "ireduce_scatter"
        try:
            checks.check_array(send, where, "send")
            mpi_op = checks.check_reduction(send, op, where)
            recv = checks.reduce_scatter_recv(send, recv, self.size, where)
        except (TypeError, ValueError) as exc:
            self._calls.reject(where, exc)
        entry = self._calls.begin(where, send.shape, send.dtype, f"op={op}",
                                  nonblocking=not blocking)
        request, after, keep = None, (), (send,)
        try:
            if self.size == 1:
                recv.reshape(-1)[...] = send.reshape(-1)
            elif (group := self._nccl_for(send)) is not None:
                request = group.reduce_scatter(send, recv, op, host_sync=self.timeout is not None)
            else:
                staged = not blocking
                send_view, _ = self._for_mpi(send, copy_in=True, copy_out=False,
                                             nonblocking_reduction=staged)
                recv_view, copy_back = self._for_mpi(recv, copy_in=False, copy_out=True,
                                                     nonblocking_reduction=staged)
                if blocking:
                    self.mpi.Reduce_scatter_block(send_view, recv_view, mpi_op)
                else:
                    request = self.mpi.Ireduce_scatter_block(send_view, recv_view, mpi_op)
                after = (copy_back, self._divider(recv, op))
                keep = (send, send_view, recv_view)
        except BaseException:
            self._calls.end(entry, None, 0)
            raise
        return self._finish(entry, "reduce_scatter", send.nbytes, recv, request, after, keep,
                            blocking)

    # -- gathers and broadcasts --------------------------------------------
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
        return self._all_gather(send, recv, blocking=True)

    def iall_gather(self, send, recv=None) -> Handle:
        """Non-blocking :meth:`all_gather`; ``handle.wait()`` returns ``recv``."""
        return self._all_gather(send, recv, blocking=False)

    def _all_gather(self, send, recv, blocking):
        where = "all_gather" if blocking else "iall_gather"
        try:
            checks.check_array(send, where, "send")
            recv, in_place = checks.all_gather_recv(send, recv, self.size, self.rank, where)
        except (TypeError, ValueError) as exc:
            self._calls.reject(where, exc)
        entry = self._calls.begin(where, send.shape, send.dtype, nonblocking=not blocking)
        request, after, keep = None, (), (send,)
        try:
            if self.size == 1:
                if not in_place:
                    recv.reshape(-1)[...] = send.reshape(-1)
            elif (group := self._nccl_for(send)) is not None:
                request = group.all_gather(send, recv, host_sync=self.timeout is not None)
            else:
                recv_view, copy_back = self._for_mpi(recv, copy_in=False, copy_out=True)
                if in_place and copy_back is None:  # not staged: MPI reads our block of recv
                    send_view = MPI.IN_PLACE
                else:
                    send_view, _ = self._for_mpi(send, copy_in=True, copy_out=False)
                if blocking:
                    self.mpi.Allgather(send_view, recv_view)
                else:
                    request = self.mpi.Iallgather(send_view, recv_view)
                after, keep = (copy_back,), (send, send_view, recv_view)
        except BaseException:
            self._calls.end(entry, None, 0)
            raise
        return self._finish(entry, "all_gather", recv.nbytes, recv, request, after, keep,
                            blocking)

    def broadcast(self, buf, root: int = 0):
        """Copy ``root``'s ``buf`` into every rank's ``buf`` (in place); returns ``buf``."""
        return self._broadcast(buf, root, blocking=True)

    def ibroadcast(self, buf, root: int = 0) -> Handle:
        """Non-blocking :meth:`broadcast`; ``handle.wait()`` returns ``buf``."""
        return self._broadcast(buf, root, blocking=False)

    def _broadcast(self, buf, root, blocking):
        where = "broadcast" if blocking else "ibroadcast"
        try:
            checks.check_array(buf, where, "buf", output=True)
            root = checks.check_root(root, self.size, where)
        except (TypeError, ValueError) as exc:
            self._calls.reject(where, exc)
        entry = self._calls.begin(where, buf.shape, buf.dtype, f"root={root}",
                                  nonblocking=not blocking)
        request, after, keep = None, (), ()
        try:
            if self.size > 1:
                group = self._nccl_for(buf)
                if group is not None:
                    request = group.broadcast(buf, root, host_sync=self.timeout is not None)
                else:
                    view, copy_back = self._for_mpi(buf, copy_in=self.rank == root,
                                                    copy_out=self.rank != root)
                    if blocking:
                        self.mpi.Bcast(view, root)
                    else:
                        request = self.mpi.Ibcast(view, root)
                    after, keep = (copy_back,), (view,)
        except BaseException:
            self._calls.end(entry, None, 0)
            raise
        return self._finish(entry, "broadcast", buf.nbytes, buf, request, after, keep, blocking)

    # -- point to point ----------------------------------------------------
    # Point-to-point calls are not fingerprinted (the two sides legitimately
    # differ) and always use MPI, also with comm_backend="nccl".
    def send(self, buf, dest: int, tag: int = 0) -> None:
        """Send ``buf`` to rank ``dest`` (blocking)."""
        self.isend(buf, dest, tag).wait()

    def recv(self, buf, source: int, tag: int = 0):
        """Receive into ``buf`` from rank ``source`` (blocking); returns ``buf``."""
        return self.irecv(buf, source, tag).wait()

    def isend(self, buf, dest: int, tag: int = 0) -> Handle:
        """Non-blocking :meth:`send`; ``handle.wait()`` returns ``buf``."""
        checks.check_array(buf, "send", "buf")
        dest = checks.check_peer(dest, self.size, self.rank, "send")
        entry = self._calls.begin(f"send->{dest}", buf.shape, buf.dtype, f"tag={tag}", p2p=True,
                            nonblocking=True)
        view, _ = self._for_mpi(buf, copy_in=True, copy_out=False)
        request = self.mpi.Isend(view, dest, tag)
        return self._finish(entry, "send", buf.nbytes, buf, request, keep=(view,),
                            blocking=False)

    def irecv(self, buf, source: int, tag: int = 0) -> Handle:
        """Non-blocking :meth:`recv`; ``handle.wait()`` returns ``buf``."""
        checks.check_array(buf, "recv", "buf", output=True)
        source = checks.check_peer(source, self.size, self.rank, "recv", any_ok=True)
        entry = self._calls.begin(f"recv<-{source}", buf.shape, buf.dtype, f"tag={tag}", p2p=True,
                            nonblocking=True)
        view, copy_back = self._for_mpi(buf, copy_in=False, copy_out=True)
        request = self.mpi.Irecv(view, source, tag)
        return self._finish(entry, "recv", buf.nbytes, buf, request, after=(copy_back,),
                            keep=(view,), blocking=False)

    def barrier(self) -> None:
        """Wait until every rank has reached the barrier."""
        entry = self._calls.begin("barrier", None, None)
        try:
            if self.size > 1:
                self.mpi.Barrier()
        finally:
            self._calls.end(entry, "barrier", 0)

    # -- small Python objects (pickled) -------------------------------------
    def _obj(self, op: str, detail: str, run, local):
        entry = self._calls.begin(op, None, None, detail)
        try:
            return local() if self.size == 1 else run()
        finally:
            self._calls.end(entry, op, 0)

    def all_reduce_obj(self, obj, op: str = "sum"):
        """Reduce a small Python value over all ranks (``sum``, ``prod``,
        ``max``, ``min``, ``and``, ``or``); every rank gets the result."""
        if op not in checks.OBJ_OPS:
            self._calls.reject("all_reduce_obj", ValueError(
                f"all_reduce_obj: unknown op {op!r}; use one of {sorted(checks.OBJ_OPS)}"))
        return self._obj("all_reduce_obj", f"op={op}",
                         lambda: self.mpi.allreduce(obj, checks.OBJ_OPS[op]), lambda: obj)

    def all_gather_obj(self, obj) -> list:
        """Every rank's ``obj``, as a list indexed by rank, on every rank."""
        return self._obj("all_gather_obj", "", lambda: self.mpi.allgather(obj),
                         lambda: [obj])

    def broadcast_obj(self, obj, root: int = 0):
        """``root``'s ``obj`` on every rank."""
        try:
            root = checks.check_root(root, self.size, "broadcast_obj")
        except ValueError as exc:
            self._calls.reject("broadcast_obj", exc)
        return self._obj("broadcast_obj", f"root={root}",
                         lambda: self.mpi.bcast(obj, root), lambda: obj)

    def gather_obj(self, obj, root: int = 0):
        """Every rank's ``obj`` as a list on ``root``; ``None`` elsewhere."""
        try:
            root = checks.check_root(root, self.size, "gather_obj")
        except ValueError as exc:
            self._calls.reject("gather_obj", exc)
        return self._obj("gather_obj", f"root={root}",
                         lambda: self.mpi.gather(obj, root), lambda: [obj])

    # -- reports -----------------------------------------------------------
    def format_ledger(self) -> str:
        """The recent collectives of this communicator and its family, oldest first."""
        return self._family.report()

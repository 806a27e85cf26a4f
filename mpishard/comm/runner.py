"""The machinery behind every array collective: one runner, and the device path.

See [Note: one collective runner] in :mod:`.communicator` and [Note: device
buffers] in :mod:`.gpu`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from mpi4py import MPI

from . import checks
from .gpu import DevicePath, detect_cuda_aware
from .handles import Handle
from .nccl import NcclGroup

__all__ = ["Call", "Runner"]


@dataclass
class Call:
    """One array collective as :meth:`Communicator._run` performs it.

    Attributes:
        name: the blocking form's name (``"all_reduce"``); ``"i" + name`` is the
            non-blocking one.
        kind: the statistics kind (:mod:`~mpishard.comm.stats`).
        nbytes: the message size for the statistics (see [Note: bus bytes]).
        result: what the call (or ``Handle.wait``) returns.
        buffers: ``(array, mpi_reads, mpi_writes)`` per array MPI touches.
        primitives: the mpi4py method names, blocking and non-blocking
            (``("Allreduce", "Iallreduce")``).
        args: maps the buffers as MPI sees them (and their copy-back steps,
            ``None`` when not staged) to the primitive's arguments.
        shape, dtype, detail: what the call history and debug fingerprints show.
        local: what a communicator of one rank does instead (``None``: nothing).
        nccl: ``(group, host_sync) -> request`` for CuPy arrays on the NCCL
            backend (``None``: MPI only).
        divide: an array to divide by the size after an MPI ``avg``.
        reduction: stage device buffers of the non-blocking form on MPI
            libraries that crash on them (see [Note: device buffers]).
    """

    name: str
    kind: str
    nbytes: int
    result: object
    buffers: tuple
    primitives: tuple
    args: Callable
    shape: tuple | None = None
    dtype: object = None
    detail: str = ""
    local: Callable | None = None
    nccl: Callable | None = None
    divide: object = None
    reduction: bool = False
    keep: tuple = field(default_factory=tuple)


class Runner:
    """Mixed into :class:`~mpishard.comm.Communicator` (uses its ``mpi``, ``size``,
    ``rank``, ``comm_backend``, ``timeout``, ``_calls`` and the ``_cuda_aware*``
    settings)."""

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

    # -- the runner (see [Note: one collective runner]) ---------------------
    def _run(self, call: Call, blocking: bool):
        where = call.name if blocking else "i" + call.name
        entry = self._calls.begin(where, call.shape, call.dtype, call.detail,
                                  nonblocking=not blocking)
        request, after, keep = None, [], list(call.keep) + [a for a, _, _ in call.buffers]
        try:
            if self.size == 1:
                if call.local is not None:
                    call.local()
            elif call.nccl is not None and (group := self._nccl_for(call.buffers[0][0])):
                request = call.nccl(group, self.timeout is not None)
            else:
                views, backs = [], []
                for array, reads, writes in call.buffers:
                    view, back = self._for_mpi(array, copy_in=reads, copy_out=writes,
                                               nonblocking_reduction=call.reduction
                                               and not blocking)
                    views.append(view)
                    backs.append(back)
                primitive = getattr(self.mpi, call.primitives[0 if blocking else 1])
                request = primitive(*call.args(views, backs))
                after = [back for back in backs if back is not None]
                if call.divide is not None:
                    after.append(self._divider(call.divide))
                keep += views
        except BaseException:
            self._calls.end(entry, None, 0)
            raise
        return self._finish(entry, call.kind, call.nbytes, call.result, request, after,
                            tuple(keep), blocking)

    def _finish(self, entry, kind: str, nbytes: int, result, request=None, after=(),
                keep=(), blocking: bool = True):
        """Complete (blocking) or wrap (non-blocking) a started operation.

        ``request`` is ``None`` once a blocking MPI call has returned; ``after``
        runs at completion (copy back from staging, ``avg`` division), then the
        call history and statistics are updated.
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

    def _divider(self, out):
        """The completion step of an ``avg``: divide ``out`` by the size, in place."""
        def divide():
            out[...] /= self.size
        return divide

    def _checked(self, where: str, check):
        """Run ``check()``; an argument error is raised through the call log
        (on every rank in debug mode)."""
        try:
            return check()
        except (TypeError, ValueError) as exc:
            self._calls.reject(where, exc)

"""The machinery behind every array collective: one runner, and the device path.

See [Note: one collective runner] in :mod:`.communicator`, [Note: device
buffers] in :mod:`.gpu`, [Note: one GPU per rank] in :mod:`.nccl` and [Note:
16-bit floats on MPI] in :mod:`.checks`.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from mpishard.comm import checks, gpu, nccl
from mpishard.comm.handles import Handle

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
        reduction: the call reduces (float16 reduces in float32 on MPI, see
            [Note: 16-bit floats on MPI]).
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

    #: A communicator of one rank returns before MPI (``Call.local``). The GPU
    #: check sets this to ``False`` on one to drive the MPI and NCCL paths at size 1.
    _local_at_size_one = True

    @property
    def cuda_aware(self) -> tuple[bool, str]:
        """``(whether MPI takes device buffers, how that was decided)``."""
        if self._cuda_aware is None:
            self._cuda_aware = gpu.detect_cuda_aware(self._cuda_aware_override,
                                                     self._cuda_aware_source)
        return self._cuda_aware

    def _for_mpi(self, a, *, copy_in: bool, copy_out: bool, nonblocking: bool = False):
        a = checks.wire_view(a)
        if type(a) is np.ndarray:
            return a, None
        if self._device_path_cache is None:
            aware, how = self.cuda_aware
            self._device_path_cache = gpu.DevicePath(
                aware, how, stage_nonblocking=gpu.mpi_vendor() == "Open MPI")
        return self._device_path_cache.for_mpi(a, copy_in=copy_in, copy_out=copy_out,
                                               nonblocking=nonblocking)

    def _may_use_nccl(self, call: Call) -> bool:
        """Whether ``call`` would go through NCCL (then MPI's datatypes do not matter)."""
        a = call.buffers[0][0]
        return (self.comm_backend == "nccl" and call.nccl is not None
                and type(a) is not np.ndarray and nccl.nccl_dtype(a.dtype) is not None)

    def _nccl_for(self, a):
        """The NCCL group if ``a`` goes through NCCL, else ``None`` (collective the
        first time: the group is built, after the check of [Note: one GPU per rank])."""
        if self.comm_backend != "nccl" or type(a) is np.ndarray:
            return None
        if self._nccl is None:
            if self._auto_backend and self._shared_gpu_fallback():
                return None
            self._nccl = nccl.NcclGroup(self.mpi)
        return self._nccl if self._nccl.supports(a) else None

    def _shared_gpu_fallback(self) -> bool:
        """For ``comm_backend="auto"``: fall back to MPI when two ranks of one node
        use one GPU (collective). Returns whether it fell back."""
        clash = nccl.shared_gpu(nccl.gather_devices(self.mpi))
        self._auto_backend = False          # decided, for this communicator
        if clash is None:
            self.comm_backend_how += "; no two ranks share a GPU"
            return False
        self.comm_backend = "mpi"
        self.comm_backend_how = (f"auto: MPI, not NCCL: {clash}, and NCCL refuses two "
                                 f"ranks on one GPU")
        if self.rank == 0:
            warnings.warn(f"communicator {self.name!r}: {self.comm_backend_how} (bind one "
                          f"GPU per rank, or set comm_backend='mpi')", RuntimeWarning,
                          stacklevel=5)
        return True

    # -- the runner (see [Note: one collective runner]) ---------------------
    def _run(self, call: Call, blocking: bool):
        where = call.name if blocking else "i" + call.name
        entry = self._calls.begin(where, call.shape, call.dtype, call.detail,
                                  nonblocking=not blocking)
        request, after, keep = None, [], list(call.keep) + [a for a, _, _ in call.buffers]
        try:
            if self.size == 1 and self._local_at_size_one:
                if not self._may_use_nccl(call):  # what MPI would need at any size
                    checks.check_wire_dtype(call.buffers[0][0], where)
                if call.local is not None:
                    call.local()
            elif call.nccl is not None and (group := self._nccl_for(call.buffers[0][0])):
                request = call.nccl(group, self.timeout is not None)
            else:
                request, after, views = self._run_mpi(call, blocking, where)
                keep += views
        except BaseException:
            self._calls.end(entry, None, 0)
            raise
        return self._finish(entry, call.kind, call.nbytes, call.result, request, after,
                            tuple(keep), blocking)

    def _run_mpi(self, call: Call, blocking: bool, where: str):
        """Issue ``call`` through MPI; ``(request, completion steps, buffers to keep)``."""
        buffers, divide, narrow = call.buffers, call.divide, None
        if call.reduction and checks.is_float16(buffers[0][0]):
            buffers, divide, narrow = checks.widened(buffers, divide)
        checks.check_wire_dtype(buffers[0][0], where)
        views, backs = [], []
        for array, reads, writes in buffers:
            view, back = self._for_mpi(array, copy_in=reads, copy_out=writes,
                                       nonblocking=not blocking)
            views.append(view)
            backs.append(back)
        primitive = getattr(self.mpi, call.primitives[0 if blocking else 1])
        request = primitive(*call.args(views, backs))
        after = [back for back in backs if back is not None]
        if divide is not None:
            after.append(self._divider(divide))
        if narrow is not None:
            after.append(narrow)
        return request, after, views + [a for a, _, _ in buffers]

    def _finish(self, entry, kind: str, nbytes: int, result, request=None, after=(),
                keep=(), blocking: bool = True):
        """Complete (blocking) or wrap (non-blocking) a started operation.

        ``request`` is ``None`` once a blocking MPI call has returned; ``after``
        runs at completion (copy back from staging, ``avg`` division), then the
        call history and statistics are updated (with the device time of an
        NCCL request, see [Note: bus bytes]).
        """
        device_seconds = getattr(request, "device_seconds", None)

        def finish():
            for step in after:
                if step is not None:
                    step()
            self._calls.end(entry, kind, nbytes, device_seconds)
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

"""The one runner every array collective and point-to-point message goes through.

[Note: one collective runner]
Every array collective is a :class:`~mpishard.comm.collectives.Collective` --
its arrays, what the call history shows, and the call on a backend -- built
after its argument checks (:mod:`~mpishard.comm.collectives`), so misuse
raises before any message. :meth:`Runner.run` then does the same steps for
all of them: begin the call (:class:`~mpishard.comm.debug.CallLog`: call
history, watchdog, debug fingerprints, see [Note: collective order]); ask the
backend whether it can move the dtype; issue the call on the backend ([Note:
collective backends]: MPI on host memory or, per [Note: device buffers], on
device memory, or NCCL; a group of one rank runs on ``OneRank``: nothing
leaves the rank); and finish, now or in ``Handle.wait`` (the backend's
completion steps -- copy back from staging, the ``avg`` division -- then the
statistics). Point-to-point messages take the same path without
fingerprints (their two sides legitimately differ).
"""
from __future__ import annotations

from mpishard.comm.backends.base import CollectiveBackend, Pending
from mpishard.comm.debug import CallLog
from mpishard.comm.handles import Handle

__all__ = ["Runner"]


class Runner:
    """Runs one communicator's collectives on its backend, with its books kept.

    Args:
        backend: what moves the bytes (for a group of one rank, ``OneRank``).
        calls: the communicator's call log (history, fingerprints, watchdog,
            statistics).
        rank, size: this rank and the group's size.
    """

    def __init__(self, backend: CollectiveBackend, calls: CallLog, rank: int, size: int):
        self.backend = backend
        self.calls = calls
        self.rank = rank
        self.size = size

    def run(self, where: str, blocking: bool, build, *args):
        """Build a collective with ``build(*args, where)`` and run it.

        ``where`` is the public name (``"iall_reduce"``). An argument error of
        ``build`` is raised through the call log (on every rank in debug mode).
        Returns the result (blocking) or a :class:`Handle`.
        """
        try:
            collective = build(*args, where)
        except (TypeError, ValueError) as exc:
            self.calls.reject(where, exc)
        entry = self.calls.begin(where, collective.shape, collective.dtype, collective.detail,
                                 nonblocking=not blocking)
        try:
            self.backend.check_dtype(collective.arrays[0], where)
            pending = collective.issue(self.backend, blocking)
        except BaseException:
            self.calls.end(entry, None, 0)
            raise
        return self._finish(entry, collective.kind, collective.nbytes, collective.result,
                            pending, collective.arrays, blocking)

    def message(self, where: str, kind: str, buf, detail: str, issue) -> Handle:
        """Start a point-to-point message (checked by the caller): ``issue(backend)``
        returns its :class:`Pending`; returns its :class:`Handle`."""
        entry = self.calls.begin(where, buf.shape, buf.dtype, detail, p2p=True,
                                 nonblocking=True)
        return self._finish(entry, kind, buf.nbytes, buf, issue(self.backend), (),
                            blocking=False)

    def _finish(self, entry, kind: str, nbytes: int, result, pending: Pending, arrays: tuple,
                blocking: bool):
        """Complete (blocking) or wrap (non-blocking) an issued operation.

        ``pending.request`` is ``None`` once a blocking MPI call has returned;
        ``pending.after`` runs at completion, then the call history and
        statistics are updated (with the device time of an NCCL request, see
        [Note: bus bytes]).
        """
        calls = self.calls

        def finish():
            for step in pending.after:
                step()
            calls.end(entry, kind, nbytes, pending.device_seconds)
        if blocking and pending.request is None:  # the common case: done, no Handle needed
            finish()
            return result
        handle = Handle(pending.request, result, finish, watchdog=calls.watchdog, entry=entry,
                        keep=arrays + pending.keep)
        return handle.wait() if blocking else handle

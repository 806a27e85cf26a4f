"""Handles for non-blocking communication.

A :class:`Handle` is what ``iall_reduce``, ``ireduce_scatter``, ``iall_gather``,
``ibroadcast``, ``isend`` and ``irecv`` return. ``wait()`` blocks until the
operation is complete, runs whatever must happen after completion (the
division of an ``avg``, the copy back from a pinned host buffer, the call history
and statistics), and returns the result buffer. ``test()`` asks without blocking.

Every handle must be waited on (or tested until true) before its buffers are
read or reused, as with MPI requests; the handle keeps the buffers alive until
then.
"""
from __future__ import annotations

import time
from typing import Any, Callable

__all__ = ["Handle", "EventRequest"]


class EventRequest:
    """A CUDA event behind the MPI request interface (``Test``/``Wait``).

    Used for NCCL operations, which complete in stream order.
    """

    def __init__(self, event):
        self.event = event

    def Test(self) -> bool:  # noqa: N802 (MPI naming)
        return bool(self.event.done)

    def Wait(self) -> None:  # noqa: N802 (MPI naming)
        self.event.synchronize()


class Handle:
    """A pending operation; ``wait()`` returns its result buffer.

    Args:
        request: an ``MPI.Request`` (or anything with ``Test``/``Wait``), or
            ``None`` for an operation that is already complete.
        result: what ``wait()`` returns.
        finish: called once after completion (may be ``None``).
        watchdog: armed with ``entry`` while ``wait()`` blocks (may be ``None``).
        entry: the call-history record, completed with the elapsed time.
        keep: objects to keep alive until completion (staging buffers).
    """

    __slots__ = ("_request", "_result", "_finish", "_watchdog", "_entry", "_keep",
                 "_done")

    def __init__(self, request, result: Any, finish: Callable[[], None] | None = None,
                 *, watchdog=None, entry=None, keep=()):
        self._request = request
        self._result = result
        self._finish = finish
        self._watchdog = watchdog
        self._entry = entry
        self._keep = keep
        self._done = False
        if request is None:
            self._complete()

    @classmethod
    def completed(cls, result: Any) -> "Handle":
        """A handle for an operation that finished at issue (``size == 1``)."""
        return cls(None, result)

    @property
    def done(self) -> bool:
        """Whether completion has been observed (by ``wait`` or ``test``)."""
        return self._done

    def test(self) -> bool:
        """Return ``True`` if the operation is complete (never blocks)."""
        if not self._done and self._request.Test():
            self._complete()
        return self._done

    def wait(self) -> Any:
        """Block until complete; return the result buffer."""
        if not self._done:
            watchdog, entry = self._watchdog, self._entry
            if watchdog is not None and entry is not None:
                watchdog.arm(entry)
                try:
                    self._request.Wait()
                finally:
                    watchdog.disarm()
            else:
                self._request.Wait()
            self._complete()
        return self._result

    def _complete(self) -> None:
        self._done = True
        self._request = None
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        if self._entry is not None and self._entry.elapsed is None:
            self._entry.elapsed = time.perf_counter() - self._entry.started
        self._keep = ()

    def __repr__(self) -> str:
        what = self._entry.describe() if self._entry is not None else "operation"
        return f"Handle({what}, {'done' if self._done else 'pending'})"

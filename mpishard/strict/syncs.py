"""The strict module's count of device-to-host reads ("host syncs").

On a GPU, every Python number read from an array (``float(a)``, ``a.item()``,
``if a:``), every ``.get()`` and every operation whose output shape depends on
the data (``nonzero``, boolean-mask indexing) waits for the device to finish
all queued work and copies a value back. A training step that does this per
parameter or per micro-batch stalls the GPU many times a step. The strict
module counts each such read here, so tests can hold code to a budget:

    >>> from mpishard import strict
    >>> a = strict.arange(3)
    >>> strict.syncs.reset()
    >>> float(a.sum())
    3.0
    >>> strict.syncs.count
    1

``with strict.syncs.refused():`` turns every read into a :class:`HostSyncError`
(``repr`` and ``str`` excepted, so error messages still print), to find the
line that reads. ``sites`` counts reads by the line of mpishard (or the test)
that caused them.
"""
from __future__ import annotations

import collections
import contextlib
import sys
import threading

__all__ = ["HostSyncError", "SyncCounter", "syncs"]


class HostSyncError(RuntimeError):
    """A device-to-host read while reads are refused (see :meth:`SyncCounter.refused`)."""


_PACKAGE = __name__.rsplit(".", 1)[0]


def _site() -> str:
    """``file:line`` of the first frame outside this package (the code that read)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_PACKAGE):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


class SyncCounter(threading.local):
    """How many host syncs happened since the last :meth:`reset`, and where."""

    def __init__(self):
        self.count = 0
        self.by_kind: collections.Counter = collections.Counter()
        self.sites: collections.Counter = collections.Counter()
        self.refusing = False
        #: copies to and from host buffers for MPI (:func:`~mpishard.strict.stage_for_mpi`):
        #: on a GPU without CUDA-aware MPI each also waits for the device, but they move
        #: buffers, they read no value the code decides on, so they are not in ``count``
        self.staged = 0

    def reset(self) -> None:
        """Start counting from zero."""
        self.count = 0
        self.staged = 0
        self.by_kind.clear()
        self.sites.clear()

    def record(self, kind: str, refusable: bool = True) -> None:
        """Count one read of ``kind`` (``"float"``, ``"get"``, ...); raise while refused."""
        site = _site()
        if self.refusing and refusable:
            raise HostSyncError(f"host sync ({kind}) at {site} while syncs are refused: "
                                f"keep the value on the device, or read it once per step")
        self.count += 1
        self.by_kind[kind] += 1
        self.sites[f"{site} ({kind})"] += 1

    @contextlib.contextmanager
    def refused(self):
        """Within the block, every host sync raises :class:`HostSyncError`."""
        previous = self.refusing
        self.refusing = True
        try:
            yield self
        finally:
            self.refusing = previous

    @contextlib.contextmanager
    def allowed(self):
        """Within the block, host syncs are counted, not refused (e.g. a test's own reads)."""
        previous = self.refusing
        self.refusing = False
        try:
            yield self
        finally:
            self.refusing = previous


#: the counter every strict array reports to (one per thread)
syncs = SyncCounter()

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

The same counter counts kernel launches (``launches``, ``launches_by_op``):
each operation that computes or writes array memory is one launch (see
:mod:`mpishard.testing.strict` for the list), and ``with strict.syncs.fused(name):``
counts a whole block as the one launch of a fused kernel:

    >>> strict.syncs.reset()
    >>> b = a * 2 + 1                        # two elementwise kernels
    >>> with strict.syncs.fused("axpb"):
    ...     c = a * 2 + 1                    # one fused kernel
    >>> strict.syncs.launches, dict(strict.syncs.launches_by_op)
    (3, {'multiply': 1, 'add': 1, 'axpb': 1})

A host read (``.get()``, ``float``) is a sync, never a launch.

``pageable`` counts the copies of host data onto the device (``asarray`` or ``array``
of host data, a list or a scalar, ``set``, a NumPy array written into a strict one,
a NumPy array or list as an index): on a GPU each is a copy out of pageable host
memory, which a captured CUDA graph cannot hold and which waits for the host.
They are launches too, never reads.

``peek(a)`` is the value of strict array ``a`` as a fused kernel reads it from device
memory: no sync, and only inside a :meth:`~SyncCounter.fused` block.
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
    """How many host syncs (and kernel launches) happened since the last :meth:`reset`,
    and where (and which)."""

    def __init__(self):
        self.count = 0
        self.by_kind: collections.Counter = collections.Counter()
        self.sites: collections.Counter = collections.Counter()
        self.refusing = False
        #: copies to and from host buffers for MPI (:func:`~mpishard.testing.strict.stage_for_mpi`):
        #: on a GPU without CUDA-aware MPI each also waits for the device, but they move
        #: buffers, they read no value the code decides on, so they are not in ``count``
        self.staged = 0
        #: copies of host data onto the device (see the module docstring), and where
        self.pageable = 0
        self.pageable_sites: collections.Counter = collections.Counter()
        #: the outermost :meth:`fused` block's name while in one, else ``None``
        self.fusing: str | None = None
        # launches by operation name, and where :meth:`launch` counts: there, or in a
        # throwaway while fused (one thread-local read and a plain dict update per
        # launch keep counting cheap; a Counter's item update is twice as slow)
        self._by_op: dict = {}
        self._tally: dict = self._by_op

    @property
    def launches(self) -> int:
        """Kernel launches since the last :meth:`reset`."""
        return sum(self._by_op.values())

    @property
    def launches_by_op(self) -> collections.Counter:
        """Kernel launches by operation name (``"add"``, ``"matmul"``, ``"take"``, the
        name of a :meth:`fused` block, ...), as a new Counter."""
        return collections.Counter(self._by_op)

    def reset(self) -> None:
        """Start counting from zero."""
        self.count = 0
        self.staged = 0
        self.pageable = 0
        self.pageable_sites.clear()
        self.by_kind.clear()
        self.sites.clear()
        self._by_op.clear()

    def launch(self, name: str, n: int = 1) -> None:
        """Count ``n`` kernel launches of operation ``name`` (none inside :meth:`fused`)."""
        tally = self._tally
        tally[name] = tally.get(name, 0) + n

    @contextlib.contextmanager
    def fused(self, name: str):
        """The block is one kernel launch named ``name`` (a fused kernel): the array
        operations inside are not counted one by one. A block nested in another
        counts nothing of its own (the outermost one is the kernel)."""
        if self.fusing is not None:
            yield self
            return
        self.fusing, self._tally = name, {}
        try:
            yield self
        finally:
            self.fusing, self._tally = None, self._by_op
            self.launch(name)

    def record(self, kind: str, refusable: bool = True) -> None:
        """Count one read of ``kind`` (``"float"``, ``"get"``, ...); raise while refused."""
        site = _site()
        if self.refusing and refusable:
            raise HostSyncError(f"host sync ({kind}) at {site} while syncs are refused: "
                                f"keep the value on the device, or read it once per step")
        self.count += 1
        self.by_kind[kind] += 1
        self.sites[f"{site} ({kind})"] += 1

    def copy_in(self, n: int = 1) -> None:
        """Count ``n`` copies of host data onto the device (``pageable``), by the line."""
        if n:
            self.pageable += n
            self.pageable_sites[_site()] += n

    def peek(self, a):
        """The value of strict array ``a`` as the kernel of the :meth:`fused` block this
        runs in reads it from device memory: a NumPy copy, no sync. Outside a fused
        block it is a read of the host, so it raises ``RuntimeError``: use ``.get()``."""
        if self.fusing is None:
            raise RuntimeError("syncs.peek outside a fused block: a kernel reads device "
                               "memory, the host reads it with .get() (a sync)")
        return a._a.copy()

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

"""Turning distributed mistakes into errors: call history, fingerprints, watchdog.

[Note: collective order]
MPI matches collectives by order alone: every rank of a communicator must issue
the same collectives, in the same order, with matching buffers. A rank that
skips one, or passes a different shape, makes the others hang or read garbage.
mpishard guards this three ways:

* the **call history**: each communicator remembers its last ``N`` collectives
  (sequence number, op, shape, dtype, elapsed, caller), cheap enough to be on
  always, and printed when the job aborts or times out;
* **debug mode** (``Communicator(debug=True)``, ``MPISHARD_DEBUG=1``): before
  each collective the ranks all-gather a fingerprint (sequence number, op,
  dtype, shape, op details) and any difference raises
  :class:`CollectiveMismatch` on *every* rank, naming the ranks, the op and
  both shapes. Argument errors found by :mod:`mpishard.comm.checks` travel in
  the same fingerprint, so one rank's bad buffer raises on all ranks instead of
  leaving the others waiting;
* the **watchdog** (``timeout=SECONDS``, ``MPISHARD_TIMEOUT``): a collective
  that has not completed after ``timeout`` seconds prints the stuck operation
  and this rank's call histories, then aborts the job. Every rank stuck in a
  collective has its own watchdog, so each of them prints before the job goes.

A communicator and everything split or duplicated from it form a *family*:
they share one watchdog and their call histories are printed together.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from collections import deque

from mpi4py import MPI

__all__ = [
    "CollectiveMismatch",
    "CollectiveTimeout",
    "CallRecord",
    "CallHistory",
    "Family",
    "CallLog",
    "Watchdog",
    "exchange_fingerprints",
    "caller_location",
    "caller_stacklevel",
    "rank_prefix",
]

_COMM_PREFIX = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: Exit code of a job aborted by the watchdog (as coreutils ``timeout``).
TIMEOUT_EXIT_CODE = 124


class CollectiveMismatch(RuntimeError):
    """Ranks issued different collectives (raised on every rank, debug mode)."""


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the communicator's timeout."""


def rank_prefix() -> str:
    """``[mpishard rank R/N]`` with this process's world rank, for messages."""
    return f"[mpishard rank {MPI.COMM_WORLD.Get_rank()}/{MPI.COMM_WORLD.Get_size()}]"


def caller_location() -> tuple[str, int]:
    """File and line of the nearest frame outside ``mpishard/comm``."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_COMM_PREFIX):
        frame = frame.f_back
    if frame is None:
        return ("?", 0)
    return (frame.f_code.co_filename, frame.f_lineno)


def caller_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel, for a warning issued by this function's
    caller, that names the nearest frame outside ``mpishard/comm``."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_COMM_PREFIX):
        frame, level = frame.f_back, level + 1
    return level


class CallRecord:
    """One collective as this rank saw it."""

    __slots__ = ("comm", "seq", "op", "shape", "dtype", "detail", "where",
                 "started", "elapsed")

    def __init__(self, comm: str, seq, op: str, shape, dtype, detail: str = ""):
        self.comm = comm
        self.seq = seq
        self.op = op
        self.shape = shape
        self.dtype = dtype
        self.detail = detail
        self.where = caller_location()
        self.started = time.perf_counter()
        self.elapsed: float | None = None

    @property
    def caller(self) -> str:
        """``dir/file.py:line`` of the code that issued the collective."""
        path, line = self.where
        return f"{os.path.join(*path.split(os.sep)[-2:])}:{line}" if path != "?" else "?"

    def describe(self) -> str:
        """``all_reduce #3 (shape (4,), float32, op=sum)``."""
        seq = "" if self.seq is None else f" #{self.seq}"
        parts = [] if self.shape is None else [f"shape {self.shape}", str(self.dtype)]
        if self.detail:
            parts.append(self.detail)
        return f"{self.op}{seq} ({', '.join(parts)})" if parts else f"{self.op}{seq}"

    def format(self) -> str:
        if self.elapsed is None:
            state = f"RUNNING {time.perf_counter() - self.started:.1f} s"
        else:
            state = f"{self.elapsed * 1e3:.2f} ms"
        return f"{self.comm:<12} {self.describe():<56} {state:<16} {self.caller}"

    def __repr__(self) -> str:
        return f"CallRecord({self.comm!r}, {self.describe()}, {self.caller})"


class CallHistory:
    """The last ``maxlen`` collectives of one communicator, oldest first."""

    def __init__(self, maxlen: int = 64):
        self._entries: deque[CallRecord] = deque(maxlen=maxlen)

    def append(self, entry: CallRecord) -> None:
        self._entries.append(entry)

    def __iter__(self):
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index: int) -> CallRecord:
        return self._entries[index]

    @property
    def maxlen(self) -> int:
        return self._entries.maxlen

    def clear(self) -> None:
        self._entries.clear()

    def format(self) -> str:
        return "\n".join(entry.format() for entry in self._entries)


def exchange_fingerprints(mpi_comm, name: str, key: tuple, where: tuple,
                          error: str | None) -> None:
    """All-gather one fingerprint and raise on every rank if they differ.

    Args:
        mpi_comm: the mpi4py communicator the collective is about to run on.
        name: the communicator's name, for messages.
        key: what must match: ``(seq, op, dtype, shape, detail)``.
        where: ``(file, line)`` of the caller, reported, not compared.
        error: this rank's argument error, or ``None``.

    Raises:
        ValueError: some rank's arguments were rejected (its message, on all).
        CollectiveMismatch: the keys differ; names the ranks and both calls.
    """
    gathered = mpi_comm.allgather((key, where, error))
    errors = [(r, err) for r, (_, _, err) in enumerate(gathered) if err]
    if errors:
        lines = "; ".join(f"rank {r}: {err}" for r, err in errors)
        raise ValueError(f"communicator {name!r} ({len(gathered)} ranks) did not "
                         f"run {key[1]} #{key[0]} because {lines}")
    groups: dict[tuple, list[int]] = {}
    for r, (other, _, _) in enumerate(gathered):
        groups.setdefault(other, []).append(r)
    if len(groups) == 1:
        return
    described = []
    for other, ranks in groups.items():
        seq, op, dtype, shape, detail = other
        file, line = gathered[ranks[0]][1]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        extra = f", {detail}" if detail else ""
        described.append(f"{who} called {op} #{seq} (shape {shape}, dtype "
                         f"{dtype}{extra}) at {os.path.basename(file)}:{line}")
    raise CollectiveMismatch(
        f"collective mismatch on communicator {name!r} ({len(gathered)} ranks): "
        + " but ".join(described)
        + ". Every rank must issue the same collectives in the same order with "
          "matching shapes and dtypes (see [Note: collective order])")


class CallLog:
    """The bookkeeping around every call of one communicator.

    ``begin`` numbers the call (collectives only: point-to-point calls have no
    sequence number), appends a history record, arms the watchdog and, in debug
    mode, exchanges fingerprints; ``end`` records the elapsed time and the
    statistics and disarms; ``reject`` raises an argument error, on every rank
    in debug mode. See [Note: collective order].
    """

    def __init__(self, mpi_comm, name: str, *, debug: bool, watchdog, history: CallHistory, stats):
        self.mpi = mpi_comm
        self.name = name
        self.size = mpi_comm.Get_size()
        self.debug = debug
        self.watchdog = watchdog
        self.history = history
        self.stats = stats
        self.seq = 0

    def reject(self, op: str, error: Exception):
        """Raise ``error``; in debug mode, first make every rank raise too."""
        if self.debug and self.size > 1:
            self.seq += 1
            exchange_fingerprints(self.mpi, self.name, (self.seq, op, None, None, ""),
                                  caller_location(), f"{type(error).__name__}: {error}")
        raise error

    def begin(self, op: str, shape, dtype, detail: str = "", *, p2p: bool = False,
              nonblocking: bool = False) -> CallRecord:
        """Start a call; for a non-blocking one the watchdog is left disarmed
        (``Handle.wait`` arms it)."""
        if not p2p:
            self.seq += 1
        entry = CallRecord(self.name, None if p2p else self.seq, op, shape, dtype, detail)
        self.history.append(entry)
        if self.size == 1:
            return entry
        if self.watchdog is not None:
            self.watchdog.arm(entry)
        if self.debug and not p2p:
            try:
                exchange_fingerprints(self.mpi, self.name,
                                      (self.seq, op, str(dtype), shape, detail),
                                      entry.where, None)
            except Exception:
                self.end(entry, None, 0)
                raise
        if nonblocking and self.watchdog is not None:
            self.watchdog.disarm()
        return entry

    def end(self, entry: CallRecord, kind: str | None, nbytes: int,
            device_seconds=None) -> None:
        """Finish a call: elapsed time, watchdog off, statistics under ``kind``.

        ``device_seconds`` (a callable) replaces the host's elapsed time in the
        statistics for a call the host did not wait for (NCCL): it is called
        when the statistics are read.
        """
        entry.elapsed = time.perf_counter() - entry.started
        if self.watchdog is not None:
            self.watchdog.disarm()
        if kind is None:
            return
        if device_seconds is None:
            self.stats.record(kind, nbytes, self.size, entry.elapsed)
        else:
            self.stats.record_deferred(kind, nbytes, self.size, device_seconds)


class Family:
    """A communicator and its split/dup descendants: one watchdog, shared call histories."""

    def __init__(self, timeout: float | None, on_timeout=None):
        self.timeout = timeout
        self._members: list[weakref.ref] = []
        self.watchdog = (Watchdog(timeout, self.report, on_timeout)
                         if timeout else None)

    def add(self, communicator) -> None:
        self._members = [m for m in self._members if m() is not None]
        self._members.append(weakref.ref(communicator))

    def report(self, last: int = 40) -> str:
        """The most recent ``last`` history records of every live member."""
        entries = []
        for ref in self._members:
            member = ref()
            if member is not None:
                entries.extend(member.history)
        entries.sort(key=lambda e: e.started)
        lines = [entry.format() for entry in entries[-last:]]
        return "\n".join(lines) if lines else "(no collectives yet)"


class Watchdog:
    """Aborts the job when an armed collective outlives ``timeout`` seconds.

    The communicator arms it around every blocking call (``arm`` stores one
    reference, ``disarm`` clears it); a daemon thread wakes every
    ``timeout / 10`` seconds (at most 1 s) and looks. mpi4py releases the GIL
    inside MPI calls, so the thread runs while the main thread is blocked, and
    the normal path pays two attribute stores per collective.

    Args:
        timeout: seconds a collective may take.
        report: returns the call-history text to print.
        on_timeout: called with the :class:`CollectiveTimeout` after printing;
            the default waits ``grace`` seconds (so other stuck ranks can print
            too) and calls ``MPI.COMM_WORLD.Abort(124)``.
        grace: see ``on_timeout``.
    """

    def __init__(self, timeout: float, report, on_timeout=None, grace: float = 1.0):
        self.timeout = float(timeout)
        self.grace = grace
        self._report = report
        self._on_timeout = on_timeout or self._abort
        self._armed: tuple[CallRecord, float] | None = None
        self._fired = False
        self._thread: threading.Thread | None = None
        self._poll = min(1.0, max(0.02, self.timeout / 10))

    def arm(self, entry: CallRecord) -> None:
        """Watch ``entry`` from now on (replaces any armed entry)."""
        self._armed = (entry, time.perf_counter())
        if self._thread is None:
            self._thread = threading.Thread(
                target=_watch, args=(weakref.ref(self), self._poll),
                name="mpishard-watchdog", daemon=True)
            self._thread.start()

    def disarm(self) -> None:
        """Stop watching."""
        self._armed = None

    def check(self, now: float | None = None) -> bool:
        """Fire if the armed collective is overdue; return whether it fired."""
        armed = self._armed
        if armed is None or self._fired:
            return False
        entry, since = armed
        waited = (time.perf_counter() if now is None else now) - since
        if waited <= self.timeout:
            return False
        self._fired = True
        error = CollectiveTimeout(
            f"{entry.describe()} on communicator {entry.comm!r}, called at "
            f"{entry.caller}, did not complete within {self.timeout:g} s "
            f"(waited {waited:.1f} s): some rank skipped it, issued a different "
            f"collective, or is stuck (see [Note: collective order])")
        prefix = rank_prefix()
        text = (f"{prefix} CollectiveTimeout: {error}\n{prefix} last collectives "
                f"on this rank (oldest first):\n"
                + "\n".join(f"{prefix}   {line}" for line in self._report().splitlines()))
        print(text, file=sys.stderr, flush=True)
        self._on_timeout(error)
        return True

    def _abort(self, error: CollectiveTimeout) -> None:
        # a run that ends within the grace still aborts, as it leaves (it exited 0)
        atexit.register(MPI.COMM_WORLD.Abort, TIMEOUT_EXIT_CODE)
        time.sleep(self.grace)
        MPI.COMM_WORLD.Abort(TIMEOUT_EXIT_CODE)


def _watch(ref, poll: float) -> None:
    # Holds only a weak reference, so a dropped communicator family ends it.
    while True:
        time.sleep(poll)
        watchdog = ref()
        if watchdog is None or watchdog._fired:
            return
        watchdog.check()
        del watchdog

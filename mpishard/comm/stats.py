"""Bytes moved and time spent per collective kind.

Each :class:`~mpishard.comm.Communicator` keeps one :class:`CommStats`. A
training loop resets it every step and prints it next to the theory (data
parallelism moves 2Ψ bytes per step through its all-reduce, ZeRO-3 3Ψ).

[Note: bus bytes]
``bytes`` is the message size in the nccl-tests sense and ``bus_bytes`` is what
each rank's link carries in an optimal ring, so bus bandwidth is comparable
across collectives and world sizes (nccl-tests, doc/PERFORMANCE.md). With ``n``
ranks and message size ``S``:

=================  ===========================  ======================
collective         S                            bus bytes
=================  ===========================  ======================
all-reduce         the buffer                   2 (n - 1) / n * S
reduce-scatter     the full (send) buffer       (n - 1) / n * S
all-gather         the full (receive) buffer    (n - 1) / n * S
broadcast          the buffer                   S
all-to-all         the send buffer              (n - 1) / n * S
all-to-all-v       the rows sent to other ranks S
send / recv        the buffer                   S
barrier, *_obj     0 (calls and time only)      0
=================  ===========================  ======================

At ``n == 1`` every collective has zero bus bytes (nothing leaves the rank).
Seconds are wall time on this rank from issue to completion; for a
non-blocking collective that includes whatever the caller overlapped with it.
NCCL collectives return before they run (see [Note: NCCL streams]), so theirs
are the device time between CUDA events recorded around them, read -- waiting
for those events -- when the statistics are read, not on the hot path.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

__all__ = ["CommStats", "KindStats", "bus_bytes"]

_BUS_FACTORS = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0 if n > 1 else 0.0,
    "all_to_all": lambda n: (n - 1) / n,
    "all_to_all_v": lambda n: 1.0 if n > 1 else 0.0,
    "send": lambda n: 1.0 if n > 1 else 0.0,
    "recv": lambda n: 1.0 if n > 1 else 0.0,
}


def bus_bytes(kind: str, nbytes: int, size: int) -> int:
    """Bus bytes of one collective (see [Note: bus bytes]).

    Args:
        kind: ``"all_reduce"``, ``"reduce_scatter"``, ``"all_gather"``,
            ``"broadcast"``, ``"all_to_all"``, ``"all_to_all_v"``, ``"send"`` or ``"recv"``
            (anything else: 0).
        nbytes: the message size ``S`` as defined in the note.
        size: the number of ranks ``n``.
    """
    factor = _BUS_FACTORS.get(kind)
    return 0 if factor is None else int(round(factor(size) * nbytes))


@dataclass
class KindStats:
    """Totals for one collective kind."""

    calls: int = 0
    bytes: int = 0
    bus_bytes: int = 0
    seconds: float = 0.0

    @property
    def bus_bandwidth(self) -> float:
        """Bus bytes per second (0 when no time was spent)."""
        return self.bus_bytes / self.seconds if self.seconds > 0 else 0.0


class CommStats:
    """Per-kind counters of one communicator; reset them once per step.

        >>> stats = CommStats()
        >>> stats.record("all_reduce", nbytes=400, size=4, seconds=1e-3)
        >>> stats.snapshot()["all_reduce"]["bus_bytes"]
        600
    """

    def __init__(self):
        self._kinds: dict[str, KindStats] = {}
        self._factors: dict[tuple[str, int], float] = {}  # (kind, size) -> bus factor
        self._pending: list[tuple[KindStats, Callable[[], float]]] = []

    def record(self, kind: str, nbytes: int, size: int, seconds: float) -> None:
        """Add one call of ``kind`` moving a message of ``nbytes`` bytes."""
        entry = self._kinds.get(kind)
        if entry is None:
            entry = self._kinds[kind] = KindStats()
        entry.calls += 1
        entry.seconds += seconds
        if nbytes:
            factor = self._factors.get((kind, size))
            if factor is None:
                factor = self._factors[kind, size] = bus_bytes(kind, 2**40, size) / 2**40
            entry.bytes += nbytes
            entry.bus_bytes += int(round(factor * nbytes))

    def record_deferred(self, kind: str, nbytes: int, size: int,
                        seconds: Callable[[], float]) -> None:
        """Like :meth:`record`, with ``seconds()`` called when the statistics are
        next read (device time of a call the host did not wait for)."""
        self.record(kind, nbytes, size, 0.0)
        self._pending.append((self._kinds[kind], seconds))

    def _settle(self) -> None:
        pending, self._pending = self._pending, []
        for entry, seconds in pending:
            entry.seconds += seconds()

    def reset(self) -> None:
        """Forget everything (call at the start of each step)."""
        self._kinds.clear()
        self._pending.clear()

    def __getitem__(self, kind: str) -> KindStats:
        self._settle()
        return self._kinds.get(kind, KindStats())

    def kinds(self) -> list[str]:
        """Kinds with at least one call, in first-use order."""
        return list(self._kinds)

    def snapshot(self) -> dict[str, dict]:
        """A plain copy: ``{kind: {calls, bytes, bus_bytes, seconds}}``."""
        self._settle()
        return {kind: asdict(entry) for kind, entry in self._kinds.items()}

    @property
    def total_bytes(self) -> int:
        """Message bytes over all kinds."""
        return sum(e.bytes for e in self._kinds.values())

    @property
    def total_bus_bytes(self) -> int:
        """Bus bytes over all kinds."""
        return sum(e.bus_bytes for e in self._kinds.values())

    @property
    def total_seconds(self) -> float:
        """Seconds over all kinds."""
        self._settle()
        return sum(e.seconds for e in self._kinds.values())

    @classmethod
    def merged(cls, *stats: "CommStats") -> "CommStats":
        """Sum several communicators' stats (e.g. the axes of a mesh)."""
        out = cls()
        for one in stats:
            one._settle()
            for kind, entry in one._kinds.items():
                mine = out._kinds.setdefault(kind, KindStats())
                mine.calls += entry.calls
                mine.bytes += entry.bytes
                mine.bus_bytes += entry.bus_bytes
                mine.seconds += entry.seconds
        return out

    def format(self) -> str:
        """A small table, one line per kind."""
        self._settle()
        lines = [f"{'collective':<16}{'calls':>7}{'MiB':>11}{'bus MiB':>11}"
                 f"{'seconds':>10}{'bus GB/s':>10}"]
        for kind, e in self._kinds.items():
            lines.append(
                f"{kind:<16}{e.calls:>7}{e.bytes / 2**20:>11.2f}"
                f"{e.bus_bytes / 2**20:>11.2f}{e.seconds:>10.4f}"
                f"{e.bus_bandwidth / 1e9:>10.2f}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CommStats({self.snapshot()})"

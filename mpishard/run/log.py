"""One rank-aware logger for all output (no ``if rank == 0:`` in the loop).

``RankLogger.info`` prints on rank 0 only; ``all`` prints on every rank with a
``[rank N]`` prefix; ``own`` prints nothing and goes to this rank's file only.
With ``log_dir`` every rank appends what it logs itself to
``log_dir/rank-N.log``: rank 0's file has the run's lines, every rank's file its
own step times, memory and collective waits (``mpishard train`` writes those).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

__all__ = ["RankLogger"]


class RankLogger:
    """Print on rank 0; optionally keep one log file per rank."""

    def __init__(self, rank: int, log_dir: str | Path | None = None, stream=None):
        self.rank = rank
        self.stream = stream or sys.stdout
        self._file = None
        if log_dir is not None:
            path = Path(log_dir)
            path.mkdir(parents=True, exist_ok=True)
            self._file = open(path / f"rank-{rank}.log", "a", encoding="utf-8")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _to_file(self, message: str) -> None:
        if self._file is not None:
            self._file.write(f"{time.strftime('%H:%M:%S')} {message}\n")
            self._file.flush()

    def info(self, message: str) -> None:
        """Print on rank 0 (and log it in rank 0's file)."""
        if self.rank == 0:
            self._to_file(message)
            print(message, file=self.stream, flush=True)

    def own(self, message: str) -> None:
        """Log in this rank's own file only (every rank its own figures)."""
        self._to_file(message)

    def all(self, message: str) -> None:
        """Print on every rank, prefixed with the rank."""
        self._to_file(message)
        print(f"[rank {self.rank}] {message}", file=self.stream, flush=True)

    def error(self, message: str) -> None:
        """One line on rank 0's stderr (and in every rank's file)."""
        self._to_file("error: " + message)
        if self.rank == 0:
            print(f"mpishard: error: {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

"""Checkpoints written on a thread while training goes on: ``--checkpoint-async``.

    saver = BackgroundSaver(world)                 # collective: a communicator of its own
    saver.reserve(strategy, opt)                   # the host copies, allocated up front
    saver.save("ckpt", step, strategy, opt, extra_state=extra, keep_last=3)
    ...                                            # train; the files are being written
    saver.close()                                  # waits for the last save

[Note: background saves]
A save has three phases. **Copy**, on the training thread: every rank copies
its owned pieces to host memory it alone holds (:class:`Snapshot`, a
device-to-host copy on a GPU, a copy of its buffers on a CPU); from then on
training may overwrite its parameters and optimizer state. **Write** and
**commit**, on a writer thread: exactly the synchronous save's steps (see
[Note: atomic commit]), with their agreements over a duplicate of the world
communicator that only writer threads use, so they never meet the training
thread's collectives (this needs MPI's ``MPI_THREAD_MULTIPLE``, which mpi4py
asks for). At most one save is in flight: the next :meth:`BackgroundSaver.save`
first waits for the one before, and so does the end of a run
(:meth:`BackgroundSaver.close`), so a run that ends or is signalled has its
last checkpoint committed before it exits.

A writer that fails raises the same :class:`CheckpointError` on every rank
(its agreements are collective), but on the writer thread; the training
thread raises it at its next :meth:`save` or :meth:`close`, which every rank
reaches at the same step, so no rank stops alone. A kill in any phase leaves
what a killed synchronous save leaves: the previous checkpoint is the newest
complete one, and the next save removes the ``step-N.tmp``.

The copy costs host memory of the size of the rank's shards, allocated before
training (:meth:`BackgroundSaver.reserve`) and reused by every save (fresh memory would cost a page
fault per page, about 50 times the copy itself), and one memory copy of them
per save (0.06 s per GiB measured on a CPU core); the writer's file writes,
hashing and fsyncs release the interpreter's lock.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

from mpishard.checkpoint.collective import agree
from mpishard.checkpoint.format import step_dir_name
from mpishard.checkpoint.writer import Snapshot, check_arguments, strategy_of, write_snapshot

__all__ = ["BackgroundSaver", "SaveOutcome"]


class SaveOutcome:
    """A background save: its directory, its times, its error once it has finished, and
    whether the run has said so (``reported``)."""

    def __init__(self, path: Path, copy_s: float):
        self.path, self.copy_s = path, copy_s
        self.write_s: float | None = None
        self.error: BaseException | None = None
        self.reported = False


class BackgroundSaver:
    """Saves checkpoints with their writing on a thread (see [Note: background saves]).

    Args:
        world: every rank that saves (collective: duplicates it).

    Raises:
        RuntimeError: on every rank, when MPI was started without
            ``MPI_THREAD_MULTIPLE`` and the world has more than one rank.
    """

    def __init__(self, world):
        if world.size > 1:
            level = world.thread_level()
            if level != "multiple":
                raise RuntimeError(f"asynchronous checkpoints need MPI_THREAD_MULTIPLE; MPI "
                                   f"was started with thread level {level!r}: leave out "
                                   f"--checkpoint-async, or start MPI with mpi4py's "
                                   f"rc.thread_level = 'multiple' (its default)")
        self.world = world
        self._comm = world.dup_for_thread("checkpoint-writer")
        self._thread: threading.Thread | None = None
        self._outcome: SaveOutcome | None = None
        self._staging: dict = {}          # host copies, reused save after save

    def reserve(self, strategy, optimizer=None) -> int:
        """Allocate (and touch) the host copies of this rank's pieces now, before
        training, rather than at the first save; their bytes. Local."""
        snapshot = Snapshot.take(strategy, optimizer, self.world, 0, None,
                                 staging=self._staging)
        return snapshot.nbytes

    def save(self, directory, step: int, strategy, optimizer=None, *,
             extra_state: dict | None = None, keep_last: int | None = None) -> Path:
        """Wait for the save before (raising its error), copy this rank's pieces, and
        start writing them; returns the directory the save will commit. Collective."""
        self.wait()
        check_arguments(step, keep_last)
        strategy = strategy_of(strategy, "BackgroundSaver.save")
        t0 = time.perf_counter()
        err = None
        try:
            snapshot = Snapshot.take(strategy, optimizer, self.world, int(step), extra_state,
                                     staging=self._staging)
        except Exception as exc:  # noqa: BLE001 -- agreed below
            err = exc
        agree(self.world, err, f"copying step {step} for a checkpoint")
        path = Path(directory) / step_dir_name(int(step))
        self._outcome = SaveOutcome(path, time.perf_counter() - t0)
        self._thread = threading.Thread(target=self._write, name="mpishard-checkpoint-writer",
                                        args=(directory, snapshot, keep_last, self._outcome),
                                        daemon=True)
        self._thread.start()
        return path

    def _write(self, directory, snapshot, keep_last, outcome: SaveOutcome) -> None:
        t0 = time.perf_counter()
        try:
            write_snapshot(directory, snapshot.step, snapshot, self._comm, keep_last=keep_last)
        except BaseException as exc:  # noqa: BLE001 -- the training thread raises it
            outcome.error = exc
        outcome.write_s = time.perf_counter() - t0

    def finished(self) -> SaveOutcome | None:
        """The save in flight if its writer has finished (without raising its error)."""
        if self._thread is not None and not self._thread.is_alive():
            return self._outcome
        return None

    def wait(self) -> SaveOutcome | None:
        """Wait for the save in flight; its outcome (``None`` if there was none).

        Raises:
            CheckpointError: the save failed (on every rank alike).
        """
        if self._thread is None:
            return None
        self._thread.join()
        self._thread, outcome = None, self._outcome
        if outcome.error is not None:
            raise outcome.error
        return outcome

    def close(self) -> SaveOutcome | None:
        """Wait for the last save, free the writers' communicator; the last outcome."""
        try:
            return self.wait()
        finally:
            self._comm.free()

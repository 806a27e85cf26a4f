"""Failure injection for tests: a job's ranks fail where a test says.

A test puts this folder first on ``PYTHONPATH`` of a job; every Python process
of the job imports this module as it starts, and it acts on the rank that
``PMI_RANK`` (MPICH) or ``OMPI_COMM_WORLD_RANK`` (Open MPI) names:

``MPISHARD_TEST_FAIL_AT_START=RANK:N:COUNTER``
    rank RANK starts MPI and exits with status 1 (as a rank on a broken node,
    or one missing a library, fails before its first step) while the counter
    file holds fewer than N marks, adding one each time. It fails after
    MPI_Init, not before: under MPICH's launcher (Hydra) a rank that exits
    before MPI_Init leaves the others waiting in MPI_Init, and the job never
    ends (docs/checkpoints.md says what to do about such a hang).

``MPISHARD_TEST_KILL_IN_SAVE=RANK:STEP:PHASE[:ONCE]``
    rank RANK SIGKILLs itself in one phase of the save of step STEP (only while
    the file ONCE does not exist, creating it as it dies, if ONCE is given; see
    [Note: background saves]): ``copy`` (while it copies its pieces),
    ``write`` (after its shard file's first tensor, or half its data, the rest
    unwritten) or
    ``commit`` (rank 0 only: after the manifest is written into
    ``step-N.tmp``, before the rename that commits it).

``MPISHARD_TEST_SLOW_SAVE=SECONDS``
    every rank's shard file takes SECONDS longer to write (a sleep before it is
    closed), as on a slow file system: a background save stays in flight for
    several steps.

Nothing here is in mpishard's own code paths: the hooks wrap its functions
from outside, and only in processes that these variables reach.
"""
import os
import signal
import sys

_RANK = next((os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK") if v in os.environ),
             None)


def _die(what: str, once: str | None = None) -> None:
    if once:
        open(once, "w").close()
    sys.stderr.write(f"test: rank {_RANK} killed {what}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _fail_at_start(spec: str) -> None:
    want, times, counter = spec.split(":", 2)
    if _RANK != want:
        return
    try:
        done = len(open(counter).read())
    except OSError:
        done = 0
    if done < int(times):
        with open(counter, "a") as f:
            f.write("x")
        sys.stderr.write(f"test: rank {_RANK} fails at start-up ({done + 1} of {times})\n")
        sys.stderr.flush()
        from mpi4py import MPI      # noqa: F401  (MPI_Init)
        os._exit(1)                 # site would catch SystemExit and go on


def _kill_in_save(spec: str) -> None:
    want, step, phase, *once = spec.split(":", 3)
    once = once[0] if once else None
    if _RANK != want or (once and os.path.exists(once)):
        return
    step = int(step)
    from mpishard.checkpoint import shards, writer

    if phase == "copy":
        take = writer.Snapshot.take.__func__

        def take_and_die(cls, strategy, optimizer, world, at, extra_state, **options):
            if at == step:
                _die(f"copying step {at}", once)
            return take(cls, strategy, optimizer, world, at, extra_state, **options)
        writer.Snapshot.take = classmethod(take_and_die)
    elif phase == "write":
        write, write_all = shards.SafetensorsWriter.write, shards.SafetensorsWriter.write_all

        def write_and_die(self, key, array):
            write(self, key, array)
            if self.path.parent.name == f"step-{step}.tmp":
                self._f.flush()
                _die(f"writing {self.path.parent.name}/{self.path.name}", once)

        def write_half_and_die(self, data, **options):
            if self.path.parent.name != f"step-{step}.tmp":
                return write_all(self, data, **options)
            self._f.write(memoryview(data).cast("B")[:data.nbytes // 2])
            self._f.flush()
            _die(f"writing {self.path.parent.name}/{self.path.name}", once)
        shards.SafetensorsWriter.write = write_and_die
        shards.SafetensorsWriter.write_all = write_half_and_die
    elif phase == "commit":
        fsync = writer.fsync_path

        def fsync_and_die(path):
            fsync(path)
            if os.path.basename(str(path)) == f"step-{step}.tmp":
                _die(f"committing step-{step} (manifest written, not renamed)", once)
        writer.fsync_path = fsync_and_die
    else:
        raise SystemExit(f"MPISHARD_TEST_KILL_IN_SAVE: phase {phase!r} is not copy, write "
                         f"or commit")


def _slow_save(seconds: float) -> None:
    import time

    from mpishard.checkpoint import shards

    close = shards.SafetensorsWriter.close

    def sleep_and_close(self):
        time.sleep(seconds)
        return close(self)
    shards.SafetensorsWriter.close = sleep_and_close


if _RANK is not None:
    if os.environ.get("MPISHARD_TEST_FAIL_AT_START"):
        _fail_at_start(os.environ["MPISHARD_TEST_FAIL_AT_START"])
    if os.environ.get("MPISHARD_TEST_KILL_IN_SAVE"):
        _kill_in_save(os.environ["MPISHARD_TEST_KILL_IN_SAVE"])
    if os.environ.get("MPISHARD_TEST_SLOW_SAVE"):
        _slow_save(float(os.environ["MPISHARD_TEST_SLOW_SAVE"]))

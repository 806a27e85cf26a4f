"""Stop cleanly on SIGTERM, SIGUSR1 or Ctrl-C: finish the step, save a checkpoint, exit.

Slurm signals a job before it ends when asked to (``sbatch --signal=USR1@120``
or ``srun --signal=USR1@120``: SIGUSR1 two minutes before the time limit), and
sends SIGTERM on ``scancel`` or preemption, SIGKILL ``KillWait`` seconds later.
A handler that only sets a flag lets the current step finish; the loop then
agrees over ranks (a rank may get the signal a step later than another, or
not at all) and every rank saves and leaves::

    with StopSignals() as stop:
        while step < steps:
            train_step()
            step += 1
            stopping = stop.should_stop(world)           # collective, every step
            if stopping or step % interval == 0:
                save_checkpoint(ckpt_dir, step, strategy, opt, extra_state=...)
            if stopping:
                break                                    # and exit with status 0
                                                         # (130 after Ctrl-C)

Ctrl-C (SIGINT, which a terminal sends to mpiexec and every rank) is caught only
when asked for (``StopSignals(INTERRUPT_TOO)``); a second Ctrl-C on a rank raises
``KeyboardInterrupt`` there, for a user who will not wait for the step to end.
"""
from __future__ import annotations

import signal

import numpy as np

__all__ = ["StopSignals", "INTERRUPT_TOO"]

#: the signals of a training run at a keyboard: Slurm's two and Ctrl-C
INTERRUPT_TOO = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopSignals:
    """Turn signals into a flag the training loop checks; a context manager.

    Args:
        signals: the signals to catch (default SIGTERM and SIGUSR1). Their
            previous handlers come back on exit. Install from the main thread.

    Attributes:
        received: the name of the first signal caught (``"SIGTERM"``), or ``None``.
        interrupted: after :meth:`should_stop`, whether some rank's signal was Ctrl-C
            (the same on every rank; a run then exits with status 130, as a shell
            reports a program Ctrl-C ended).
    """

    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1)):
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.received: str | None = None
        self.interrupted = False
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
        elif signum == signal.SIGINT:    # Ctrl-C twice: do not wait for the step
            raise KeyboardInterrupt

    @property
    def requested(self) -> bool:
        """Whether this rank caught a signal (local; see :meth:`should_stop`)."""
        return self.received is not None

    def should_stop(self, comm) -> bool:
        """Whether any rank of ``comm`` caught a signal: the same answer on every rank.

        Collective (one 1-element all-reduce): call it at the same point on every rank.
        """
        flag = np.array([0.0 if self.received is None else
                         2.0 if self.received == "SIGINT" else 1.0])
        comm.all_reduce(flag, op="max")
        self.interrupted = bool(flag[0] == 2)
        return bool(flag[0] > 0)

    def install(self) -> "StopSignals":
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def __enter__(self) -> "StopSignals":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

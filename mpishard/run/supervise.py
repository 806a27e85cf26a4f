"""``mpishard supervise``: run a training job; restart it from its newest checkpoint if it fails.

    mpishard supervise --max-restarts 5 -- mpiexec -n 4 python -m mpi4py -m mpishard train \\
        --config run.toml --checkpoint-dir ckpt

[Note: supervised restarts]
The supervisor is one plain process (no MPI) that starts the job's command and
waits for it. How the job ended decides what follows:

* status 0: done; 2: a usage or configuration error, which a restart would
  repeat (final); 3: the loss diverged (not finite), which a restart from the
  last checkpoint would repeat too (final); 130: Ctrl-C, the run saved and a person wants it stopped
  (final); the supervisor's own SIGTERM or SIGUSR1 (Slurm's warning) is passed
  to the job as SIGUSR1 (which MPICH's and Open MPI's launchers pass on to the
  ranks; Open MPI's ends the job on SIGTERM), the job saves and stops, and that
  is final too; Ctrl-C reaches the job's launcher from the terminal itself (one
  process group), so the supervisor passes nothing on (a second SIGINT would stop
  the ranks without their save): it waits for the job to stop and exits 130;
* anything else (a rank killed, a node lost, an abort): restart, after
  ``backoff`` seconds (doubling each time, at most 60), up to
  ``max_restarts`` times. The restarted command continues the run
  (``--resume true``, in place of a ``--resume-from`` the command gives, which
  named where the first attempt began) when ``checkpoint_dir`` holds a complete
  checkpoint, and otherwise starts it again as the first attempt did: from that
  ``--resume-from``, or from step 0 (its metrics file then keeps only its events).

Each restart is one line on stdout and one record in the run's metrics file,
``{"event": "restart", "attempt": ..., "exit_code": ..., "cause": ..., "resume":
...}``, with the cause: the exit status, the signal that ended the launcher,
and the first rank that reported a failure (``[mpishard rank R/N]`` on stderr,
which the supervisor passes through as it reads it, or the rank Open MPI's
launcher saw end first). Records without a
``"step"`` are events: a resumed run keeps them (see :class:`MetricsFile`).

With ``ranks`` (``--ranks 4,2``), ``{ranks}`` in the command is the number of
ranks of each attempt: the first attempt takes the first, each restart the
next, the last one for the rest. A run resumed on fewer data-parallel ranks
keeps its global batch only when ``--global-batch`` is given (the restarted
command adds the first attempt's when it has none), split into the largest
per-rank batch size no larger than the command's that makes it up in whole
micro-steps (``--batch-size``, where it changes); where none does, the restart
re-plans with ``--layout auto-all``, as where the layout's fixed axes no longer fit.
"""
from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from mpishard.core.errors import ConfigError

__all__ = ["Supervisor", "supervise", "train_args"]

#: exit statuses a restart would not change
FINAL = {0: "done", 2: "a usage or configuration error", 3: "the loss diverged",
         130: "Ctrl-C"}
#: the longest wait before a restart, in seconds
MAX_BACKOFF = 60.0

_RANK_PREFIX = "[mpishard rank "
#: Open MPI's launcher names the rank it saw end first
_OPEN_MPI_RANK = re.compile(r"noticed that process rank (\d+) with PID")


def train_args(command: list) -> list:
    """The arguments after ``mpishard train`` in ``command``; ConfigError if there is none."""
    for i, token in enumerate(command[:-1]):
        if Path(token).name == "mpishard" and command[i + 1] == "train":
            return command[i + 2:]
    raise ConfigError(f"mpishard supervise: the command {' '.join(command)!r} does not run "
                      f"'mpishard train'; give it as: mpishard supervise -- mpiexec -n 4 python "
                      f"-m mpi4py -m mpishard train ...")


def _flag(args: list, name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in args)


@dataclass
class Supervisor:
    """One supervised job: its command and restart policy (see [Note: supervised restarts]).

    Args:
        command: the job's command line; ``{ranks}`` is replaced by each attempt's ranks.
        cfg: the :class:`~mpishard.config.sections.TrainConfig` of its ``mpishard train``
            arguments (see :func:`train_args`).
        max_restarts: restarts after failures, at most.
        backoff: seconds before the first restart (doubling, at most ``MAX_BACKOFF``).
        ranks: ranks per attempt (``[4, 2]``); empty: the command as it is.
    """

    command: list
    cfg: object
    max_restarts: int = 3
    backoff: float = 5.0
    ranks: list = field(default_factory=list)
    out = sys.stdout
    err = sys.stderr

    def __post_init__(self):
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts} must not be negative (0: "
                              f"run the job once, never restart it)")
        if not (math.isfinite(self.backoff) and self.backoff >= 0):
            raise ConfigError(f"--backoff {self.backoff:g} is not a number of seconds; pass "
                              f"0 or more, e.g. --backoff 5 (waits above {MAX_BACKOFF:g} s "
                              f"are cut to {MAX_BACKOFF:g})")
        if self.ranks and not any("{ranks}" in token for token in self.command):
            raise ConfigError(f"--ranks {','.join(map(str, self.ranks))} needs {{ranks}} in the "
                              f"command, where the number of ranks goes (mpiexec -n {{ranks}})")
        if not self.ranks and any("{ranks}" in token for token in self.command):
            raise ConfigError("the command has {ranks}: pass --ranks, the ranks of each "
                              "attempt (--ranks 4,2)")
        if not self.cfg.run.checkpoint_dir:
            raise ConfigError("mpishard supervise needs --checkpoint-dir (or [run] "
                              "checkpoint_dir): without checkpoints every restart would "
                              "start again from step 0")
        self._job = None
        self._stopping = None           # the name of the signal that stops the supervisor

    # -- one attempt ---------------------------------------------------------------
    def _attempt_command(self, attempt: int, resume: bool) -> list:
        ranks = self.ranks[min(attempt, len(self.ranks) - 1)] if self.ranks else None
        command = [t.replace("{ranks}", str(ranks)) for t in self.command]
        args = train_args(self.command)
        extra = []
        if attempt and resume:      # the newest checkpoint: after the command's flags, so
            if self.cfg.run.resume_from:    # these win over where the first attempt began
                extra += ["--resume-from="]
            extra += ["--resume", "true"]
        if attempt and _flag(args, "--overwrite"):      # it deleted the run once already
            extra += ["--overwrite", "false"]
        if ranks and ranks != self.ranks[0] and not _flag(args, "--global-batch"):
            extra += ["--global-batch", str(self._global_batch())]
        if ranks and not self._fits(ranks) and not _flag(args, "--layout"):
            p = self.cfg.parallel
            self._say(f"the layout {'dp=' + str(p.dp) + ' x ' if p.dp else ''}tp={p.tp} x "
                      f"pp={p.pp} x cp={p.cp} does not fit {ranks} ranks: re-planned with "
                      f"--layout auto-all, the global batch kept")
            extra += ["--layout", "auto-all"]
        elif ranks and ranks != self.ranks[0] and not self.cfg.parallel.layout:
            extra += self._batch_split(ranks)
        return command + extra

    def _batch_split(self, ranks: int) -> list:
        """Flags that split the global batch over the dp ranks of ``ranks`` ranks: the
        largest per-rank batch size no larger than the command's (a rank's activations do
        not grow) that makes it up in whole micro-steps; ``--layout auto-all`` where none
        does, said in one line."""
        o, p = self.cfg.optim, self.cfg.parallel
        batch, dp = self._global_batch(), p.dp or ranks // (p.tp * p.pp * p.cp)
        # the interleaved schedule sends micro-batches round the pipeline in groups of pp
        group = p.pp if p.pipeline_schedule == "interleaved" else 1
        per_rank = 0 if batch % dp else batch // dp
        for size in range(min(o.batch_size, per_rank), 0, -1):
            if per_rank % size == 0 and per_rank // size % group == 0 \
                    and self._takes(size, per_rank // size):
                return [] if size == o.batch_size else ["--batch-size", str(size)]
        self._say(f"the global batch {batch} does not split into micro-batches of at most "
                  f"{o.batch_size}{f' in groups of pp={p.pp}' if group > 1 else ''} that "
                  f"the layout takes over {dp} dp ranks: re-planned with --layout auto-all, "
                  f"the global batch kept")
        return ["--layout", "auto-all"]

    def _takes(self, batch_size: int, micro_steps: int) -> bool:
        """Whether the configuration check takes the command's run with this split (rows
        sequence parallelism must cut over tp, ...): a restart it refused would be final."""
        import copy

        from mpishard.config.support import check_supported
        cfg = copy.deepcopy(self.cfg)
        cfg.optim.batch_size, cfg.optim.micro_steps = batch_size, micro_steps
        try:
            check_supported(cfg, resolved=True)
        except ConfigError:
            return False
        return True

    def _fits(self, ranks: int) -> bool:
        """Whether the command's axes fit ``ranks`` ranks (data parallelism takes the rest)."""
        p = self.cfg.parallel
        fixed = p.tp * p.pp * p.cp
        return p.dp * fixed == ranks if p.dp else ranks % fixed == 0

    def _global_batch(self) -> int:
        o, p = self.cfg.optim, self.cfg.parallel
        if o.global_batch:
            return o.global_batch
        dp = p.dp or self.ranks[0] // (p.tp * p.pp * p.cp) or 1
        return o.batch_size * o.micro_steps * dp

    def _run(self, command: list) -> tuple:
        """Run ``command`` to its end, passing its stderr through; ``(status, first rank
        that reported a failure or None)``."""
        first = [None]
        try:
            self._job = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, bufsize=1)
        except OSError as err:         # not found, not executable: every attempt would fail
            raise ConfigError(f"the job's command {command[0]!r} cannot be run ({err.strerror}); "
                              f"give the launcher's full path or put it on PATH") from None

        def relay():
            for line in self._job.stderr:
                self.err.write(line)
                self.err.flush()
                if first[0] is None:
                    if line.startswith(_RANK_PREFIX):
                        first[0] = line[len(_RANK_PREFIX):].split("]", 1)[0]
                    elif _OPEN_MPI_RANK.search(line):
                        first[0] = _OPEN_MPI_RANK.search(line).group(1)

        reader = threading.Thread(target=relay, daemon=True)
        reader.start()
        status = self._job.wait()
        reader.join(timeout=10)
        self._job = None
        return status, first[0]

    def _forward(self, signum, frame) -> None:
        self._stopping = signal.Signals(signum).name
        if self._job is not None:      # as SIGUSR1, which launchers pass on to the ranks
            self._job.send_signal(signal.SIGUSR1)    # (Open MPI's ends the job on SIGTERM)

    def _interrupted(self, signum, frame) -> None:
        # Ctrl-C: the terminal sent it to the launcher too; the job saves and stops (a
        # handler only sets a flag: it may run inside any lock the main thread holds)
        self._stopping = "SIGINT"

    def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, ended early by a stopping signal (each sleep is interrupted
        by the handler, then the flag is read)."""
        deadline = time.monotonic() + seconds
        while not self._stopping and time.monotonic() < deadline:
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    # -- the loop ------------------------------------------------------------------
    def run(self) -> int:
        """Run the job until it ends for good; the exit status of its last attempt."""
        from mpishard.checkpoint import latest_checkpoint
        from mpishard.run.report import rewind_metrics

        root = Path(self.cfg.run.checkpoint_dir)
        previous = {s: signal.signal(s, self._forward) for s in (signal.SIGTERM, signal.SIGUSR1)}
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupted)
        try:
            attempt, wait, resume = 0, min(MAX_BACKOFF, self.backoff), False
            before = _saved(latest_checkpoint(root))    # a run begun elsewhere saves anew
            while True:
                status, rank = self._run(self._attempt_command(attempt, resume))
                if self._stopping == "SIGINT":  # what a shell reports after Ctrl-C, as the
                    self._say(f"Ctrl-C: the job ended (exit status {status}); not restarted")
                    return 0 if status == 0 else 130                # job does; done is done
                if status in FINAL or self._stopping:
                    return status
                cause = _cause(status, rank)
                if attempt >= self.max_restarts:
                    self._say(f"the job failed ({cause}); gave up after {attempt} restart(s) "
                              f"(--max-restarts {self.max_restarts})")
                    return status
                attempt += 1
                newest = latest_checkpoint(root)
                # begun from --resume-from, before its first save: where it began, not the
                # checkpoint it skipped (the newest there, which `latest` still names)
                resume = newest is not None and not (self.cfg.run.resume_from
                                                     and _saved(newest) == before)
                # none saved yet: the command as given, from its own --resume-from, if any
                start = newest.name if resume else self.cfg.run.resume_from or None
                if not start and self.cfg.run.metrics and Path(self.cfg.run.metrics).exists():
                    rewind_metrics(Path(self.cfg.run.metrics), 0)   # it starts afresh
                self._record({"event": "restart", "attempt": attempt, "exit_code": status,
                              "cause": cause, "resume": start, "time": round(time.time(), 3)})
                self._say(f"the job failed ({cause}); restart {attempt} of "
                          f"{self.max_restarts} in {wait:g} s, "
                          + (f"resuming from {start}" if start else "from step 0"))
                self._pause(wait)
                wait = min(MAX_BACKOFF, wait * 2)
                if self._stopping:
                    return 130 if self._stopping == "SIGINT" else status
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _say(self, line: str) -> None:
        self.out.write(f"mpishard supervise: {line}\n")
        self.out.flush()

    def _record(self, record: dict) -> None:
        path = self.cfg.run.metrics
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


def _saved(step_dir):
    """``(the step folder, when its manifest was written)``: which save it is (a run that
    writes its step again makes another), or ``None`` for none."""
    if step_dir is None:
        return None
    from mpishard.checkpoint.format import MANIFEST
    try:
        return step_dir.name, (step_dir / MANIFEST).stat().st_mtime_ns
    except OSError:
        return step_dir.name, None


def _cause(status: int, rank) -> str:
    if status < 0:
        text = f"the launcher was ended by {signal.Signals(-status).name}"
    elif status > 128 and status - 128 in signal.Signals._value2member_map_:
        text = f"exit status {status} ({signal.Signals(status - 128).name})"
    else:
        text = f"exit status {status}"
    return text + (f"; rank {rank} failed first" if rank else "")


def supervise(command: list, cfg, max_restarts: int = 3, backoff: float = 5.0,
              ranks=()) -> int:
    """Run ``command`` (whose ``mpishard train`` arguments give ``cfg``) under a
    :class:`Supervisor`; its exit status."""
    return Supervisor(list(command), cfg, max_restarts, backoff, list(ranks)).run()

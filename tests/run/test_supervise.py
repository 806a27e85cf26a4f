"""mpishard supervise: restarts after kills equal the uninterrupted run; what it leaves alone."""
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi4py import MPI

from ckpt_scripts.common import (MPIEXEC, ROOT, clean_env, injected_env, kill_a_rank,
                                 rank_pids)
from test_cli import FAST, mpishard


def _records(path):
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:          # a line the kill cut short (the next attempt drops it)
            pass
    return out


class _Supervised:
    """``mpishard supervise OPTIONS -- JOB`` in the background, its output in files (a
    pipe nobody reads while it runs would fill and stop the job)."""

    def __init__(self, *options, job, folder, env=None):
        self.out, self.err = (Path(folder) / "supervise.out", Path(folder) / "supervise.err")
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "mpishard", "supervise",
                                          *options, "--", *job], stdout=out, stderr=err,
                                         env=env or clean_env(), cwd=ROOT,
                                         start_new_session=True)

    def send_signal(self, sig):
        self.proc.send_signal(sig)

    def communicate(self, timeout):
        self.proc.wait(timeout=timeout)
        self.returncode = self.proc.returncode
        return self.out.read_text(), self.err.read_text()


def _supervise(*options, job, folder, env=None):
    return _Supervised(*options, job=job, folder=folder, env=env)


def _train(n, *args):
    return [str(MPIEXEC), "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "mpishard",
            "train", *map(str, args)]


def _wait(what, timeout=90):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.002)
    raise AssertionError(f"timed out waiting for {what.__doc__}")


def test_a_supervised_run_survives_five_kills_and_equals_the_uninterrupted_run(tmp_path):
    """Five SIGKILLs of a random rank of a 4-rank float64 run with background saves, at
    random steps and in the middle of asynchronous writes (slowed down, so that a save
    stays in flight for several steps): the supervisor restarts it each time from the
    newest checkpoint, the run ends by itself, every logged loss equals the uninterrupted
    run's bit for bit, and the metrics file records the 5 restarts with their causes."""
    args = [*FAST, "--dtype", "float64", "--steps", "120", "--checkpoint-interval", "3",
            "--keep-last", "2", "--eval-interval", "0"]
    whole = mpishard("train", *args, "--metrics", tmp_path / "whole.jsonl", n=4)
    assert whole.returncode == 0, whole.stderr
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    env = injected_env(MPISHARD_TEST_SLOW_SAVE="0.1")
    sup = _supervise("--max-restarts", "8", "--backoff", "0", folder=tmp_path, env=env,
                     job=_train(4, *args, "--checkpoint-dir", ckpt, "--metrics", metrics,
                                "--checkpoint-async", "true"))
    rng, in_save = random.Random(7), 0

    def steps():
        return [r["step"] for r in _records(metrics) if "loss" in r] if metrics.exists() else []

    def restarts():
        return [r for r in _records(metrics) if r.get("event") == "restart"] \
            if metrics.exists() else []

    for kill in range(5):
        beyond = max(steps(), default=0) + rng.randint(2, 6)

        def ready():
            """the run past its next kill point"""
            done = max(steps(), default=0)
            if done < beyond or len(rank_pids(metrics)) < 4:
                return None
            if kill % 2 and done < beyond + 4:                  # a save in flight, if seen
                return "save" if any(p.name.endswith(".tmp") for p in ckpt.iterdir()) \
                    else None
            return "step"
        when = _wait(ready)
        assert kill_a_rank(rank_pids(metrics), rng), "no rank to kill"
        in_save += when == "save"
        _wait(lambda: len(restarts()) > kill)
    out, err = sup.communicate(timeout=180)
    assert sup.returncode == 0, out[-3000:] + err[-3000:]
    events = restarts()
    assert len(events) == 5 and out.count("mpishard supervise: the job failed") == 5, out
    assert all(e["exit_code"] != 0 and e["cause"] for e in events), events
    logged = [r for r in _records(metrics) if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, 121))         # each step once
    first = {r["step"]: r["loss"] for r in _records(tmp_path / "whole.jsonl") if "loss" in r}
    assert all(r["loss"] == first[r["step"]] for r in logged)        # bit-identical
    assert in_save >= 1, "no kill landed in a background write"
    print(f"kills during a background write: {in_save} of 5; causes: "
          f"{[e['cause'] for e in events]}")


def test_a_configuration_error_is_final_and_a_bad_command_is_one_line(tmp_path):
    sup = _supervise("--backoff", "0", folder=tmp_path,
                     job=_train(2, *FAST, "--checkpoint-dir", tmp_path / "ck", "--n-head", "3"))
    out, err = sup.communicate(timeout=120)
    assert sup.returncode == 2 and "the job failed" not in out, out + err
    assert err.count("mpishard: error:") == 1, err
    for job, found in ((["echo", "hi"], "does not run 'mpishard train'"),
                       (_train(2, *FAST), "needs --checkpoint-dir"),
                       (_train("{ranks}", *FAST, "--checkpoint-dir", tmp_path), "pass --ranks")):
        sup = _supervise(job=job, folder=tmp_path)
        out, err = sup.communicate(timeout=60)
        assert sup.returncode == 2 and err.startswith("mpishard: error:") and found in err, err
        assert len(err.splitlines()) == 1, err


def test_the_supervisor_gives_up_after_max_restarts_and_passes_sigterm_on(tmp_path):
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    job = _train(2, *FAST, "--steps", "3000", "--checkpoint-dir", ckpt,
                 "--checkpoint-interval", "5", "--metrics", metrics)
    sup = _supervise("--max-restarts", "1", "--backoff", "0", job=job, folder=tmp_path)
    for attempt in range(2):
        _wait(lambda: (ckpt / "latest").exists() and len(rank_pids(metrics)) == 2
              and metrics.read_text().count('"restart"') == attempt)
        kill_a_rank(rank_pids(metrics), random.Random(0))
    out, err = sup.communicate(timeout=120)
    assert sup.returncode not in (0, 2, 130) and "restart 1 of 1" in out, out + err
    assert "gave up after 1 restart(s) (--max-restarts 1)" in out, out
    started = time.time()
    sup = _supervise("--backoff", "0", job=[*job, "--resume", "true"], folder=tmp_path)
    _wait(lambda: len(rank_pids(metrics)) == 2 and metrics.stat().st_mtime > started)
    time.sleep(0.3)
    sup.send_signal(signal.SIGTERM)                 # Slurm's at the time limit: save, stop
    out, err = sup.communicate(timeout=120)
    assert sup.returncode == 0 and "SIGUSR1; checkpoint saved, stopping" in out, out + err
    assert "the job failed" not in out


@pytest.mark.parametrize("first, layout, on_two", [
    (4, [], "batch: 2 per dp rank x 2 micro-steps x 2 dp ranks"),     # ZeRO-3, dp 4 -> 2
    (4, ["--tp", "2"], "batch: 2 per dp rank x 2 micro-steps x 1 dp ranks"),  # dp2xtp2 -> tp2
    (4, ["--tp", "2", "--pp", "2", "--n-layer", "2"],                    # does not fit 2:
     "does not fit 2 ranks: re-planned with --layout auto-all"),             # re-planned
    (3, [], "batch: 1 per dp rank x 3 micro-steps x 2 dp ranks")])   # 6 = 1 x 3 x 2, not 2 x 2
def test_a_run_that_loses_ranks_continues_on_fewer_with_the_same_global_batch(
        tmp_path, first, layout, on_two):
    """--ranks 4,2: killed on 4 ranks, the run continues on 2 with more micro-steps (the
    first attempt's global batch; tp stays, dp shrinks; a layout that does not fit 2 ranks
    is planned again by --layout auto, which the run prints), and its losses equal the
    uninterrupted 4-rank run's to 1e-10 in float64. --ranks 3,2: the global batch of 6
    does not split into micro-batches of 2 over 2 ranks (the restart failed with status
    2): a rank's micro-batch shrinks to 1, in 3 micro-steps."""
    args = [*FAST, "--dtype", "float64", "--steps", "40", "--checkpoint-interval", "4",
            "--eval-interval", "0", *layout]
    whole = mpishard("train", *args, "--metrics", tmp_path / "whole.jsonl", n=first)
    assert whole.returncode == 0, whole.stderr
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    sup = _supervise("--ranks", f"{first},2", "--backoff", "0", folder=tmp_path,
                     job=_train("{ranks}", *args, "--checkpoint-dir", ckpt, "--metrics",
                                metrics))
    _wait(lambda: (ckpt / "step-8").is_dir() and len(rank_pids(metrics)) == first)
    kill_a_rank(rank_pids(metrics), random.Random(3))
    out, err = sup.communicate(timeout=180)
    assert sup.returncode == 0, out[-3000:] + err[-3000:]
    assert on_two in out and "restart 1 of 3" in out, out
    if "auto" in on_two:     # every layout key re-planned, the given ones named
        assert "layout auto-all (" in out and "(replacing the given tp=2, pp=2)" in out, out
    first = {r["step"]: r["loss"] for r in _records(tmp_path / "whole.jsonl") if "loss" in r}
    logged = [r for r in _records(metrics) if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, 41))
    worst = max(abs(r["loss"] - first[r["step"]]) / abs(first[r["step"]]) for r in logged)
    assert worst <= 1e-10, worst


@pytest.mark.parametrize("ranks, failure, extra, said, restarts", [
    (2, {"MPISHARD_TEST_FAIL_AT_START": "1:2:{folder}/failed"}, [],
     "test: rank 1 fails at start-up", [1, 2]),
    (3, {"MPISHARD_TEST_KILL_IN_SAVE": "2:3:write:{folder}/killed"},
     ["--checkpoint-interval", "3", "--checkpoint-async", "true"],
     "test: rank 2 killed writing step-3.tmp", [1])],
    ids=["a rank fails at start-up twice", "a rank dies writing the first checkpoint"])
def test_a_run_that_fails_before_its_first_checkpoint_restarts_from_step_0(
        tmp_path, ranks, failure, extra, said, restarts):
    """No checkpoint exists yet when the job fails: each restart starts the run again
    from step 0, and its metrics file keeps the restart records and each step once, with
    the losses of an unsupervised run."""
    args = [*FAST, "--steps", "6", "--eval-interval", "0"]
    whole = mpishard("train", *args, "--metrics", tmp_path / "whole.jsonl", n=ranks)
    assert whole.returncode == 0, whole.stderr
    metrics = tmp_path / "m.jsonl"
    env = injected_env(**{k: v.format(folder=tmp_path) for k, v in failure.items()})
    sup = _supervise("--backoff", "0", folder=tmp_path, env=env,
                     job=_train(ranks, *args, "--checkpoint-dir", tmp_path / "ck",
                                "--metrics", metrics, *extra))
    out, err = sup.communicate(timeout=180)
    assert sup.returncode == 0, out[-3000:] + err[-3000:]
    assert err.count(said) == len(restarts), err
    assert out.count("from step 0") == len(restarts), out
    records = _records(metrics)
    assert [r["attempt"] for r in records if r.get("event") == "restart"] == restarts
    first = [(r["step"], r["loss"]) for r in _records(tmp_path / "whole.jsonl") if "loss" in r]
    assert [(r["step"], r["loss"]) for r in records if "loss" in r] == first



def _failing_job(folder, status=9):
    """A command the supervisor takes for ``mpishard train`` that ends at once with
    ``status`` (9: as MPICH's launcher after a killed rank, which a restart follows)."""
    return [sys.executable, "-c", f"raise SystemExit({status})", "mpishard", "train",
            "--checkpoint-dir", str(Path(folder) / "ck")]


@pytest.mark.parametrize("status", [2, 3, 130])
def test_a_status_a_restart_would_repeat_is_final(tmp_path, status):
    """2 (a usage or configuration error, also one the environment causes), 3 (the loss
    diverged), 130 (Ctrl-C): the supervisor exits with it and restarts nothing."""
    sup = _supervise("--backoff", "0", folder=tmp_path, job=_failing_job(tmp_path, status))
    out, err = sup.communicate(timeout=60)
    assert sup.returncode == status and out == "" and err == "", out + err


@pytest.mark.parametrize("options, named", [
    (["--backoff", "nan"], "--backoff nan"), (["--backoff", "inf"], "--backoff inf"),
    (["--backoff", "-1"], "--backoff -1"), (["--max-restarts", "-1"], "--max-restarts -1")])
def test_a_restart_option_that_is_no_count_is_one_line_before_the_job_runs(tmp_path, options,
                                                                          named):
    """A wait that is not finite (it crashed the supervisor at the first restart) or a
    negative count: status 2 and one line naming it, before the job is started."""
    sup = _supervise(*options, folder=tmp_path, job=_failing_job(tmp_path))
    out, err = sup.communicate(timeout=60)
    assert sup.returncode == 2 and err.startswith(f"mpishard: error: {named} "), out + err
    assert len(err.splitlines()) == 1 and "the job failed" not in out, out + err


def test_a_launcher_that_cannot_be_run_is_one_line(tmp_path):
    missing = tmp_path / "no-such-mpiexec"
    sup = _supervise(folder=tmp_path, job=[str(missing), "-n", "2", *_failing_job(tmp_path)])
    out, err = sup.communicate(timeout=60)
    assert sup.returncode == 2 and err.startswith("mpishard: error:"), out + err
    assert f"{str(missing)!r} cannot be run" in err and len(err.splitlines()) == 1, err


def test_a_backoff_above_the_longest_wait_waits_the_longest(tmp_path):
    """--backoff 1e300 is finite but no wait time.sleep takes (it crashed the first
    restart): the wait is cut to 60 s, the most any restart waits."""
    sup = _supervise("--backoff", "1e300", folder=tmp_path, job=_failing_job(tmp_path))
    try:
        _wait(lambda: "restart 1 of 3" in sup.out.read_text(), timeout=60)
        time.sleep(0.5)                  # a crash of the wait would follow the line
        assert sup.proc.poll() is None, sup.err.read_text()
        assert "restart 1 of 3 in 60 s, from step 0" in sup.out.read_text()
    finally:
        sup.proc.kill()
        sup.proc.wait()


def test_ctrl_c_waits_for_the_job_to_save_and_stop_and_is_final(tmp_path):
    """Ctrl-C as a terminal sends it (SIGINT to the supervisor's whole process group,
    its launcher included): the ranks save at a step boundary and stop, the supervisor
    waits for them (it died in its wait with a KeyboardInterrupt traceback, leaving them
    running) and exits 130 without a restart."""
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    sup = _supervise("--backoff", "0", folder=tmp_path,
                     job=_train(2, *FAST, "--steps", "3000", "--checkpoint-dir", ckpt,
                                "--checkpoint-interval", "5", "--metrics", metrics))
    _wait(lambda: (ckpt / "latest").exists() and len(rank_pids(metrics)) == 2)
    os.killpg(sup.proc.pid, signal.SIGINT)         # its own session: the group is its pid
    out, err = sup.communicate(timeout=120)
    assert rank_pids(metrics) == [], "the supervisor ended before its job"
    assert sup.returncode == 130 and "Traceback" not in err, out + err
    assert "the job failed" not in out and "restart 1" not in out, out
    if MPI.get_vendor()[0] == "Open MPI":   # its mpiexec ends the job on Ctrl-C (status 1,
        return                              # the ranks' last lines unread: docs/checkpoints.md)
    assert "Ctrl-C; checkpoint saved, stopping" in out, out
    last = max(r["step"] for r in _records(metrics) if "loss" in r)
    assert (ckpt / "latest").read_text().strip() == f"step-{last}"


def test_ctrl_c_while_waiting_to_restart_ends_the_wait(tmp_path):
    sup = _supervise("--backoff", "50", folder=tmp_path, job=_failing_job(tmp_path))
    _wait(lambda: "restart 1 of 3 in 50 s" in sup.out.read_text(), timeout=60)
    started = time.time()
    os.killpg(sup.proc.pid, signal.SIGINT)
    out, err = sup.communicate(timeout=20)
    assert sup.returncode == 130 and "Traceback" not in err, out + err
    assert time.time() - started < 10 and "restart 2" not in out, out


def test_a_run_begun_with_resume_from_restarts_from_its_newest_checkpoint(tmp_path):
    """--resume-from step-2 names where the run began, not where a restart goes on: after
    a kill the job resumes from the newest checkpoint, the one the restart line and record
    name (it went back to step-2, which keep_last had removed: status 2)."""
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    args = [*FAST, "--checkpoint-dir", ckpt, "--checkpoint-interval", "2", "--eval-interval",
            "0"]
    first = mpishard("train", *args, "--steps", "4", n=2)
    assert first.returncode == 0, first.stderr
    sup = _supervise("--backoff", "0", folder=tmp_path,
                     job=_train(2, *args, "--steps", "30", "--resume-from", "step-2",
                                "--metrics", metrics))
    _wait(lambda: (ckpt / "step-10").is_dir() and len(rank_pids(metrics)) == 2)
    assert not (ckpt / "step-2").exists()           # keep_last 2: removed at step-6
    kill_a_rank(rank_pids(metrics), random.Random(1))
    out, err = sup.communicate(timeout=180)
    assert sup.returncode == 0, out[-3000:] + err[-3000:]
    [restart] = [r for r in _records(metrics) if r.get("event") == "restart"]
    resumed = re.findall(r"resumed from step (\d+) ", out)
    assert resumed[0] == "2" and len(resumed) == 2 and int(resumed[1]) >= 8, out
    assert restart["resume"] == f"step-{resumed[1]}", restart
    assert f"restart 1 of 3 in 0 s, resuming from step-{resumed[1]}" in out, out
    assert [r["step"] for r in _records(metrics) if "loss" in r] == list(range(3, 31))


def test_a_run_begun_elsewhere_that_fails_before_saving_restarts_where_it_began(tmp_path):
    """--resume-from a step directory outside --checkpoint-dir (a run continued in a new
    directory), and a rank fails at start-up before anything is saved: the restart
    begins again from that directory, and its line says so (it said "from step 0")."""
    first = mpishard("train", *FAST, "--steps", "4", "--checkpoint-dir", tmp_path / "a",
                     "--checkpoint-interval", "4", n=2)
    assert first.returncode == 0, first.stderr
    began, metrics = tmp_path / "a" / "step-4", tmp_path / "m.jsonl"
    env = injected_env(MPISHARD_TEST_FAIL_AT_START=f"1:1:{tmp_path}/failed")
    sup = _supervise("--backoff", "0", folder=tmp_path, env=env,
                     job=_train(2, *FAST, "--steps", "8", "--eval-interval", "0",
                                "--checkpoint-dir", tmp_path / "b", "--resume-from", began,
                                "--metrics", metrics))
    out, err = sup.communicate(timeout=120)
    assert sup.returncode == 0, out[-3000:] + err[-3000:]
    assert f"restart 1 of 3 in 0 s, resuming from {began}" in out, out
    assert re.findall(r"resumed from step (\d+) ", out) == ["4"], out
    [restart] = [r for r in _records(metrics) if r.get("event") == "restart"]
    assert restart["resume"] == str(began)
    assert [r["step"] for r in _records(metrics) if "loss" in r] == list(range(5, 9))


#: a job that writes its arguments after ``mpishard train`` to a file and fails once
_RECORDED_JOB = """import json, sys
with open(sys.argv[1], "a+") as log:
    log.seek(0)
    first = not log.read()
    log.write(json.dumps(sys.argv[sys.argv.index("train") + 1:]) + "\\n")
sys.exit(9 if first else 0)
"""


def test_a_run_begun_from_an_older_checkpoint_restarts_there_before_its_first_save(
        tmp_path):
    """--resume-from step-4 skips step-8, which ``latest`` still names: a failure before
    the run's first save restarts from step-4 again (it went on from step-8)."""
    ckpt, log = tmp_path / "ck", tmp_path / "attempts.jsonl"
    for step in (4, 8):
        (ckpt / f"step-{step}").mkdir(parents=True)
        (ckpt / f"step-{step}" / "manifest.json").write_text("{}")
    (ckpt / "latest").write_text("step-8")
    train = ["mpishard", "train", "--checkpoint-dir", str(ckpt), "--resume-from", "step-4"]
    sup = _supervise("--backoff", "0", folder=tmp_path,
                     job=[sys.executable, "-c", _RECORDED_JOB, str(log), *train])
    out, err = sup.communicate(timeout=60)
    assert sup.returncode == 0, out + err
    assert "restart 1 of 3 in 0 s, resuming from step-4" in out, out
    attempts = [json.loads(line) for line in log.read_text().splitlines()]
    assert attempts == [train[2:], train[2:]], attempts


def test_ctrl_c_to_the_supervisor_alone_keeps_a_finished_job_s_status(tmp_path):
    """A SIGINT that reaches only the supervisor (a script's kill -INT): no restart
    follows, it says so, and a job that then finishes well still exits 0 (it was 130)."""
    started = tmp_path / "started"
    job = [sys.executable, "-c", "import sys, time; open(sys.argv[1], 'w').close(); "
           "time.sleep(4)", str(started), "mpishard", "train", "--checkpoint-dir",
           str(tmp_path / "ck")]
    sup = _supervise("--backoff", "0", folder=tmp_path, job=job)
    _wait(started.exists, timeout=60)            # the supervisor's handlers are set by now
    os.kill(sup.proc.pid, signal.SIGINT)
    out, err = sup.communicate(timeout=60)
    assert sup.returncode == 0 and "Traceback" not in err, out + err
    assert "Ctrl-C: the job ended (exit status 0); not restarted" in out, out


@pytest.mark.parametrize("ranks, options, restart_adds, said", [
    ("4,3", ["--batch-size", "2"], ["--global-batch", "8", "--layout", "auto-all"],
     "the global batch 8 does not split into micro-batches of at most 2 that the layout "
     "takes over 3 dp ranks"),
    ("12,9", ["--tp", "3", "--n-head", "6", "--n-embd", "48", "--sequence-parallel", "true",
              "--batch-size", "6", "--block-size", "64"],
     ["--global-batch", "24", "--layout", "auto-all"],     # 8 a rank, but 4, 2 or 1 x 64
     "the global batch 24 does not split into micro-batches of at most 6 that the layout "
     "takes over 3 dp ranks"),                              # rows do not split over tp 3
    ("6,4", ["--batch-size", "4", "--micro-steps", "2", "--global-batch", "24", "--pp", "2",
             "--n-layer", "4", "--virtual-stages", "2", "--pipeline-schedule", "interleaved"],
     ["--batch-size", "3"], None)],                 # 12 per rank: 4 x 3 is no multiple of pp
    ids=["8 sequences over 3 ranks", "sequence-parallel rows", "micro-steps in groups of pp"])
def test_a_restart_on_ranks_the_global_batch_does_not_split_over(tmp_path, ranks, options,
                                                                 restart_adds, said):
    """What a restart on other ranks runs where the command's batch size does not make
    the global batch: re-planned by --layout auto-all where no per-rank batch size does,
    a smaller one that does in whole groups of pp micro-steps for the interleaved
    schedule."""
    log = tmp_path / "attempts.jsonl"
    train = ["mpishard", "train", *options, "--checkpoint-dir", str(tmp_path / "ck")]
    sup = _supervise("--ranks", ranks, "--backoff", "0", folder=tmp_path,
                     job=[sys.executable, "-c", _RECORDED_JOB, str(log), "{ranks}", *train])
    out, err = sup.communicate(timeout=60)
    assert sup.returncode == 0, out + err
    attempts = [json.loads(line) for line in log.read_text().splitlines()]
    assert attempts == [train[2:], train[2:] + restart_adds], attempts
    assert said is None or f"{said}: re-planned with --layout auto-all" in out, out

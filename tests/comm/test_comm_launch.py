"""Failures end the job instead of hanging: launched under mpiexec as subprocesses.

These tests start their own ``mpiexec -n 2`` (the one next to the Python
running the tests) on the scripts in tests/mpi_scripts/, with a subprocess
timeout so that a regression shows up as a failed test, never a stuck CI job.
They run once, in the serial leg (they are not MPI tests themselves).
"""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi4py import MPI

from mpishard.comm import Communicator, LauncherMismatch, check_launcher
from mpishard.comm.env import SettingError

from ckpt_scripts.common import ranks_stderr, run_mpishard

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "mpi_scripts"
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def launch(script, *args, np=2, env=None, python_args=(), limit=30):
    """Run ``mpiexec -n np python [python_args] script args``; return (rc, output, seconds)."""
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec next to {sys.executable}")
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPIR_", "MPISHARD_",
                                  "SLURM_"))}
    clean.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", **(env or {}))
    extra = ["--oversubscribe", "--allow-run-as-root"] if MPI.get_vendor()[0] == "Open MPI" else []
    cmd = [str(MPIEXEC), *extra, "-n", str(np), sys.executable, *python_args,
           str(SCRIPTS / script), *args]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=clean, capture_output=True, text=True,
                              timeout=limit)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout
        pytest.fail(f"{' '.join(cmd)} hung for {limit} s; output so far:\n{out}")
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def test_exception_on_one_rank_aborts_with_its_traceback():
    rc, out, seconds = launch("raise_before_collective.py", "--hook")
    assert rc != 0, out
    assert seconds < 10, f"took {seconds:.1f} s:\n{out}"
    assert "[mpishard rank 1/2] Traceback (most recent call last):" in out, out
    assert ("[mpishard rank 1/2] RuntimeError: rank 1 fails on purpose before the "
            "second all_reduce") in out, out
    assert "[mpishard rank 1/2]   world        all_reduce #1" in out, out  # the call history
    assert "finished (should not happen)" not in out


def test_python_m_mpi4py_launch_form_also_aborts():
    rc, out, seconds = launch("raise_before_collective.py", python_args=["-m", "mpi4py"])
    assert rc != 0 and seconds < 10, (rc, seconds, out)
    assert "RuntimeError: rank 1 fails on purpose" in out, out


def test_debug_mode_mismatch_raises_on_every_rank(tmp_path):
    rc, out, seconds = launch("debug_mismatch.py", str(tmp_path), python_args=["-m", "mpi4py"],
                              env={"MPISHARD_DEBUG": "1"})
    assert rc == 0 and seconds < 10, (rc, seconds, out)
    for rank in (0, 1):
        report = (tmp_path / f"rank{rank}.txt").read_text()
        assert report.startswith(f"rank {rank} caught CollectiveMismatch"), out
        assert "rank 0 called all_reduce #2 (shape (4,)" in report
        assert "rank 1 called all_reduce #2 (shape (5,)" in report


def test_watchdog_ends_a_job_where_one_rank_skipped_a_collective():
    rc, out, seconds = launch("skip_collective.py", python_args=["-m", "mpi4py"],
                              env={"MPISHARD_TIMEOUT": "3"})
    assert rc != 0, out
    assert 3 <= seconds < 15, f"took {seconds:.1f} s:\n{out}"
    # The stuck operation of each rank (the launcher may interleave the two
    # ranks' reports line by line, so check fragments, not whole reports).
    assert ("[mpishard rank 0/2] CollectiveTimeout: all_reduce #3 (shape (8,), float32, "
            "op=sum) on communicator 'world'") in out, out
    assert "[mpishard rank 1/2] CollectiveTimeout: barrier #3 on communicator 'world'" in out
    # The call history: the completed collectives and the stuck one, still running.
    for entry in ("all_reduce #1 (shape (4,), float64, op=sum)",
                  "broadcast #2 (shape (2,), float64, root=0)", "RUNNING"):
        assert entry in out, (entry, out)
    assert "finished (should not happen)" not in out


def test_a_timeout_in_a_job_that_then_finishes_still_exits_124():
    """The watchdog waits a grace before it aborts; a job that ended within it exited 0
    after printing the timeout."""
    rc, out, _ = launch("late_collective.py", python_args=["-m", "mpi4py"],
                        env={"MPISHARD_TIMEOUT": "0.2"})
    assert "[mpishard rank 0/2] CollectiveTimeout: barrier #2" in out, out
    assert rc == 124 or (rc != 0 and MPI.get_vendor()[0] == "Open MPI"), (rc, out)


# -- entry-point helpers (no subprocess) ----------------------------------------
class FakeWorld:
    size = 1


@pytest.mark.parametrize("environ", [{"SLURM_NTASKS": "4"},
                                     {"SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "8"},
                                     {"OMPI_COMM_WORLD_SIZE": "2"}, {"PMI_SIZE": "3"}])
def test_check_launcher_names_the_pmi_problem(environ):
    with pytest.raises(LauncherMismatch, match=r"started \d tasks .* world of size 1: the "
                                               r"MPI library mpi4py loaded, .* does not "
                                               r"speak this launcher's PMI"):
        check_launcher(FakeWorld(), environ=environ)


@pytest.mark.parametrize("environ", [{}, {"SLURM_NTASKS": "1"},
                                     {"SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "4"}])
def test_check_launcher_accepts_consistent_setups(environ):
    assert check_launcher(FakeWorld(), environ=environ) is None
    world = Communicator(MPI.COMM_SELF)
    world.size = 4  # a real multi-rank world never complains
    assert check_launcher(world, environ={"SLURM_NTASKS": "4"}) is None


def test_from_env_reads_the_mpishard_variables():
    env = {"MPISHARD_DEBUG": "1", "MPISHARD_TIMEOUT": "2.5", "MPISHARD_CUDA_AWARE": "1",
           "MPISHARD_COMM_BACKEND": "mpi"}
    comm = Communicator.from_env(MPI.COMM_SELF, "w", environ=env)
    assert comm.debug and comm.timeout == 2.5 and comm.comm_backend == "mpi"
    assert comm.cuda_aware == (True, "set by MPISHARD_CUDA_AWARE=1")
    plain = Communicator.from_env(MPI.COMM_SELF, environ={"MPISHARD_TIMEOUT": "0"})
    assert not plain.debug and plain.timeout is None
    assert Communicator.from_env(MPI.COMM_SELF, environ=env, debug=False).debug is False
    override = Communicator.from_env(MPI.COMM_SELF, environ=env, cuda_aware=False)
    assert override.cuda_aware == (False, "set by the cuda_aware argument")


@pytest.mark.parametrize("environ,match", [
    ({"MPISHARD_DEBUG": "maybe"}, r"MPISHARD_DEBUG='maybe' is not a flag"),
    ({"MPISHARD_TIMEOUT": "ten"}, r"MPISHARD_TIMEOUT='ten' is not a number of seconds"),
    ({"MPISHARD_TIMEOUT": "-5"}, r"MPISHARD_TIMEOUT='-5' is not a number of seconds >= 0"),
    ({"MPISHARD_TIMEOUT": "nan"}, r"MPISHARD_TIMEOUT='nan' is not a number of seconds"),
    ({"MPISHARD_TIMEOUT": "inf"}, r"MPISHARD_TIMEOUT='inf' is not a number of seconds"),
    ({"MPISHARD_CUDA_AWARE": "2"}, r"MPISHARD_CUDA_AWARE='2' is not a flag"),
    ({"MPISHARD_COMM_BACKEND": "gloo"},
     r"MPISHARD_COMM_BACKEND='gloo' is not one of mpi, nccl, auto; use e.g."),
])
def test_from_env_rejects_bad_values(environ, match):
    with pytest.raises(SettingError, match=match):
        Communicator.from_env(MPI.COMM_SELF, environ=environ)


@pytest.mark.mpi(min_size=2)
def test_a_bad_variable_on_one_rank_is_raised_on_every_rank():
    """Environments can differ by rank (a remote node, an MPMD launch): the rank without
    the bad value raised nothing and waited for the others, which had left."""
    environ = {"MPISHARD_TIMEOUT": "abc"} if MPI.COMM_WORLD.rank == 1 else {}
    with pytest.raises(SettingError, match=r"MPISHARD_TIMEOUT='abc' is not a number of "
                                           r"seconds >= 0; .* \(on rank 1\)$"):
        Communicator.from_env(MPI.COMM_WORLD, environ=environ)


def test_a_comm_backend_that_cannot_run_here_is_a_setting_error(monkeypatch):
    from mpishard.comm.backends import BACKENDS
    monkeypatch.setattr(BACKENDS["nccl"], "available", lambda: (False, "no CuPy here"))
    with pytest.raises(SettingError, match=r"^MPISHARD_COMM_BACKEND=nccl: comm_backend="
                                           r"'nccl' but NCCL is unavailable \(no CuPy here\)"):
        Communicator.from_env(MPI.COMM_SELF, environ={"MPISHARD_COMM_BACKEND": "nccl"})


@pytest.mark.parametrize("variable,value", [("MPISHARD_TIMEOUT", "abc"),
                                            ("MPISHARD_COMM_BACKEND", "bogus"),
                                            ("MPISHARD_THREADS", "0")])
def test_a_bad_variable_is_one_line_and_status_2(variable, value):
    """Under mpiexec too: it was a traceback on every rank and status 1, which
    ``mpishard supervise`` restarts as if the job had crashed."""
    out = run_mpishard("train", "--n-layer", "1", "--n-embd", "16", "--steps", "1",
                       "--max-bytes", "20000", "--progress", "false", n=2,
                       env={variable: value})
    err = ranks_stderr(out.stderr)          # without Open MPI's note of a non-zero exit
    assert out.returncode == 2, out.stderr
    assert err.startswith(f"mpishard: error: {variable}={value!r} ")
    assert len(err.splitlines()) == 1, out.stderr


def test_constructor_checks():
    with pytest.raises(TypeError, match="needs an mpi4py intracommunicator"):
        Communicator("world")
    with pytest.raises(ValueError, match="timeout=-1 must be a positive number"):
        Communicator(MPI.COMM_SELF, timeout=-1)

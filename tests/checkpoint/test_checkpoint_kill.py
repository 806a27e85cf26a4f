"""Kill one rank at random moments of saves: every time, the newest complete checkpoint
verifies and loads with the saved values, and the next save to the same step succeeds.

Runs benchmarks/checkpoint_kill.py with a few kills (each ~1-3 s: launching MPI jobs
dominates); ``python benchmarks/checkpoint_kill.py --kills 20`` is the full check.
"""
import subprocess
import sys

import pytest

from ckpt_scripts.common import MPIEXEC, ROOT, clean_env


@pytest.mark.timeout(180)
@pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec next to python")
def test_checkpoints_survive_kills_during_save():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "checkpoint_kill.py"),
                           "--kills", "3", "--seed", "7"], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("checkpoint_kill: kills 3,"), proc.stdout
    assert "final loaded" in summary, proc.stdout

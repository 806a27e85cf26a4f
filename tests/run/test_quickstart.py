"""docs/quickstart.md as a new user meets it: every command of its code blocks, top to
bottom. Its first is ``make demo``'s own run (the Makefile's line), which leaves
runs/demo/ behind; every later one must still run.

The commands run in a scratch folder (``runs/`` is written there; the files they
read, ``examples/`` and ``docs/``, are links to this checkout's). Set-up lines
(``make``, ``pip``, ``python3 -m venv``, ``. .venv/bin/activate``) are what this
venv has done already; ``export`` lines are applied. Each ``mpishard train`` gets
flags that shrink it to two steps of a little data (flags win over the page's),
so the page runs in well under a minute.
"""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
QUICKSTART = ROOT / "docs" / "quickstart.md"
SHRINK = ["--steps", "2", "--eval-batches", "1", "--max-bytes", "40000", "--sample-tokens", "4",
          "--progress", "false"]
#: first words of lines that prepare a machine: done already for this venv
SET_UP = {"make", "pip", "python3", "."}
#: first words of lines that are commands to run (any other line of a block is output)
RUN = {"mpiexec", "mpishard", "python", "export"}

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec next to python")]


def page_commands(markdown: str) -> list:
    """The command lines of the page's plain code blocks (``python`` blocks are code), in
    order, each split as the shell would (continuations joined, comments dropped)."""
    lines = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", markdown, re.M | re.S):
        if lang:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0] in RUN:
                lines.append(words)
            elif words:
                assert words[0] in SET_UP or not words[0].startswith(("mpi", "python")), line
    return lines


def as_argv(words: list) -> list:
    """This venv's programs for the page's ``mpiexec``, ``python`` and ``mpishard``."""
    if words[0] == "mpishard":
        words = ["python", "-m", "mpishard", *words[1:]]
    argv = [str(MPIEXEC) if w == "mpiexec" else sys.executable if w == "python" else w
            for w in words]
    if "train" in words and "--help" not in words:
        argv += SHRINK
    return argv


def test_the_quickstart_runs_top_to_bottom_after_the_demo(tmp_path):
    commands = page_commands(QUICKSTART.read_text())
    trains = [w for w in commands if "train" in w]
    assert len(commands) >= 10 and len(trains) >= 5             # the page was read
    for name in ("examples", "docs"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    for var in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        env.pop(var, None)

    def run(argv):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env,
                             cwd=tmp_path)
        assert out.returncode == 0, f"{shlex.join(argv)}\n{out.stdout}\n{out.stderr}"
        return out

    demo = re.search(r"^demo:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert trains[0][trains[0].index("train"):] == shlex.split(demo)[shlex.split(demo).index(
        "train"):]                                              # the page's first run is make demo's
    for i, words in enumerate(commands):
        if words[0] == "export":
            env.update(w.split("=", 1) for w in words[1:])
            continue
        run(as_argv(words))
        if i == 0:                                              # what make demo leaves
            assert (tmp_path / "runs" / "demo" / "checkpoints" / "step-2").is_dir()
    assert (tmp_path / "runs" / "demo" / "metrics.png").is_file()      # the plot command ran
    assert (tmp_path / "runs" / "ddp" / "checkpoints" / "step-2").is_dir()

"""Every example runs with (a short form of) the command in its docstring; presets parse."""
import os
import subprocess
import sys

import pytest

from test_cli import MPIEXEC, ROOT, mpishard

EXAMPLES = ROOT / "examples"


def run_example(script, *args, n=2, timeout=180):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cmd = [str(MPIEXEC), "-n", str(n), sys.executable, "-m", "mpi4py", str(EXAMPLES / script),
           *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_every_example_documents_its_command():
    for path in EXAMPLES.glob("*.py"):
        assert "python -m mpi4py" in path.read_text().split('"""')[1], path.name


def test_gpt_zero3():
    out = run_example("gpt_zero3.py", "--steps", "3")
    assert "step 2: loss" in out


def test_mlp_digits_ddp():
    pytest.importorskip("sklearn")
    out = run_example("mlp_digits_ddp.py", "--epochs", "3")
    accuracy = float(out.strip().splitlines()[-1].rsplit(" ", 1)[1])
    assert accuracy > 0.8


def test_gpt_tp_pp():
    out = run_example("gpt_tp_pp.py", "--steps", "2", n=4)
    assert "holds blocks" in out and "step 1: loss" in out
    out = run_example("gpt_tp_pp.py", "--dp", "2", "--tp", "2", "--pp", "1", "--strategy",
                      "zero3", "--steps", "2", n=4)       # the docstring's second command
    assert "step 1: loss" in out


def test_finetune_from_consolidated(tmp_path):
    base = tmp_path / "base"
    out = mpishard("train", "--steps", "2", "--checkpoint-dir", str(base), "--max-bytes",
                   "50000", "--eval-batches", "1", "--progress", "false", n=2)
    assert out.returncode == 0, out.stderr
    weights = tmp_path / "base.safetensors"
    out = mpishard("checkpoint", "consolidate", str(base), str(weights))
    assert out.returncode == 0, out.stderr
    out = run_example("finetune_consolidated.py", str(weights), "--steps", "2")
    assert "fine-tune step 1: loss" in out


@pytest.mark.parametrize("config", sorted((EXAMPLES / "configs").glob("*.toml")),
                         ids=lambda p: p.name)
def test_presets_plan(config):
    text = config.read_text()
    if 'model = "mlp"' in text:
        pytest.importorskip("sklearn")
    ranks = 4 if "tp = 2" in text else 2
    out = mpishard("train", "--config", str(config), "--dry-run", "true", n=ranks)
    assert out.returncode == 0, out.stderr
    assert "per rank:" in out.stdout

"""The Slurm templates in slurm/, run end to end on this machine.

``sbatch``, ``srun`` and ``scontrol`` are replaced by shims (small bash scripts
put first on PATH): the ``sbatch`` shim runs the job script at once with bash
and the SLURM_* variables a job would have (and, on request, sends it USR1 as
``--signal=B:USR1@...`` would, once the ranks run); the ``srun`` shim runs the command under this
venv's ``mpiexec -n $SLURM_NTASKS``; ``scontrol`` only records its arguments.
Each template trains a tiny GPT for a few steps on 2 ranks; the requeue path is
driven with stand-in ranks that "checkpoint" on USR1 and exit 0.
"""
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SLURM = ROOT / "slurm"
TEMPLATES = ["cpu.sbatch", "gpu.sbatch", "multinode.sbatch"]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
VENV = Path(sys.executable).parent.parent
STEPS = 3
TINY = (f"--steps {STEPS} --n-layer 1 --n-embd 16 --n-head 2 --block-size 16 --batch-size 2 "
        f"--max-bytes 20000 --eval-batches 1 --sample-tokens 0 --strategy zero2")
JOB_ID = "4242"

SBATCH_SHIM = r"""#!/bin/bash
# sbatch stand-in: run the script now, with the variables of a job of that shape.
echo "sbatch $*" >> "$SHIM_LOG"
nodes=1 per_node=1 cpus=1 name=job
while [ $# -gt 0 ]; do
    case "$1" in
        --nodes=*) nodes=${1#*=} ;;
        --ntasks-per-node=*) per_node=${1#*=} ;;
        --cpus-per-task=*) cpus=${1#*=} ;;
        --job-name=*) name=${1#*=} ;;
        -*) ;;
        *) break ;;
    esac
    shift
done
script=$1
shift
export SLURM_JOB_ID=$SHIM_JOB_ID SLURM_JOB_NAME=$name SLURM_JOB_NUM_NODES=$nodes \
    SLURM_NNODES=$nodes SLURM_NTASKS=$((nodes * per_node)) SLURM_NTASKS_PER_NODE=$per_node \
    SLURM_CPUS_PER_TASK=$cpus SLURM_SUBMIT_DIR=$PWD SLURM_JOB_NODELIST="shim[1-$nodes]"
if [ -n "${SHIM_RESTART_COUNT:-}" ]; then export SLURM_RESTART_COUNT=$SHIM_RESTART_COUNT; fi
bash "$script" "$@" &
pid=$!
if [ -n "${SHIM_USR1_WHEN_READY:-}" ]; then  # as --signal=B:USR1@T: to the batch shell only,
    for _ in $(seq 600); do                  # once that many ranks run (as late in a job)
        [ "$(find "$SHIM_READY" -type f | wc -l)" -ge "$SHIM_USR1_WHEN_READY" ] && break
        sleep 0.1
    done
    kill -USR1 "$pid"
fi
wait "$pid"
"""

# srun stand-in: drop srun's own --options, run the command under mpiexec. The job's
# SLURM_* variables are removed (else mpiexec would itself try to launch through srun);
# SLURM_NTASKS and SLURM_STEP_NUM_TASKS stay, as check_launcher reads them.
SRUN_SHIM = r"""#!/bin/bash
echo "srun $*" >> "$SHIM_LOG"
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
n=$SLURM_NTASKS
for var in $(compgen -e | grep '^SLURM_'); do unset "$var"; done
export SLURM_NTASKS=$n SLURM_STEP_NUM_TASKS=$n
exec @MPIEXEC@ -n "$n" "$@"
"""

SCONTROL_SHIM = r"""#!/bin/bash
echo "scontrol $*" >> "$SHIM_LOG"
"""

# A stand-in for the venv's python, launched as every rank: records its arguments,
# and on USR1 "writes a checkpoint" (a step-N directory) and exits with FAKE_EXIT.
FAKE_PYTHON = r"""#!/bin/bash
echo "python $*" >> "$SHIM_LOG"
checkpoint_dir=
while [ $# -gt 0 ]; do
    if [ "$1" = --checkpoint-dir ]; then checkpoint_dir=$2; fi
    shift
done
on_usr1() {
    mkdir -p "$checkpoint_dir/step-7"
    echo "rank got USR1"
    exit "${FAKE_EXIT:-0}"
}
trap on_usr1 USR1
touch "$SHIM_READY/rank-$$"
sleep 60 &
wait
echo "rank was never signalled"
exit 3
"""


def _mpiexec_command() -> str:
    from mpi4py import MPI

    extra = " --oversubscribe --allow-run-as-root" if MPI.get_vendor()[0] == "Open MPI" else ""
    return shlex.quote(str(MPIEXEC)) + extra


@pytest.fixture
def shims(tmp_path):
    """A folder with sbatch/srun/scontrol shims, and the log they write to."""
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec next to {sys.executable}")
    bin_dir = tmp_path / "shims"
    bin_dir.mkdir()
    scripts = {"sbatch": SBATCH_SHIM, "srun": SRUN_SHIM.replace("@MPIEXEC@", _mpiexec_command()),
               "scontrol": SCONTROL_SHIM}
    for name, text in scripts.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    return bin_dir, tmp_path / "shim.log"


def submit(template, shims, tmp_path, timeout=120, **settings):
    """``bash slurm/TEMPLATE`` as a user would submit it; returns (result, log lines)."""
    bin_dir, log = shims
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PMI_", "PMIX_", "OMPI_COMM_WORLD", "HYDRA_",
                                "MPISHARD_"))}
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '')}", SHIM_LOG=str(log), SHIM_JOB_ID=JOB_ID,
               PYTHONPATH=str(ROOT), VENV=str(VENV), RUN_ROOT=str(tmp_path / "runs"),
               TRAIN_ARGS=TINY, CPUS_PER_TASK="1", SRUN_MPI="pmi2", WATCHDOG_SECONDS="120")
    env.update(settings)
    env["SHIM_READY"] = tempfile.mkdtemp(dir=tmp_path)   # the stand-in ranks check in here
    result = subprocess.run(["bash", str(SLURM / template)], capture_output=True, text=True,
                            timeout=timeout, env=env, cwd=ROOT)
    lines = log.read_text().splitlines() if log.exists() else []
    return result, lines


def calls(lines, program):
    return [shlex.split(line)[1:] for line in lines if line.split()[0] == program]


@pytest.mark.parametrize("template", TEMPLATES)
def test_bash_syntax(template):
    out = subprocess.run(["bash", "-n", str(SLURM / template)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("template", TEMPLATES)
def test_no_site_specific_paths(template):
    text = (SLURM / template).read_text()
    assert not re.search(r"(/home/|/scratch/|/gpfs/|/lustre/|/work/|/opt/|/apps/)", text)
    head = text.split("# ---- submit")[0]
    for setting in ("ACCOUNT", "PARTITION", "TIME", "MODULES", "VENV", "SRUN_MPI",
                    "SIGNAL_SECONDS"):
        assert re.search(rf"^{setting}=\$\{{{setting}:-[^}}]*\}}\s+# \S", head, re.M), \
            f"{template}: {setting} is not a commented variable at the top"


# Settings that make each template start exactly 2 ranks here.
TWO_RANKS = {
    "cpu.sbatch": {"NTASKS_PER_NODE": "2"},
    "gpu.sbatch": {"GPUS": "2", "BACKEND": "numpy"},
    "multinode.sbatch": {"NODES": "2", "GPUS_PER_NODE": "1", "BACKEND": "numpy"},
}


JOB_NAMES = {"cpu.sbatch": "mpishard-cpu", "gpu.sbatch": "mpishard-gpu",
             "multinode.sbatch": "mpishard-multinode"}


@pytest.mark.parametrize("template", TEMPLATES)
def test_template_trains_end_to_end(template, shims, tmp_path):
    run_dir = tmp_path / "runs" / f"{JOB_NAMES[template]}-{JOB_ID}"
    (run_dir / "checkpoints" / "step-2.tmp").mkdir(parents=True)   # a killed save: not resumed
    result, lines = submit(template, shims, tmp_path, ACCOUNT="proj42", **TWO_RANKS[template])
    assert result.returncode == 0, result.stdout + result.stderr

    (sbatch,) = calls(lines, "sbatch")
    flags, script = sbatch[:-1], sbatch[-1]
    assert script.endswith(f"slurm/{template}")
    assert "--account=proj42" in flags and "--requeue" in flags
    assert "--signal=B:USR1@300" in flags
    assert not any(f.startswith("--partition") for f in flags)     # empty setting: no flag
    if template == "gpu.sbatch":
        assert "--gpus-per-node=2" in flags and "--ntasks-per-node=2" in flags
    if template == "multinode.sbatch":
        assert {"--nodes=2", "--gpus-per-node=1", "--ntasks-per-node=1"} <= set(flags)

    (srun,) = calls(lines, "srun")
    assert "--mpi=pmi2" in srun
    train = srun[srun.index("train") + 1:]
    assert f"--job-name={JOB_NAMES[template]}" in flags
    assert train[train.index("--checkpoint-dir") + 1] == str(run_dir / "checkpoints")
    assert train[train.index("--resume") + 1] == "false"
    assert not calls(lines, "scontrol")                          # finished: no requeue

    out = result.stdout
    assert "world 2 = mesh dp=2" in out and "OMP_NUM_THREADS=1" in out
    assert f"after {STEPS} steps (zero2, 2 ranks)" in out
    metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert sum('"loss"' in line for line in metrics) == STEPS
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank-0.log", "rank-1.log"]


def _fake_venv(tmp_path) -> Path:
    venv = tmp_path / "fake-venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return venv


def test_usr1_checkpoints_and_requeues_then_resumes(shims, tmp_path):
    venv = _fake_venv(tmp_path)
    result, lines = submit("cpu.sbatch", shims, tmp_path, NTASKS_PER_NODE="2", VENV=str(venv),
                           SHIM_USR1_WHEN_READY="2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("rank got USR1") == 2             # srun passed it to every rank
    assert calls(lines, "scontrol") == [["requeue", JOB_ID]]
    assert "requeueing to resume" in result.stdout

    # The requeued job finds the checkpoint and resumes.
    (shims[1]).unlink()
    result, lines = submit("cpu.sbatch", shims, tmp_path, NTASKS_PER_NODE="2", VENV=str(venv),
                           SHIM_USR1_WHEN_READY="2", SHIM_RESTART_COUNT="1")
    assert result.returncode == 0, result.stdout + result.stderr
    pythons = calls(lines, "python")
    assert len(pythons) == 2
    assert all(args[args.index("--resume") + 1] == "true" for args in pythons)
    assert "restart 1" in result.stdout


def test_no_requeue_when_ranks_fail_or_too_many_restarts(shims, tmp_path):
    venv = _fake_venv(tmp_path)
    result, lines = submit("cpu.sbatch", shims, tmp_path, NTASKS_PER_NODE="2", VENV=str(venv),
                           SHIM_USR1_WHEN_READY="2", FAKE_EXIT="1")
    assert result.returncode != 0
    assert not calls(lines, "scontrol") and "not requeueing" in result.stderr

    shims[1].unlink()
    result, lines = submit("cpu.sbatch", shims, tmp_path, NTASKS_PER_NODE="2", VENV=str(venv),
                           SHIM_USR1_WHEN_READY="2", SHIM_RESTART_COUNT="3", MAX_REQUEUES="3")
    assert result.returncode == 1
    assert not calls(lines, "scontrol") and "3 restarts already" in result.stderr


def test_missing_venv_is_one_clear_line(shims, tmp_path):
    result, lines = submit("cpu.sbatch", shims, tmp_path, VENV=str(tmp_path / "nowhere"))
    assert result.returncode == 2
    assert result.stderr.strip() == f"no python at {tmp_path}/nowhere/bin/python: set VENV to " \
                                    f"the venv with mpishard"
    assert not calls(lines, "srun")

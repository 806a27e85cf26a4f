"""The Slurm templates in slurm/, run end to end on this machine.

``sbatch``, ``srun`` and ``scontrol`` are replaced by shims (small bash scripts
put first on PATH). The ``sbatch`` shim reads the script's ``#SBATCH`` lines up
to its first command, as sbatch does, then the flags of its own command line
(which win over them), and runs the job script at once with bash and the
SLURM_* variables a job of that shape would have (and, on request, sends it
USR1 as ``--signal=B:USR1@...`` would, once the ranks run); the ``srun`` shim
runs the command under this venv's ``mpiexec`` with the task count srun would
start; ``scontrol`` only records its arguments. Each template is submitted both
ways a user can: ``bash slurm/X.sbatch`` (it calls sbatch on itself) and plain
``sbatch slurm/X.sbatch``. Each trains a tiny GPT for a few steps on 2 ranks;
the requeue path, the #SBATCH defaults at full size and the allocation check
are driven with stand-in ranks that "checkpoint" on USR1 and exit 0.
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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
cli=()                                   # sbatch's own flags, then the script and its arguments
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do cli+=("$1"); shift; done
script=$1
shift
directives=()                            # the #SBATCH lines, up to the script's first command
while IFS= read -r line; do
    case $line in
        '#SBATCH '*) read -ra words <<< "${line#\#SBATCH }"; directives+=("${words[@]}") ;;
        '#'* | '') ;;
        *) break ;;
    esac
done < "$script"
nodes=1 per_node= ntasks= cpus= name=${script##*/} gpus_node= gpus_task= time= signal= output=
for opt in "${directives[@]}" "${cli[@]}"; do   # later wins: the command line over #SBATCH
    case $opt in
        --nodes=*) nodes=${opt#*=} ;;
        --ntasks-per-node=*) per_node=${opt#*=} ;;
        --ntasks=*) ntasks=${opt#*=} ;;
        --cpus-per-task=*) cpus=${opt#*=} ;;
        --job-name=*) name=${opt#*=} ;;
        --gpus-per-node=*) gpus_node=${opt#*=} ;;
        --gpus-per-task=*) gpus_task=${opt#*=} ;;
        --time=*) time=${opt#*=} ;;
        --signal=*) signal=${opt#*=} ;;
        --output=*) output=${opt#*=} ;;
    esac
done
if [ -n "$per_node" ]; then ntasks=$((nodes * per_node)); fi
ntasks=${ntasks:-$nodes}
tasks=$(((ntasks + nodes - 1) / nodes))  # tasks on each node
gpus=0
if [ -n "$gpus_node" ]; then gpus=${gpus_node##*:}; fi
if [ -n "$gpus_task" ]; then gpus=$((${gpus_task##*:} * tasks)); fi
echo "allocation nodes=$nodes ntasks=$ntasks tasks_per_node=$tasks cpus_per_task=$cpus" \
     "gpus_on_node=$gpus time=$time signal=$signal output=$output name=$name" >> "$SHIM_LOG"
export SLURM_JOB_ID=$SHIM_JOB_ID SLURM_JOB_NAME=$name SLURM_JOB_NUM_NODES=$nodes \
    SLURM_NNODES=$nodes SLURM_NTASKS=$ntasks SLURM_TASKS_PER_NODE="$tasks(x$nodes)" \
    SLURM_SUBMIT_DIR=$PWD SLURM_JOB_NODELIST="shim[1-$nodes]"
# As in a job: each of these only when the job asked for it.
if [ -n "$per_node" ]; then export SLURM_NTASKS_PER_NODE=$per_node; fi
if [ -n "$cpus" ]; then export SLURM_CPUS_PER_TASK=$cpus; fi
if [ -n "$gpus_node" ]; then export SLURM_GPUS_PER_NODE=$gpus_node; fi
if [ -n "$gpus_task" ]; then export SLURM_GPUS_PER_TASK=$gpus_task; fi
if [ "$gpus" -gt 0 ]; then export SLURM_GPUS_ON_NODE=$gpus; fi
if [ -n "${SHIM_RESTART_COUNT:-}" ]; then export SLURM_RESTART_COUNT=$SHIM_RESTART_COUNT; fi
bash "$script" "$@" &
pid=$!
if [ -n "${SHIM_USR1_WHEN_READY:-}" ]; then  # as --signal=B:USR1@T: to the batch shell only,
    ready=0                                  # once that many ranks run (as late in a job);
    for _ in $(seq 1100); do                 # on a loaded machine the launch takes a while,
        if [ "$(find "$SHIM_READY" -type f | wc -l)" -ge "$SHIM_USR1_WHEN_READY" ]; then
            ready=1                          # and a signal before the ranks' handlers
            break                            # would kill the job, not test it
        fi
        sleep 0.1
    done
    if [ "$ready" = 1 ]; then
        kill -USR1 "$pid"
    else
        echo "sbatch shim: $SHIM_USR1_WHEN_READY ranks never started in 110 s" >&2
    fi
fi
wait "$pid"
"""

# srun stand-in: drop srun's own --options, run the command under mpiexec with the
# task count srun would start (--ntasks, else the job's), refusing more than the job
# has, as srun does. The job's SLURM_* variables are removed (else mpiexec would itself
# try to launch through srun); SLURM_NTASKS and SLURM_STEP_NUM_TASKS stay, as
# check_launcher reads them.
SRUN_SHIM = r"""#!/bin/bash
echo "srun $*" >> "$SHIM_LOG"
n=$SLURM_NTASKS
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do
    case $1 in --ntasks=*) n=${1#*=} ;; esac
    shift
done
if [ "$n" -gt "$SLURM_NTASKS" ]; then
    echo "srun: error: $n tasks asked for, the job has $SLURM_NTASKS" >&2
    exit 1
fi
for var in $(compgen -e | grep '^SLURM_'); do unset "$var"; done
export SLURM_NTASKS=$n SLURM_STEP_NUM_TASKS=$n
exec @MPIEXEC@ -n "$n" "$@"
"""

SCONTROL_SHIM = r"""#!/bin/bash
echo "scontrol $*" >> "$SHIM_LOG"
"""

# A stand-in for the venv's python, launched as every rank: records its arguments,
# and on USR1 "writes a checkpoint" (a step-N directory) and exits with FAKE_EXIT. As
# the supervisor (python -m mpishard supervise ... -- JOB) it runs JOB in its place.
FAKE_PYTHON = r"""#!/bin/bash
if [ "$1 $2 $3" = "-m mpishard supervise" ]; then  # as the supervisor: run its job once
    echo "supervise $*" >> "$SHIM_LOG"
    while [ "$1" != -- ]; do shift; done
    shift
    exec "$@"
fi
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


# apptainer stand-in for slurm/apptainer-python: checks the exec line's shape, sets the
# --env variables and runs "python" as this venv's python (the image's, were it real).
FAKE_APPTAINER = r"""#!/bin/bash
echo "apptainer $*" >> "$SHIM_LOG"
[ "$1" = exec ] || { echo "apptainer shim: only exec" >&2; exit 64; }
shift
while [ $# -gt 0 ]; do
    case $1 in
        --nv) shift ;;
        --bind) shift 2 ;;
        --env) export "${2?}"; shift 2 ;;
        -*) echo "apptainer shim: unknown option $1" >&2; exit 64 ;;
        *) break ;;
    esac
done
[ -f "$1" ] || { echo "apptainer shim: no image $1" >&2; exit 255; }
[ "$2" = python ] || { echo "apptainer shim: runs python only" >&2; exit 64; }
shift 2
exec "$IMAGE_PYTHON" "$@"
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


def _run(command, shims, tmp_path, timeout, settings):
    bin_dir, log = shims
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PMI_", "PMIX_", "OMPI_COMM_WORLD", "HYDRA_",
                                "MPISHARD_", "CUDA_VISIBLE_DEVICES"))}
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '')}", SHIM_LOG=str(log), SHIM_JOB_ID=JOB_ID,
               PYTHONPATH=str(ROOT), VENV=str(VENV), RUN_ROOT=str(tmp_path / "runs"),
               TRAIN_ARGS=TINY, CPUS_PER_TASK="1", SRUN_MPI="pmi2", WATCHDOG_SECONDS="120")
    env.update(settings)
    for name in [k for k, v in env.items() if v is None]:   # None: leave the variable unset
        del env[name]
    env["SHIM_READY"] = tempfile.mkdtemp(dir=tmp_path)   # the stand-in ranks check in here
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
                            cwd=ROOT)
    lines = log.read_text().splitlines() if log.exists() else []
    return result, lines


def submit(template, shims, tmp_path, timeout=120, **settings):
    """``bash slurm/TEMPLATE`` as a user would submit it; returns (result, log lines)."""
    return _run(["bash", str(SLURM / template)], shims, tmp_path, timeout, settings)


def sbatch(template, shims, tmp_path, *flags, timeout=120, **settings):
    """``sbatch FLAGS slurm/TEMPLATE``: the #SBATCH lines, overridden by FLAGS."""
    return _run(["sbatch", *flags, f"slurm/{template}"], shims, tmp_path, timeout, settings)


def calls(lines, program):
    return [shlex.split(line)[1:] for line in lines if line.split()[0] == program]


def allocation(lines) -> dict:
    """The job's shape as the sbatch shim worked it out (#SBATCH lines, then flags)."""
    (words,) = calls(lines, "allocation")
    return dict(word.split("=", 1) for word in words)


def sbatch_lines(template) -> list:
    """The ``#SBATCH`` options sbatch reads: those before the script's first command."""
    options = []
    for line in (SLURM / template).read_text().splitlines()[1:]:
        if line.startswith("#SBATCH "):
            options += line.split()[1:]
        elif line.strip() and not line.startswith("#"):
            break
    return options


@pytest.mark.parametrize("template", [*TEMPLATES, "apptainer-python"])
def test_bash_syntax(template):
    out = subprocess.run(["bash", "-n", str(SLURM / template)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("template", [*TEMPLATES, "apptainer-python"])
def test_shellcheck(template):
    if not shutil.which("shellcheck"):
        pytest.skip("no shellcheck on PATH")
    out = subprocess.run(["shellcheck", str(SLURM / template)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# A job that exits 0 as soon as USR1 reaches it, and a trap that forwards USR1 to it and
# returns only once it has exited: the batch shell's wait is interrupted (128 + 10) and
# the job is already gone when the script looks again, as under load.
WAIT_HARNESS = r"""
job() { trap 'exit 0' USR1; touch "$READY"; while :; do sleep 0.05; done; }
on_usr1() {
    time_up=1 interrupted=1
    kill -USR1 "$job_pid"
    while kill -0 "$job_pid" 2> /dev/null && [ "$(ps -o stat= -p "$job_pid")" != Z ]; do
        sleep 0.05
    done
}
time_up=0 interrupted=0
job &
job_pid=$!
trap on_usr1 USR1
( while [ ! -f "$READY" ]; do sleep 0.05; done; kill -USR1 $$ ) &
@WAIT@
echo "status=$status time_up=$time_up"
"""


@pytest.mark.parametrize("template", TEMPLATES)
def test_a_job_that_ends_before_the_trap_returns_keeps_its_own_status(template, tmp_path):
    """The template's wait for the job, run with a job that exits 0 on USR1 before the
    trap returns: the status is the job's (0, so the job requeues), not the interrupted
    wait's 138."""
    text = (SLURM / template).read_text()
    start = text.index('status=0\nwait "$job_pid"')
    end = text.index("\ndone\n", start) + len("\ndone\n")
    script = tmp_path / "wait.sh"
    script.write_text(WAIT_HARNESS.replace("@WAIT@", text[start:end]))
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, READY=str(tmp_path / "ready")))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "status=0 time_up=1", out.stdout + out.stderr


@pytest.mark.parametrize("template", TEMPLATES)
def test_no_site_specific_paths(template):
    text = (SLURM / template).read_text()
    assert not re.search(r"(/home/|/scratch/|/gpfs/|/lustre/|/work/|/opt/|/apps/)", text)
    head = text.split("# ---- submit")[0]
    for setting in ("ACCOUNT", "PARTITION", "TIME", "MODULES", "VENV", "SRUN_MPI",
                    "SIGNAL_SECONDS"):
        assert re.search(rf"^{setting}=\$\{{{setting}:-[^}}]*\}}\s+# \S", head, re.M), \
            f"{template}: {setting} is not a commented variable at the top"
    assert re.search(r"^SRUN_MPI=\$\{SRUN_MPI:-auto\}", head, re.M)


# What plain 'sbatch slurm/X.sbatch' asks for (slurm/README.md lists the same).
SBATCH_DEFAULTS = {
    "cpu.sbatch": {"--nodes": "1", "--ntasks-per-node": "8", "--cpus-per-task": "4",
                   "--mem": "64G", "--time": "02:00:00"},
    "gpu.sbatch": {"--nodes": "1", "--ntasks-per-node": "4", "--gpus-per-node": "4",
                   "--cpus-per-task": "8", "--mem": "128G", "--time": "02:00:00"},
    "multinode.sbatch": {"--nodes": "2", "--ntasks-per-node": "4", "--gpus-per-node": "4",
                         "--cpus-per-task": "8", "--mem": "128G", "--time": "04:00:00"},
}


JOB_NAMES = {"cpu.sbatch": "mpishard-cpu", "gpu.sbatch": "mpishard-gpu",
             "multinode.sbatch": "mpishard-multinode"}


@pytest.mark.parametrize("template", TEMPLATES)
def test_sbatch_lines_hold_the_defaults(template):
    options = sbatch_lines(template)
    values = dict(option.split("=", 1) for option in options if "=" in option)
    for option, value in SBATCH_DEFAULTS[template].items():
        assert values.get(option) == value, f"{template}: #SBATCH {option}={value}"
    text = (SLURM / template).read_text()
    signal = re.search(r"^SIGNAL_SECONDS=\$\{SIGNAL_SECONDS:-(\d+)\}", text, re.M).group(1)
    assert values["--signal"] == f"B:USR1@{signal}"      # the variable says what Slurm does
    assert values["--job-name"] == JOB_NAMES[template]
    assert re.search(rf"^JOB_NAME=\$\{{JOB_NAME:-{JOB_NAMES[template]}\}}", text, re.M)
    assert {"--requeue", "--open-mode=append"} <= set(options)
    assert "%j" in values["--output"] and "/" not in values["--output"]   # the submit dir exists
    assert not any(o.startswith("--gpus-per-task") for o in options)      # it binds ranks to GPUs
    # every #SBATCH line is read: none comes after the first command
    assert text.count("\n#SBATCH ") == len(options)


@pytest.mark.parametrize("template", TEMPLATES)
def test_header_says_how_to_build_mpi4py_for_several_nodes(template):
    header = (SLURM / template).read_text().split("\n#SBATCH ")[0]
    assert "Across nodes" in header and "site's MPI" in header and "TCP" in header
    assert "MPICC=mpicc pip install --no-binary mpi4py --no-cache-dir mpi4py" in header
    text = (SLURM / template).read_text()
    for setting in ("DATA", "INIT_FROM", "CHECKPOINT_DIR", "CONFIG", "MEM"):
        assert re.search(rf"^{setting}=\$\{{{setting}:-\}}\s+# \S", text, re.M), setting


# Settings that make each template start exactly 2 ranks here.
TWO_RANKS = {
    "cpu.sbatch": {"NTASKS_PER_NODE": "2"},
    "gpu.sbatch": {"GPUS": "2", "BACKEND": "numpy"},
    "multinode.sbatch": {"NODES": "2", "GPUS_PER_NODE": "1", "BACKEND": "numpy"},
}


def _trained_on_two_ranks(result, run_dir):
    out = result.stdout
    assert "world 2 = mesh pp=1 x dp_replicate=1 x dp_shard=2 x cp=1 x tp=1 (dp=2)" in out \
        and "OMP_NUM_THREADS=1" in out
    assert "OMP_NUM_THREADS=1, resume=" in out                  # the job's own line says it
    assert f"after {STEPS} steps (zero2, 2 ranks)" in out
    metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert sum('"loss"' in line for line in metrics) == STEPS
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank-0.log", "rank-1.log"]


@pytest.mark.parametrize("template", TEMPLATES)
def test_template_trains_end_to_end(template, shims, tmp_path):
    run_dir = tmp_path / "runs" / f"{JOB_NAMES[template]}-{JOB_ID}"
    (run_dir / "checkpoints" / "step-2.tmp").mkdir(parents=True)   # a killed save: not resumed
    result, lines = submit(template, shims, tmp_path, ACCOUNT="proj42", **TWO_RANKS[template])
    assert result.returncode == 0, result.stdout + result.stderr

    (sbatch_call,) = calls(lines, "sbatch")
    flags, script = sbatch_call[:-1], sbatch_call[-1]
    assert script.endswith(f"slurm/{template}")
    assert "--account=proj42" in flags and "--requeue" in flags
    assert "--signal=B:USR1@300" in flags
    assert not any(f.startswith("--partition") for f in flags)     # empty setting: no flag
    if template == "gpu.sbatch":
        assert "--gpus-per-node=2" in flags and "--ntasks-per-node=2" in flags
    if template == "multinode.sbatch":
        assert {"--nodes=2", "--gpus-per-node=1", "--ntasks-per-node=1"} <= set(flags)
    assert allocation(lines)["ntasks"] == "2"

    (srun,) = calls(lines, "srun")
    assert "--mpi=pmi2" in srun and "--ntasks=2" in srun
    train = srun[srun.index("train") + 1:]
    assert f"--job-name={JOB_NAMES[template]}" in flags
    assert train[train.index("--checkpoint-dir") + 1] == str(run_dir / "checkpoints")
    assert train[train.index("--resume") + 1] == "false"
    assert "--checkpoint-interval" not in train                 # the TOML's, unless set
    assert not calls(lines, "scontrol")                          # finished: no requeue
    assert "srun --mpi=pmi2 (set by SRUN_MPI)" in result.stdout
    _trained_on_two_ranks(result, run_dir)


def test_a_rank_that_dies_is_restarted_within_the_job(shims, tmp_path):
    """Rank 1 is SIGKILLed writing step 2's checkpoint (once): srun ends the step, the
    template's supervisor starts it again from step 1, and the job ends with status 0,
    each step in the metrics once and the restart recorded with its cause."""
    from ckpt_scripts.common import INJECT

    result, lines = submit("cpu.sbatch", shims, tmp_path, NTASKS_PER_NODE="2",
                           CHECKPOINT_INTERVAL="1", RESTART_BACKOFF="0",
                           PYTHONPATH=f"{INJECT}:{ROOT}",
                           MPISHARD_TEST_KILL_IN_SAVE=f"1:2:write:{tmp_path / 'killed'}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "test: rank 1 killed writing step-2.tmp" in result.stderr
    assert "mpishard supervise: the job failed" in result.stdout, result.stdout
    assert "resuming from step-1" in result.stdout, result.stdout
    assert len(calls(lines, "srun")) == 2
    run_dir = tmp_path / "runs" / f"{JOB_NAMES['cpu.sbatch']}-{JOB_ID}"
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    (restart,) = [r for r in records if r.get("event") == "restart"]
    assert restart["resume"] == "step-1" and restart["exit_code"] != 0


# Plain 'sbatch FLAGS slurm/X.sbatch' for 2 ranks: the flags win over the #SBATCH lines.
PLAIN_TWO_RANKS = {
    "cpu.sbatch": (["--ntasks-per-node=2"], {}),
    "gpu.sbatch": (["--ntasks-per-node=2", "--gpus-per-node=2"], {"BACKEND": "numpy"}),
    "multinode.sbatch": (["--ntasks-per-node=1", "--gpus-per-node=1"], {"BACKEND": "numpy"}),
}


def _library_pmi():
    """What SRUN_MPI=auto must pick for this venv's MPI, and mpishard.comm.slurm's description."""
    from mpi4py import MPI

    described = subprocess.run([sys.executable, "-m", "mpishard.comm.slurm", "describe"],
                               capture_output=True, text=True, check=True, cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.strip()
    expected = {"MPICH": "pmi2", "Open MPI": "pmix"}.get(MPI.get_vendor()[0])
    if expected is None:
        pytest.skip(f"no known srun --mpi for {MPI.get_vendor()[0]}")
    return expected, described


@pytest.mark.parametrize("template", TEMPLATES)
def test_plain_sbatch_trains_end_to_end(template, shims, tmp_path):
    flags, settings = PLAIN_TWO_RANKS[template]
    flags = [*flags, "--cpus-per-task=1", "--time=00:30:00"]
    result, lines = sbatch(template, shims, tmp_path, *flags, SRUN_MPI=None, CPUS_PER_TASK=None,
                           **settings)
    assert result.returncode == 0, result.stdout + result.stderr

    (sbatch_call,) = calls(lines, "sbatch")                  # the script did not resubmit itself
    assert sbatch_call == [*flags, f"slurm/{template}"]
    shape = allocation(lines)
    defaults = SBATCH_DEFAULTS[template]
    assert shape["name"] == JOB_NAMES[template]              # from the #SBATCH lines...
    assert shape["signal"] == "B:USR1@300" and shape["nodes"] == defaults["--nodes"]
    assert shape["ntasks"] == "2" and shape["time"] == "00:30:00"   # ...and the flags win
    assert shape["cpus_per_task"] == "1"

    (srun,) = calls(lines, "srun")
    expected, described = _library_pmi()                     # SRUN_MPI=auto, the default
    assert f"--mpi={expected}" in srun and "--ntasks=2" in srun   # pmi2 for the MPICH wheel
    assert "--cpus-per-task=1" in srun
    head = result.stdout.splitlines()[:3]
    assert any(line == f"mpishard job {JOB_ID}: srun --mpi={expected} (SRUN_MPI=auto, from "
                       f"the MPI mpi4py loads: {described})" for line in head), head
    _trained_on_two_ranks(result, tmp_path / "runs" / f"{JOB_NAMES[template]}-{JOB_ID}")


def _fake_venv(tmp_path) -> Path:
    venv = tmp_path / "fake-venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return venv


@pytest.mark.parametrize("template", TEMPLATES)
def test_plain_sbatch_takes_the_sbatch_lines(template, shims, tmp_path):
    """``sbatch slurm/X.sbatch`` alone: the #SBATCH shape, at full size, with stand-in ranks."""
    defaults = SBATCH_DEFAULTS[template]
    ntasks = int(defaults["--nodes"]) * int(defaults["--ntasks-per-node"])
    venv = _fake_venv(tmp_path)
    result, lines = sbatch(template, shims, tmp_path, VENV=str(venv), CPUS_PER_TASK=None,
                           SHIM_USR1_WHEN_READY=str(ntasks))
    assert result.returncode == 0, result.stdout + result.stderr
    shape = allocation(lines)
    assert shape["ntasks"] == str(ntasks) and shape["time"] == defaults["--time"]
    assert shape["cpus_per_task"] == defaults["--cpus-per-task"]
    assert shape["gpus_on_node"] == defaults.get("--gpus-per-node", "0")
    (srun,) = calls(lines, "srun")
    assert f"--ntasks={ntasks}" in srun and f"--cpus-per-task={defaults['--cpus-per-task']}" in srun
    pythons = calls(lines, "python")
    assert len(pythons) == ntasks
    if template != "cpu.sbatch":                             # GPUs in the job: CuPy, float16
        assert all(p[p.index("--backend") + 1] == "cupy" for p in pythons)
        assert all(p[p.index("--precision") + 1] == "float16" for p in pythons)
    assert f"OMP_NUM_THREADS={defaults['--cpus-per-task']}, resume=false" in result.stdout
    assert result.stdout.count("rank got USR1") == ntasks
    assert calls(lines, "scontrol") == [["requeue", JOB_ID]]


# 'bash slurm/X.sbatch' with site variables: their flags win over the #SBATCH lines.
SELF_SUBMIT = {
    "cpu.sbatch": ({"TIME": "00:10:00", "NTASKS_PER_NODE": "2"},
                   ["--time=00:10:00", "--ntasks-per-node=2"], {"ntasks": "2", "time": "00:10:00"}),
    "gpu.sbatch": ({"GPU_TYPE": "a100"}, ["--gpus-per-node=a100:4"],
                   {"ntasks": "4", "gpus_on_node": "4"}),
    "multinode.sbatch": ({"GPUS_PER_NODE": "0", "NTASKS_PER_NODE": "2"},
                         ["--gpus-per-node=0", "--ntasks-per-node=2"],
                         {"ntasks": "4", "gpus_on_node": "0"}),
}


@pytest.mark.parametrize("template", TEMPLATES)
def test_self_submit_flags_win_over_sbatch_lines(template, shims, tmp_path):
    settings, flags, shape = SELF_SUBMIT[template]
    venv = _fake_venv(tmp_path)
    result, lines = submit(template, shims, tmp_path, VENV=str(venv),
                           SHIM_USR1_WHEN_READY=shape["ntasks"], **settings)
    assert result.returncode == 0, result.stdout + result.stderr
    (sbatch_call,) = calls(lines, "sbatch")
    assert set(flags) <= set(sbatch_call)
    assert shape.items() <= allocation(lines).items()
    assert len(calls(lines, "python")) == int(shape["ntasks"])
    if template == "multinode.sbatch":                        # CPU nodes: NumPy, float32
        pythons = calls(lines, "python")
        assert all(p[p.index("--backend") + 1] == "numpy" for p in pythons)
        assert all(p[p.index("--precision") + 1] == "float32" for p in pythons)


# Allocations a template cannot run: (template, sbatch flags, settings, words of the message).
MISFITS = {
    "gpu-fewer-gpus-than-tasks": (
        "gpu.sbatch", ["--ntasks-per-node=2", "--gpus-per-node=1"], {},
        ["one rank per GPU needs 2 GPUs for 2 tasks, the job has 1", "SLURM_NTASKS=2",
         "SLURM_GPUS_ON_NODE", "sbatch --ntasks-per-node=2 --gpus-per-node=2",
         "(or --ntasks-per-node=1 --gpus-per-node=1)"]),
    "gpu-no-gpus": (
        "gpu.sbatch", ["--gpus-per-node=0"], {},
        ["needs 4 GPUs for 4 tasks, the job has 0", "--gpus-per-node=4"]),
    "gpu-two-nodes": (
        "gpu.sbatch", ["--nodes=2"], {},
        ["gpu.sbatch runs on one node but the job has 2", "sbatch --nodes=1",
         "slurm/multinode.sbatch"]),
    "gpu-GPUS-differs": (
        "gpu.sbatch", [], {"GPUS": "2"},
        ["GPUS=2 ranks but the job has 4 tasks", "SLURM_NTASKS=4",
         "sbatch --ntasks-per-node=2 --gpus-per-node=2", "unset GPUS"]),
    "cpu-NTASKS_PER_NODE-differs": (
        "cpu.sbatch", ["--ntasks-per-node=2"], {"NTASKS_PER_NODE": "4"},
        ["NTASKS_PER_NODE=4 but the job has 2 tasks per node", "SLURM_NTASKS=2",
         "sbatch --ntasks-per-node=4", "unset NTASKS_PER_NODE"]),
    "cpu-NODES-differs": (
        "cpu.sbatch", [], {"NODES": "3"},
        ["NODES=3 but the job has 1 nodes", "SLURM_JOB_NUM_NODES=1", "sbatch --nodes=3"]),
    "multinode-fewer-gpus-than-tasks": (
        "multinode.sbatch", ["--ntasks-per-node=8"], {},
        ["needs 8 GPUs per node for 8 tasks per node, the job has 4", "SLURM_NTASKS=16",
         "--ntasks-per-node=8 --gpus-per-node=8", "(or --ntasks-per-node=4 --gpus-per-node=4)"]),
    "multinode-NODES-differs": (
        "multinode.sbatch", [], {"NODES": "4"},
        ["NODES=4 but the job has 2 nodes", "SLURM_JOB_NUM_NODES=2", "sbatch --nodes=4"]),
    "multinode-GPUS_PER_NODE-differs": (
        "multinode.sbatch", [], {"GPUS_PER_NODE": "8"},
        ["GPUS_PER_NODE=8 ranks per node but the job has 4 tasks per node",
         "sbatch --ntasks-per-node=8 --gpus-per-node=8"]),
}


@pytest.mark.parametrize("case", sorted(MISFITS))
def test_allocation_misfit_is_one_clear_line(case, shims, tmp_path):
    template, flags, settings, words = MISFITS[case]
    venv = _fake_venv(tmp_path)     # were the job to start, its ranks would sleep and exit 3
    result, lines = sbatch(template, shims, tmp_path, *flags, VENV=str(venv), CPUS_PER_TASK=None,
                           **settings)
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"mpishard job {JOB_ID}: allocation does not fit: "), line
    for word in words:
        assert word in line, (word, line)
    assert not calls(lines, "srun") and not calls(lines, "python")


def test_template_runs_in_the_container_through_apptainer_python(shims, tmp_path):
    """VENV=a folder whose bin/python is slurm/apptainer-python: every python of the job,
    srun --mpi=auto's included, runs through 'apptainer exec' with the site MPI bound in
    (here the venv's own MPICH wheel stands in for the site MPI)."""
    site_mpi = VENV                                   # its lib/ holds libmpi.so.12
    libmpi = next(p for p in (site_mpi / "lib").glob("libmpi.so*") if p.name != "libmpi.so")
    container = tmp_path / "sif"
    (container / "bin").mkdir(parents=True)
    (container / "bin" / "python").symlink_to(SLURM / "apptainer-python")
    image = tmp_path / "mpishard.sif"
    image.write_text("stand-in image")
    apptainer = shims[0] / "apptainer"
    apptainer.write_text(FAKE_APPTAINER)
    apptainer.chmod(0o755)
    result, lines = sbatch("cpu.sbatch", shims, tmp_path, "--ntasks-per-node=2", "--cpus-per-task=1",
                           VENV=str(container), SIF=str(image), SITE_MPI=str(site_mpi),
                           SITE_LIBS=str(tmp_path), IMAGE_PYTHON=sys.executable, SRUN_MPI=None,
                           CPUS_PER_TASK=None)
    assert result.returncode == 0, result.stdout + result.stderr
    runs = calls(lines, "apptainer")
    assert len(runs) == 5           # slurm pmi, slurm describe, the supervisor, 2 ranks
    assert sum("supervise" in args for args in runs) == 1
    for args in runs:
        assert args[:4] == ["exec", "--nv", "--bind", f"{site_mpi},{tmp_path}"]
        assert f"MPI4PY_LIBMPI={site_mpi}/lib/{libmpi.name}" in args
        assert f"LD_LIBRARY_PATH={site_mpi}/lib:{tmp_path}" in args
        assert args[args.index(str(image)) + 1] == "python"
    assert sum("train" in args and "supervise" not in args for args in runs) == 2
    expected, _ = _library_pmi()          # pmi2 for the MPICH wheel, pmix for Open MPI's
    assert f"mpishard job {JOB_ID}: srun --mpi={expected} (SRUN_MPI=auto" in result.stdout
    _trained_on_two_ranks(result, tmp_path / "runs" / f"mpishard-cpu-{JOB_ID}")


def test_apptainer_python_without_a_libmpi_is_one_clear_line(tmp_path):
    out = subprocess.run([str(SLURM / "apptainer-python"), "-V"], capture_output=True, text=True,
                         env={**os.environ, "SIF": "x.sif", "SITE_MPI": str(tmp_path)})
    assert out.returncode == 2
    assert out.stderr.strip() == (f"apptainer-python: no libmpi under {tmp_path}/lib or lib64: "
                                  f"set MPI4PY_LIBMPI")


def test_explicit_srun_mpi_wins(shims, tmp_path):
    venv = _fake_venv(tmp_path)
    result, lines = sbatch("cpu.sbatch", shims, tmp_path, "--ntasks-per-node=2", VENV=str(venv),
                           SRUN_MPI="pmix", SHIM_USR1_WHEN_READY="2")
    assert result.returncode == 0, result.stdout + result.stderr
    (srun,) = calls(lines, "srun")
    assert "--mpi=pmix" in srun
    assert f"mpishard job {JOB_ID}: srun --mpi=pmix (set by SRUN_MPI)" in result.stdout
    assert all("mpishard.comm.slurm" not in args for args in calls(lines, "python"))  # not asked


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


def test_multinode_hybrid_sharding_replicates_across_nodes(shims, tmp_path):
    """DP_REPLICATE=nodes: one replica of the sharded state per node (2 nodes x 1 rank)."""
    result, lines = submit("multinode.sbatch", shims, tmp_path, DP_REPLICATE="nodes",
                           **TWO_RANKS["multinode.sbatch"])
    assert result.returncode == 0, result.stdout + result.stderr
    (srun,) = calls(lines, "srun")
    train = srun[srun.index("train") + 1:]
    assert train[train.index("--dp-replicate") + 1] == "2"
    assert "mesh pp=1 x dp_replicate=2 x dp_shard=1 x cp=1 x tp=1 (dp=2)" in result.stdout


@pytest.mark.parametrize("template", TEMPLATES)
def test_data_weights_and_checkpoints_reach_every_rank(template, shims, tmp_path):
    """DATA, INIT_FROM, CHECKPOINT_DIR and CONFIG become the ranks' flags; a checkpoint in
    CHECKPOINT_DIR is resumed; without CONFIG no TOML is passed (nor the demo's)."""
    venv = _fake_venv(tmp_path)
    ckpt = tmp_path / "project" / "checkpoints"
    (ckpt / "step-40").mkdir(parents=True)                     # an earlier job's
    result, lines = submit(template, shims, tmp_path, VENV=str(venv), DATA="data/books",
                           INIT_FROM="models/tiny-llama", CHECKPOINT_DIR=str(ckpt),
                           CONFIG="my.toml", SHIM_USR1_WHEN_READY="2", **TWO_RANKS[template])
    assert result.returncode == 0, result.stdout + result.stderr
    pythons = calls(lines, "python")
    assert len(pythons) == 2
    for args in pythons:
        train = args[args.index("train") + 1:]
        flags = dict(zip(train[::2], train[1::2]))
        assert flags["--data"] == "data/books" and flags["--init-from"] == "models/tiny-llama"
        assert flags["--checkpoint-dir"] == str(ckpt) and flags["--resume"] == "true"
        assert flags["--config"] == "my.toml"
        if template != "cpu.sbatch":     # GPU templates: bfloat16 weights keep their range
            assert flags["--precision"] == "float32"
    assert (ckpt / "step-7").is_dir()                          # USR1 "checkpointed" there
    shims[1].unlink()
    result, lines = submit(template, shims, tmp_path, VENV=str(venv), CONFIG=None,
                           SHIM_USR1_WHEN_READY="2", **TWO_RANKS[template])
    assert result.returncode == 0, result.stdout + result.stderr
    for args in calls(lines, "python"):
        assert not {"--config", "--data", "--init-from"} & set(args)
        if template != "cpu.sbatch":     # from scratch on GPUs: float16, loss-scaled
            assert args[args.index("--precision") + 1] == "float16"
        run_dir = tmp_path / "runs" / f"{JOB_NAMES[template]}-{JOB_ID}"
        assert args[args.index("--checkpoint-dir") + 1] == str(run_dir / "checkpoints")

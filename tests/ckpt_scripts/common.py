"""Helpers shared by the checkpoint tests and the scripts they launch.

Tests import this as ``ckpt_scripts.common``; scripts in this folder as ``common``.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPTS = ROOT / "tests" / "ckpt_scripts"
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def build(kind: str, comm, dtype: str = "float64", seed: int = 0, cfg=None):
    """A GPT wrapped with ``kind`` (ddp, zero1, zero2, zero3) over all of ``comm``."""
    from mpishard.comm import Mesh
    from mpishard.models import GPT, GPTConfig
    from mpishard.parallel import DataParallel, ZeRO

    cfg = cfg or GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=10)
    mesh = Mesh(comm, dp=comm.size)
    if kind == "ddp":
        return DataParallel(GPT(cfg, seed=seed, dtype=dtype), mesh)
    stage = int(kind[-1])
    return ZeRO(GPT(cfg, seed=seed, dtype=dtype, materialize_now=stage != 3), mesh, stage=stage)


def full_tensors(strategy, optimizer, comm) -> dict:
    """``(name, kind) -> whole flat array`` from every rank's owned pieces (on every rank)."""
    from mpishard.core.backend import to_numpy
    from mpishard.parallel import pieces_of

    owned = [(p.name, p.kind, tuple(p.global_shape), p.runs, np.array(to_numpy(p.array)))
             for p in pieces_of(strategy, optimizer) if p.owner]
    full: dict = {}
    for rank_pieces in comm.all_gather_obj(owned):
        for name, kind, shape, runs, values in rank_pieces:
            flat = full.setdefault((name, kind), np.full(int(np.prod(shape)), np.nan,
                                                         values.dtype))
            pos = 0
            for a, b in runs:
                flat[a:b] = values[pos:pos + b - a]
                pos += b - a
    return full


@contextlib.contextmanager
def shared_tmp(comm):
    """A temporary directory every rank of ``comm`` sees (made by rank 0, removed at the end)."""
    path = comm.broadcast_obj(tempfile.mkdtemp(prefix="mpishard-ckpt-") if comm.rank == 0
                              else None)
    try:
        yield Path(path)
    finally:
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(path, ignore_errors=True)


#: launcher settings a child mpiexec needs (Open MPI as root, oversubscribed): kept
LAUNCHER_SETTINGS = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")


def clean_env(**extra) -> dict:
    """The environment for a child ``mpiexec``: none of the variables of the job this
    process may run in (rank, size, PMI, Slurm), but the launcher's own settings
    (``LAUNCHER_SETTINGS``, ``PRTE_MCA_*``), and 1 BLAS thread."""
    env = {k: v for k, v in os.environ.items()
           if k in LAUNCHER_SETTINGS or k.startswith("PRTE_MCA_")
           or not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPIR_", "MPISHARD_",
                                "SLURM_", "PRTE_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", **extra)
    return env


def run_mpishard(*args, n=None, timeout=120, cwd=None, env=None) -> subprocess.CompletedProcess:
    """``python -m mpishard ARGS``, or with ``n`` the same under ``mpiexec -n N python -m
    mpi4py``, from the source tree, 1 BLAS thread, outside the job this process may run in;
    ``env`` adds or replaces variables."""
    cmd = [sys.executable, "-m", "mpishard", *map(str, args)]
    if n is not None:
        cmd = [str(MPIEXEC), "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "mpishard",
               *map(str, args)]
    child = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                 OPENBLAS_NUM_THREADS="1")
    child.update(env or {})
    for var in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        child.pop(var, None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child,
                          cwd=cwd or ROOT)


#: Open MPI's launcher adds this block to stderr when a rank exits with a non-zero status, and
#: its PMIx server may add a line of its own when a rank is gone before it reads its last message
_LAUNCHER_NOTE = re.compile(r"-{20,}\n[^\n]*(?:prterun|mpirun|mpiexec)[^\n]*non-zero status.*?-{20,}\n"
                            r"|^\[[^\]\n]*\] PMIX ERROR: [^\n]*\n", re.S | re.M)


def ranks_stderr(text: str) -> str:
    """What the ranks wrote on stderr: ``text`` without the launcher's own notes about a
    non-zero exit (Open MPI prints them, MPICH none)."""
    return _LAUNCHER_NOTE.sub("", text)


def mpiexec_command(script: str, *args, np_: int = 2) -> list:
    """``mpiexec -n N python -m mpi4py tests/ckpt_scripts/SCRIPT ARGS`` (Open MPI flags added)."""
    from mpi4py import MPI

    extra = ["--oversubscribe", "--allow-run-as-root"] if MPI.get_vendor()[0] == "Open MPI" \
        else []
    return [str(MPIEXEC), *extra, "-n", str(np_), sys.executable, "-m", "mpi4py",
            str(SCRIPTS / script), *[str(a) for a in args]]


def rank_pids(marker) -> list:
    """The process ids of the ranks (Python processes under a launcher, not the launcher
    nor a supervisor) whose command line holds ``marker`` (a path given to the run, say
    its --metrics file)."""
    marker, pids = str(marker).encode(), []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:          # the process ended, or is not ours to read
            continue
        if marker in argv and b"mpi4py" in argv and b"supervise" not in argv \
                and Path(os.fsdecode(argv[0])).name.startswith("python"):
            pids.append(int(entry.name))
    return sorted(pids)


#: put first on a job's PYTHONPATH to inject failures into its ranks (MPISHARD_TEST_FAIL_AT_START,
#: MPISHARD_TEST_KILL_IN_SAVE: see its sitecustomize.py)
INJECT = SCRIPTS / "inject"


def injected_env(**variables) -> dict:
    """:func:`clean_env` with ``variables`` (MPISHARD_TEST_...) and INJECT first on the path."""
    env = clean_env(**variables)
    env["PYTHONPATH"] = f"{INJECT}:{env['PYTHONPATH']}"
    return env


def kill_a_rank(pids: list, rng, sig=9) -> int | None:
    """Send ``sig`` (SIGKILL) to one of ``pids``, chosen by ``rng``; the pid, or None."""
    for pid in rng.sample(pids, len(pids)):
        try:
            os.kill(pid, sig)
            return pid
        except ProcessLookupError:
            continue
    return None


def _mapped_files() -> set:
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split(None, 5)[-1].strip() for line in maps.read_text().splitlines()
                          if "/dev/shm/" in line)
        except OSError:  # the process ended, or is not ours to read
            continue
    return mapped


@contextlib.contextmanager
def reap_shared_memory():
    """Remove the MPI shared-memory segments that jobs killed inside the block leave behind.

    MPICH keeps a file in /dev/shm per node for a job and removes it at exit, so
    a SIGKILLed job leaks it (~2 MiB). Only files that appeared during the block
    and that no running process has mapped are removed.
    """
    shm = Path("/dev/shm")
    before = set(shm.glob("mpich_shm_*")) if shm.is_dir() else set()
    try:
        yield
    finally:
        new = (set(shm.glob("mpich_shm_*")) - before) if shm.is_dir() else set()
        if new:
            in_use = _mapped_files()
            for path in new:
                if str(path) not in in_use:
                    path.unlink(missing_ok=True)


def run_mpi(script: str, *args, np_: int = 2, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run a script under ``mpiexec`` to completion (raises TimeoutExpired past ``timeout``)."""
    return subprocess.run(mpiexec_command(script, *args, np_=np_), cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=timeout)

"""The GPU check's parts: each runs in its own process, started by scripts/gpu_check.py.

    python scripts/gpu_parts.py --part single    # staging, DevicePath branches, size-1 collectives
    python scripts/gpu_parts.py --part nccl1     # an NCCL group of size 1
    mpiexec -n 2 python -m mpi4py scripts/gpu_parts.py --part mpi    # collectives on CuPy arrays
    mpiexec -n 2 python -m mpi4py scripts/gpu_parts.py --part nccl   # needs 2 GPUs

Each writes its findings to ``--result`` and raises AssertionError on a wrong
value (under ``python -m mpi4py`` that aborts the whole job with a non-zero
status). ``--part pytest`` runs pytest with one JUnit file per rank.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ONE_GPU_NCCL = ("one GPU is visible and NCCL refuses two ranks on one GPU ('Duplicate GPU "
                "detected'), so the NCCL path ran only as a group of size 1 (part nccl_1rank)")

def say(message, rank=0):
    print(f"[rank {rank}] ok {message}", flush=True)


def expected_sum(n, count, dtype):
    return (n * np.arange(count) + n * (n - 1) // 2).astype(dtype)


def check_collectives(comm, cp, label):
    """Every collective on CuPy arrays, blocking and not, three dtypes, two counts."""
    n, r = comm.size, comm.rank
    for dtype in ("float32", "float64", "float16"):
        for count in (7, 4096):
            for blocking in (True, False):
                def done(x):
                    return x if blocking else x.wait()
                buf = cp.asarray((np.arange(count) + r).astype(dtype))
                assert done((comm.all_reduce if blocking else comm.iall_reduce)(buf)) is buf
                np.testing.assert_array_equal(cp.asnumpy(buf), expected_sum(n, count, dtype))
                buf = cp.asarray((np.arange(count) + r).astype(dtype))
                done((comm.all_reduce if blocking else comm.iall_reduce)(buf, op="avg"))
                np.testing.assert_allclose(cp.asnumpy(buf),
                                           expected_sum(n, count, "float64") / n, rtol=1e-3)
                send = cp.asarray((np.arange(count * n) + r).astype(dtype))
                recv = done((comm.reduce_scatter if blocking else comm.ireduce_scatter)(send))
                full = expected_sum(n, count * n, dtype)
                np.testing.assert_array_equal(cp.asnumpy(recv), full[r * count:(r + 1) * count])
                mine = cp.full(count, r + 1, dtype=dtype)
                gathered = done((comm.all_gather if blocking else comm.iall_gather)(mine))
                want = np.repeat(np.arange(1, n + 1), count).astype(dtype)
                np.testing.assert_array_equal(cp.asnumpy(gathered), want)
                whole = cp.zeros(count * n, dtype=dtype)  # in place: send is this rank's block
                whole[r * count:(r + 1) * count] = r + 1
                done((comm.all_gather if blocking else comm.iall_gather)(
                    whole[r * count:(r + 1) * count], whole))
                np.testing.assert_array_equal(cp.asnumpy(whole), want)
                buf = cp.full(count, r, dtype=dtype)
                done((comm.broadcast if blocking else comm.ibroadcast)(buf, root=n - 1))
                np.testing.assert_array_equal(cp.asnumpy(buf), np.full(count, n - 1, dtype))
            say(f"{label}: collectives {dtype} x{count}", r)
    if n > 1:
        right, left = (r + 1) % n, (r - 1) % n
        got = cp.zeros(5, dtype=cp.float32)
        handles = [comm.irecv(got, left, tag=1),
                   comm.isend(cp.full(5, r, cp.float32), right, tag=1)]
        for h in handles:
            h.wait()
        np.testing.assert_array_equal(cp.asnumpy(got), np.full(5, left, np.float32))
        say(f"{label}: send/recv ring", r)


def part_env() -> dict:
    """What this machine has: Python, NumPy, MPI, CuPy, GPUs, NCCL, CUDA-awareness."""
    facts = {"python": sys.executable, "python_version": platform.python_version(),
             "numpy": np.__version__, "host": platform.node(),
             "CUPY_TF32": os.environ.get("CUPY_TF32"),
             "MPI4PY_LIBMPI": os.environ.get("MPI4PY_LIBMPI")}
    try:
        import ml_dtypes
        facts["ml_dtypes"] = ml_dtypes.__version__
    except ImportError:
        facts["ml_dtypes"] = None
    import mpi4py
    from mpi4py import MPI

    from mpishard.comm.gpu import detect_cuda_aware, loaded_libmpi, nccl_available

    vendor, version = MPI.get_vendor()
    facts.update(mpi4py=mpi4py.__version__, mpi_vendor=f"{vendor} {'.'.join(map(str, version))}",
                 mpi_library=loaded_libmpi(), cuda_aware=detect_cuda_aware(),
                 nccl=nccl_available(), cupy=None, gpus=0, devices=[])
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA library that does not load
        facts["cupy_error"] = f"{type(exc).__name__}: {exc}"
        return facts
    facts["cupy"] = cupy.__version__
    try:
        runtime = cupy.cuda.runtime
        facts.update(gpus=int(runtime.getDeviceCount()), cuda_runtime=runtime.runtimeGetVersion(),
                     cuda_driver=runtime.driverGetVersion())
        for i in range(facts["gpus"]):
            props = runtime.getDeviceProperties(i)
            name = props["name"]
            facts["devices"].append({
                "name": name.decode() if isinstance(name, bytes) else name,
                "memory_bytes": int(props["totalGlobalMem"]),
                "compute_capability": f"{props['major']}.{props['minor']}"})
    except Exception as exc:
        facts["gpu_error"] = f"{type(exc).__name__}: {exc}"
    return facts


def part_single() -> dict:
    """Pinned staging after the stream sync, the DevicePath branches, size-1 collectives."""
    import cupy as cp
    import cupyx
    from mpi4py import MPI

    from mpishard.comm import Communicator, detect_cuda_aware
    from mpishard.comm.gpu import DevicePath

    n = 1 << 16
    # Values reach the pinned buffer only after the producing kernel, queued on
    # a non-blocking stream, has finished (the one sync in DevicePath.for_mpi).
    path = DevicePath(False, "forced for the check")
    with cp.cuda.Stream(non_blocking=True):
        x = cp.arange(n, dtype=cp.float32) * 2
        host, copy_back = path.for_mpi(x, copy_in=True, copy_out=True)
        assert isinstance(host, np.ndarray)
        np.testing.assert_array_equal(host, np.arange(n, dtype=np.float32) * 2)
        host *= 3
        copy_back()
        np.testing.assert_array_equal(cp.asnumpy(x), np.arange(n, dtype=np.float32) * 6)
    out_only, back = path.for_mpi(x, copy_in=False, copy_out=True)
    assert isinstance(out_only, np.ndarray) and back is not None
    in_only, back = path.for_mpi(x, copy_in=True, copy_out=False)
    assert back is None and np.array_equal(in_only, cp.asnumpy(x))
    assert isinstance(cupyx.empty_pinned((4,), np.float32), np.ndarray)
    say("pinned staging: copy in after the stream sync, copy back")
    aware = DevicePath(True, "forced", stage_nonblocking_reductions=True)
    assert aware.for_mpi(x, copy_in=True, copy_out=True)[0] is x
    staged, back = aware.for_mpi(x, copy_in=True, copy_out=True, nonblocking_reduction=True)
    assert isinstance(staged, np.ndarray) and back is not None
    say("CUDA-aware path passes device arrays; Open MPI non-blocking reductions stage")
    check_collectives(Communicator(MPI.COMM_SELF, "self"), cp, "size 1 (early returns)")
    return {"cuda_aware": detect_cuda_aware()}


def part_nccl1() -> dict:
    """An NCCL communicator of one rank: every collective, float32 and float16."""
    import cupy as cp
    from mpi4py import MPI

    from mpishard.comm.nccl import NcclGroup

    group = NcclGroup(MPI.COMM_SELF)
    for dtype in (cp.float32, cp.float16):
        a = cp.arange(10, dtype=dtype)
        group.all_reduce(a, "avg").Wait()
        np.testing.assert_array_equal(cp.asnumpy(a), np.arange(10, dtype=dtype))
        event = group.all_reduce(a, "max", host_sync=True)
        event.Wait()
        assert event.Test()
        recv = cp.zeros(10, dtype=dtype)
        group.reduce_scatter(a, recv, "sum").Wait()
        group.all_gather(recv, a).Wait()
        group.broadcast(a, 0).Wait()
        np.testing.assert_array_equal(cp.asnumpy(a), np.arange(10, dtype=dtype))
        say(f"NCCL group of size 1: all_reduce, reduce_scatter, all_gather, broadcast "
            f"{dtype.__name__}")
    group.close()
    return {"group_size": 1, "why_not_more": ONE_GPU_NCCL}


def part_mpi(comm_backend: str) -> dict:
    """Every collective on CuPy arrays over the world (staged unless MPI is CUDA-aware)."""
    import cupy as cp
    from mpi4py import MPI

    from mpishard.comm import Communicator, node_local_rank
    from mpishard.comm import format_rank_reports, rank_report

    world = Communicator.from_env(MPI.COMM_WORLD.Dup(), comm_backend=comm_backend, timeout=120)
    cp.cuda.Device(node_local_rank(world) % cp.cuda.runtime.getDeviceCount()).use()
    reports = world.all_gather_obj(rank_report(world))
    if world.rank == 0:
        print(format_rank_reports(reports), flush=True)
    label = f"{comm_backend}, CUDA-aware={world.cuda_aware[0]} ({world.cuda_aware[1]})"
    check_collectives(world, cp, label)
    world.barrier()
    if world.rank == 0:
        print(world.stats.format(), flush=True)
    return {"ranks": reports}


def part_pytest(junit_prefix: str, pytest_args: list) -> int:
    """pytest with a JUnit file per rank (``PREFIX.rankN.xml``)."""
    import pytest
    from mpi4py import MPI

    junit = f"--junitxml={junit_prefix}.rank{MPI.COMM_WORLD.rank}.xml"
    return int(pytest.main([*pytest_args, junit]))


def run_check(args) -> int:
    if args.part == "pytest":
        return part_pytest(args.junit, args.pytest_args)
    checks = {"env": part_env, "single": part_single, "nccl1": part_nccl1,
              "mpi": lambda: part_mpi("mpi"), "nccl": lambda: part_mpi("nccl")}
    result = checks[args.part]()
    from mpi4py import MPI

    if args.result is not None and MPI.COMM_WORLD.rank == 0:
        args.result.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", required=True,
                        choices=("env", "single", "nccl1", "mpi", "nccl", "pytest"))
    parser.add_argument("--result", type=Path, help="write the check's findings here")
    parser.add_argument("--junit", help="(--part pytest) JUnit file prefix")
    parser.add_argument("pytest_args", nargs="*", help="(--part pytest) after --")
    return run_check(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())

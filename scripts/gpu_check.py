"""GPU checks of mpishard's communication layer (called by scripts/gpu_check.sh).

    python scripts/gpu_check.py --part single                         # 1 process
    mpiexec -n 2 python -m mpi4py scripts/gpu_check.py --part mpi     # MPI on CuPy arrays
    mpiexec -n 2 python -m mpi4py scripts/gpu_check.py --part nccl    # needs 2 GPUs

Every check compares against values computed independently on the host and
raises AssertionError on a mismatch (under ``python -m mpi4py`` that aborts
the job with a non-zero exit code). Each passing check prints ``ok ...``.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
from mpi4py import MPI

from mpishard.comm import Communicator, detect_cuda_aware, nccl_available, node_local_rank
from mpishard.comm.gpu import DevicePath, format_rank_reports, rank_report


def say(comm, message):
    print(f"[rank {comm.rank if comm else 0}] ok {message}", flush=True)


def expected_sum(n, count, dtype):
    return (n * np.arange(count) + n * (n - 1) // 2).astype(dtype)


def check_collectives(comm, cp, label):
    """Every collective on CuPy arrays, blocking and not, three dtypes, two counts."""
    n, r = comm.size, comm.rank
    for dtype in ("float32", "float64", "float16"):
        for count in (7, 4096):
            for blocking in (True, False):
                mode = "blocking" if blocking else "nonblocking"

                def done(x):
                    return x if blocking else x.wait()
                buf = cp.asarray((np.arange(count) + r).astype(dtype))
                out = done((comm.all_reduce if blocking else comm.iall_reduce)(buf))
                assert out is buf
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
                say(comm, f"{label}: collectives {dtype} x{count} {mode}")
    if n > 1:
        right, left = (r + 1) % n, (r - 1) % n
        got = cp.zeros(5, dtype=cp.float32)
        handles = [comm.irecv(got, left, tag=1),
                   comm.isend(cp.full(5, r, cp.float32), right, tag=1)]
        for h in handles:
            h.wait()
        np.testing.assert_array_equal(cp.asnumpy(got), np.full(5, left, np.float32))
        say(comm, f"{label}: send/recv ring")


def part_single(cp):
    import cupyx

    n = 1 << 16
    # Staging: values reach the pinned host buffer only after the producing
    # kernel, queued on a non-blocking stream, has finished (the one sync).
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
    pinned = cupyx.empty_pinned((4,), np.float32)
    assert isinstance(pinned, np.ndarray)
    say(None, "pinned staging: copy in after stream sync, copy back")
    aware = DevicePath(True, "forced", stage_nonblocking_reductions=True)
    assert aware.for_mpi(x, copy_in=True, copy_out=True)[0] is x
    staged, back = aware.for_mpi(x, copy_in=True, copy_out=True, nonblocking_reduction=True)
    assert isinstance(staged, np.ndarray) and back is not None
    say(None, "CUDA-aware path passes device arrays; Open MPI non-blocking reductions stage")
    print("detect_cuda_aware():", detect_cuda_aware(), flush=True)
    print("nccl_available():", nccl_available(), flush=True)
    solo = Communicator(MPI.COMM_SELF, "self")
    check_collectives(solo, cp, "size 1 (early returns on device arrays)")
    print(format_rank_reports([rank_report(solo)]), flush=True)
    ok, why = nccl_available()
    if not ok:
        print(f"SKIP NCCL group checks: {why}", flush=True)
        return
    from mpishard.comm.nccl import NcclGroup

    group = NcclGroup(MPI.COMM_SELF)
    a = cp.arange(10, dtype=cp.float32)
    group.all_reduce(a, "avg").Wait()
    np.testing.assert_array_equal(cp.asnumpy(a), np.arange(10, dtype=np.float32))
    event = group.all_reduce(a, "max", host_sync=True)
    event.Wait()
    assert event.Test()
    recv = cp.zeros(10, dtype=cp.float32)
    group.reduce_scatter(a, recv, "sum").Wait()
    group.all_gather(recv, a).Wait()
    group.broadcast(a, 0).Wait()
    np.testing.assert_array_equal(cp.asnumpy(a), np.arange(10, dtype=np.float32))
    group.close()
    say(None, "NCCL group of size 1: all_reduce/reduce_scatter/all_gather/broadcast")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=("single", "mpi", "nccl"), required=True)
    args = parser.parse_args()
    import cupy as cp

    if args.part == "single":
        part_single(cp)
        return 0
    backend = "nccl" if args.part == "nccl" else "mpi"
    world = Communicator.from_env(MPI.COMM_WORLD.Dup(), comm_backend=backend,
                                  timeout=120)
    gpus = cp.cuda.runtime.getDeviceCount()
    cp.cuda.Device(node_local_rank(world) % gpus).use()
    print(format_rank_reports([rank_report(world)]), flush=True)
    label = f"{backend}, CUDA-aware={world.cuda_aware[0]} ({world.cuda_aware[1]})"
    check_collectives(world, cp, label)
    world.barrier()
    if world.rank == 0:
        print(world.stats.format(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Collective bandwidth: mpishard against raw mpi4py, interleaved in one run.

    mpiexec -n 4 python benchmarks/comm.py
    mpiexec -n 4 python -m mpi4py -m mpishard.bench.comm --sizes-mib 1 16 64 --iters 20
    mpishard bench comm            # the same, through the CLI

For each collective (all-reduce, reduce-scatter, all-gather, broadcast) and
each message size ``S`` (1, 16 and 64 MiB of float32 by default), the two
implementations run on the same buffers, alternating which goes first, with a
barrier before each timed call. A sample is the slowest rank's time for one
call; the table shows the median over samples as bus bandwidth (nccl-tests
definitions, see [Note: bus bytes] in mpishard/comm/stats.py) and the ratio
mpishard / raw of those medians (1.00: no overhead). ``paired`` is the median of
the per-iteration ratios of back-to-back calls, which cancels slow periods of a
shared or oversubscribed machine that hit both. Buffers hold zeros, so repeated
sums stay finite and timing does not depend on values.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
from mpi4py import MPI

from mpishard.bench.flags import BenchParser, check_count, check_output, check_sizes, write_json
from mpishard.comm import Communicator, check_launcher, install_abort_hook
from mpishard.comm.stats import bus_bytes

__all__ = ["main", "run", "COLLECTIVES"]

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


def _buffers(kind: str, nbytes: int, size: int, xp):
    """Buffers for a message of ``nbytes`` (the full buffer, as nccl-tests counts)."""
    count = max(size, (nbytes // 4) // size * size)  # float32, divisible by size
    full = xp.zeros(count, dtype=np.float32)
    part = xp.zeros(count // size, dtype=np.float32)
    return {"all_reduce": (full,), "broadcast": (full,),
            "reduce_scatter": (full, part), "all_gather": (part, full)}[kind]


def _calls(kind: str, comm: Communicator, bufs):
    """Zero-argument callables: ``(raw mpi4py, mpishard)``."""
    mpi = comm.mpi
    if kind == "all_reduce":
        (buf,) = bufs
        return (lambda: mpi.Allreduce(MPI.IN_PLACE, buf, MPI.SUM),
                lambda: comm.all_reduce(buf))
    if kind == "broadcast":
        (buf,) = bufs
        return lambda: mpi.Bcast(buf, 0), lambda: comm.broadcast(buf, 0)
    send, recv = bufs
    if kind == "reduce_scatter":
        return (lambda: mpi.Reduce_scatter_block(send, recv, MPI.SUM),
                lambda: comm.reduce_scatter(send, recv))
    return lambda: mpi.Allgather(send, recv), lambda: comm.all_gather(send, recv)


def _sync(xp):
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def measure(comm: Communicator, kind: str, nbytes: int, iters: int, warmup: int,
            xp=np) -> dict:
    """Median seconds (slowest rank) and bus bandwidth of raw and mpishard calls."""
    bufs = _buffers(kind, nbytes, comm.size, xp)
    message = bufs[0].nbytes if kind != "all_gather" else bufs[1].nbytes
    raw, ours = _calls(kind, comm, bufs)
    samples = np.zeros((2, iters))
    for i in range(warmup + iters):
        order = ((0, raw), (1, ours)) if i % 2 == 0 else ((1, ours), (0, raw))
        for which, call in order:
            comm.mpi.Barrier()
            start = time.perf_counter()
            call()
            _sync(xp)
            if i >= warmup:
                samples[which, i - warmup] = time.perf_counter() - start
    comm.mpi.Allreduce(MPI.IN_PLACE, samples, MPI.MAX)  # one sample = slowest rank
    raw_s, ours_s = (statistics.median(row) for row in samples)
    bus = bus_bytes(kind, message, comm.size)
    return {"collective": kind, "bytes": message, "raw_seconds": raw_s,
            "mpishard_seconds": ours_s, "raw_busbw": bus / raw_s,
            "mpishard_busbw": bus / ours_s, "ratio": raw_s / ours_s,
            "paired_ratio": statistics.median(samples[0] / samples[1])}


def run(comm: Communicator, sizes_mib=(1, 16, 64), collectives=COLLECTIVES,
        iters: int = 40, warmup: int = 3, xp=np) -> list[dict]:
    """Measure every collective at every size; the same list on every rank."""
    return [measure(comm, kind, int(mib * 2**20), iters, warmup, xp)
            for mib in sizes_mib for kind in collectives]


def format_results(results: list[dict], comm: Communicator, iters: int, xp) -> str:
    vendor, version = MPI.get_vendor()
    lines = [f"mpishard comm benchmark: {comm.size} ranks, {vendor} "
             f"{'.'.join(map(str, version))}, {xp.__name__} float32, median of {iters} "
             f"interleaved samples (slowest rank each)",
             f"{'collective':<16}{'size':>8}{'raw GB/s':>12}{'mpishard GB/s':>15}"
             f"{'ratio':>8}{'paired':>8}   (bus bandwidth)"]
    for r in results:
        mib = r["bytes"] / 2**20
        size = f"{mib:>6.0f}" if mib == round(mib) else f"{mib:>6.3g}"   # 0.25, not 0
        lines.append(f"{r['collective']:<16}{size}MiB"
                     f"{r['raw_busbw'] / 1e9:>12.3f}{r['mpishard_busbw'] / 1e9:>15.3f}"
                     f"{r['ratio']:>8.3f}{r['paired_ratio']:>8.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Command line: ``[--sizes-mib ...] [--collectives ...] [--iters N] [--json PATH]``.
    Every flag and the ``--json`` path are checked before anything is measured."""
    parser = BenchParser(prog="mpishard bench comm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 64],
                        help="message sizes in MiB (default 1 16 64)")
    parser.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=list(COLLECTIVES))
    parser.add_argument("--iters", type=int, default=40, help="timed samples per cell "
                        "(at least 1, default 40)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before them "
                        "(0 or more, default 3)")
    parser.add_argument("--backend", choices=("numpy", "cupy"), default="numpy",
                        help="where the buffers live (cupy: needs CUDA-aware MPI, "
                             "for the raw column)")
    parser.add_argument("--json", help="also write the results to this file (rank 0; "
                        "missing folders are made)")
    args = parser.parse_args(argv)
    check_sizes(parser, "--sizes-mib", args.sizes_mib, "MiB in a message", "0.25 1 16")
    check_count(parser, "--iters", args.iters, 1, "the timed samples per cell", 40)
    check_count(parser, "--warmup", args.warmup, 0, "the untimed calls before them", 3)
    if args.json:
        check_output(parser, "--json", args.json, "comm.json")

    world = Communicator.from_env(MPI.COMM_WORLD.Dup(), "bench")
    install_abort_hook(world)
    check_launcher(world)
    xp = np
    if args.backend == "cupy":
        from mpishard.core.backend import Backend  # noqa: PLC0415
        from mpishard.comm import node_local_rank  # noqa: PLC0415

        xp = Backend.resolve("cupy", local_rank=node_local_rank(world)).xp
        if not world.cuda_aware[0]:     # the same answer on every rank: one line, status 2
            parser.error(f"--backend cupy compares against raw mpi4py on device buffers, "
                         f"which needs CUDA-aware MPI ({world.cuda_aware[1]})")
    results = run(world, args.sizes_mib, args.collectives, args.iters, args.warmup, xp)
    if world.rank == 0:
        print(format_results(results, world, args.iters, xp), flush=True)
        if args.json:
            write_json(args.json, {"size": world.size, "results": results})
    world.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

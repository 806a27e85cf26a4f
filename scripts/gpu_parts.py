"""The GPU check's parts: each runs in its own process, started by scripts/gpu_check.py.

    python scripts/gpu_parts.py --part env           # versions, MPI float16, CUDA-awareness
    python scripts/gpu_parts.py --part collectives   # one rank, every path, stream races
    python scripts/gpu_parts.py --part gpt           # a GPT step on CuPy against NumPy
    python scripts/gpu_parts.py --part float16       # float16 against float32 (cosines)
    python scripts/gpu_parts.py --part warm --ops cross_entropy,softmax   # compile, in parallel
    mpiexec -n 2 python -m mpi4py scripts/gpu_parts.py --part mpi    # collectives over ranks
    (--backend numpy --tiny: the same code on the CPU, to rehearse the check)

Each writes its findings to ``--result`` and raises AssertionError on a wrong
value (under ``python -m mpi4py`` that aborts the whole job with a non-zero
status). ``--part pytest`` runs pytest with one JUnit file per rank.

``--part warm`` compiles the kernels of the check's later parts before they run:
it starts the processes of :func:`warm_jobs` side by side (the later parts' own
code on tiny models, which meet the same kernels: CuPy compiles one per dtype and
dimension count, whatever the sizes) and CuPy keeps what they compile in
``CUPY_CACHE_DIR``, where the later parts load it. Killed at its limit, it
leaves what it compiled so far.

Collectives compare with :func:`assert_reduced`: each rank's input is small
integers (:func:`rank_values`), exact in float16 and so are their sums, and a
float16 result may be off by one unit in the last place (a sum rounded in
another order); float32 and float64 results are exact.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ONE_GPU = ("one GPU: NCCL refuses two ranks on one GPU and the MPI wheel is not CUDA-aware, "
           "so NCCL and CUDA-aware MPI ran as groups of one rank only; beyond one rank they "
           "need two GPUs or a site MPI built with CUDA")
DTYPES = ("float32", "float64", "float16")
SPIN_CYCLES = 100_000_000      # about 50 ms of a GPU clock: long enough to lose a race


def say(message, rank=0):
    print(f"[rank {rank}] ok {message}", flush=True)


# == comparisons (NumPy only: the unit tests call these) ========================

def rank_values(rank: int, count: int, dtype) -> np.ndarray:
    """Rank ``rank``'s input: ``k % 61 + rank``, exact in float16, as are sums of a few ranks."""
    return (np.arange(count) % 61 + rank).astype(dtype)


def assert_reduced(got, inputs: list, op: str, what: str = "") -> None:
    """``got`` is ``op`` over the ranks' ``inputs`` (each already in its dtype).

    The reference is the reduction in float64, rounded once to the dtype.
    float16 may differ by one unit in the last place (NCCL and MPI add in their
    own order); float32 and float64 must match exactly.
    """
    dtype = np.asarray(inputs[0]).dtype
    stacked = np.stack([np.asarray(a, np.float64) for a in inputs])
    exact = {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.max(0)}[op]
    want = exact.astype(dtype)
    got = np.asarray(got)
    assert got.dtype == dtype and got.shape == want.shape, (what, got.dtype, got.shape)
    if dtype == np.float16:
        ulp = np.spacing(np.abs(want)).astype(np.float64)
        err = np.abs(got.astype(np.float64) - want.astype(np.float64))
        bad = np.flatnonzero(err > ulp)
    else:
        bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{what}: {op} wrong at {bad.size} of {want.size} elements, first "
                           f"{bad[0]}: got {got.flat[bad[0]]}, want {want.flat[bad[0]]}")


# == collectives =================================================================

def check_collectives(comm, xp, label, counts=(7, 4096)) -> list:
    """Every collective, blocking and not, on ``xp`` arrays; the checks that ran."""
    n, r = comm.size, comm.rank
    ran = []
    for dtype in DTYPES:
        for count in counts:
            for blocking in (True, False):
                def done(x):
                    return x if blocking else x.wait()
                mine = rank_values(r, count, dtype)
                everyone = [rank_values(q, count, dtype) for q in range(n)]
                for op in ("sum", "avg", "max"):
                    buf = xp.asarray(mine)
                    assert done((comm.all_reduce if blocking else comm.iall_reduce)(
                        buf, op=op)) is buf
                    assert_reduced(_host(buf), everyone, op, f"{label} all_reduce {dtype}")
                send = xp.asarray(np.concatenate([rank_values(r + j, count, dtype)
                                                  for j in range(n)]))
                recv = done((comm.reduce_scatter if blocking else comm.ireduce_scatter)(send))
                assert_reduced(_host(recv), [rank_values(q + r, count, dtype) for q in range(n)],
                               "sum", f"{label} reduce_scatter {dtype}")
                gathered = done((comm.all_gather if blocking else comm.iall_gather)(
                    xp.asarray(mine)))
                np.testing.assert_array_equal(_host(gathered), np.concatenate(everyone))
                whole = xp.zeros(count * n, dtype=dtype)  # in place: send is this rank's block
                whole[r * count:(r + 1) * count] = xp.asarray(mine)
                done((comm.all_gather if blocking else comm.iall_gather)(
                    whole[r * count:(r + 1) * count], whole))
                np.testing.assert_array_equal(_host(whole), np.concatenate(everyone))
                buf = xp.asarray(mine)
                done((comm.broadcast if blocking else comm.ibroadcast)(buf, root=n - 1))
                np.testing.assert_array_equal(_host(buf), everyone[-1])
                send = xp.asarray(np.concatenate([rank_values(10 * r + j, count, dtype)
                                                  for j in range(n)]))
                got = done((comm.all_to_all if blocking else comm.iall_to_all)(send))
                np.testing.assert_array_equal(_host(got), np.concatenate(
                    [rank_values(10 * q + r, count, dtype) for q in range(n)]))
            ran.append(f"{dtype} x{count}")
            say(f"{label}: every collective, {dtype} x{count}", r)
    if n > 1:
        right, left = (r + 1) % n, (r - 1) % n
        got = xp.zeros(5, dtype=np.float16)
        handles = [comm.irecv(got, left, tag=1),
                   comm.isend(xp.asarray(rank_values(r, 5, np.float16)), right, tag=1)]
        for h in handles:
            h.wait()
        np.testing.assert_array_equal(_host(got), rank_values(left, 5, np.float16))
        ran.append("send/recv ring float16")
    return ran


def _host(a):
    return a if isinstance(a, np.ndarray) else a.get()


def _slow_fill(cp):
    """A kernel that spins ``cycles`` GPU clocks, then fills ``out`` with ``value``."""
    kernel = cp.RawKernel(r'''
    extern "C" __global__ void slow_fill(float* out, float value, long long n,
                                         long long cycles) {
        long long start = clock64();
        while (clock64() - start < cycles) { }
        long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) out[i] = value;
    }''', "slow_fill")

    def fill(out, value, cycles=SPIN_CYCLES):
        threads = 256
        kernel(((out.size + threads - 1) // threads,), (threads,),
               (out, np.float32(value), np.int64(out.size), np.int64(cycles)))
    return fill


def race_checks(comm, cp, label: str) -> dict:
    """A slow kernel produces the input on a non-blocking stream, then the collective
    runs at once: a missing synchronisation shows as stale values. A control does
    the same without the synchronisation and must see them, or the check proves nothing."""
    fill, n, found = _slow_fill(cp), 1 << 12, {}
    started = time.perf_counter()
    fill(cp.zeros(1, cp.float32), 0.0, cycles=0)  # compiles the kernel (NVRTC)
    cp.cuda.Device().synchronize()
    found["kernel_compile_s"] = round(time.perf_counter() - started, 2)
    with cp.cuda.Stream(non_blocking=True) as stream:
        x = cp.zeros(n, cp.float32)
        stream.synchronize()
        fill(x, 7.0)
        host = cp.asnumpy(x, stream=cp.cuda.Stream.null)  # control: ignores the producer
        stream.synchronize()
        found["control_stale_copy"] = bool((host != 7.0).any())
        for blocking in (True, False):
            x = cp.zeros(n, cp.float32)
            stream.synchronize()
            fill(x, 7.0 + comm.rank)
            call = comm.all_gather(x) if blocking else comm.iall_gather(x).wait()
            want = np.repeat(7.0 + np.arange(comm.size), n).astype(np.float32)
            np.testing.assert_array_equal(cp.asnumpy(call), want, f"{label}: producer race")
    group = getattr(getattr(comm, "backend", None), "group", None)  # BackendAtSizeOne's
    if group is not None:
        found.update(_nccl_consumer_race(comm, group, cp, fill, n))
    assert found["control_stale_copy"], (
        f"{label}: the control copy saw the slow kernel's values, so this check could not "
        f"have caught a missing synchronisation (raise SPIN_CYCLES)")
    say(f"{label}: producer race (slow kernel, then the collective at once); "
        f"control saw stale data: {found['control_stale_copy']}", comm.rank)
    return found


def _nccl_consumer_race(comm, group, cp, fill, n) -> dict:
    """NCCL is delayed on its own stream; the caller's next kernel must still see its result."""
    from mpishard.comm.backends.nccl import nccl_dtype

    found = {}
    with cp.cuda.Stream(non_blocking=True) as stream:
        # the consumer kernel loaded first: CUDA loads a kernel at its first launch
        # (CUDA_MODULE_LOADING=LAZY, the default), which waits for the work in flight
        # on the device, the held-up NCCL stream included, and so hid the race
        cp.asnumpy(cp.full(n * comm.size, -1.0, cp.float32) + 0)
        stream.synchronize()
        for mode in ("control", "blocking", "handle"):
            x = cp.full(n, 3.0 + comm.rank, cp.float32)
            recv = cp.full(n * comm.size, -1.0, cp.float32)
            stream.synchronize()
            with group.stream:
                fill(cp.zeros(1, cp.float32), 0.0)  # holds the NCCL stream up
            if mode == "control":  # NCCL without the caller's stream waiting for it
                group.comm.allGather(x.data.ptr, recv.data.ptr, n, nccl_dtype(x.dtype),
                                     group.stream.ptr)
            elif mode == "blocking":
                comm.all_gather(x, recv)
            else:
                comm.iall_gather(x, recv).wait()
            seen = cp.asnumpy(recv + 0)  # a consumer kernel on the caller's stream
            group.stream.synchronize()
            ok = bool((seen == np.repeat(3.0 + np.arange(comm.size), n)).all())
            if mode == "control":
                found["nccl_control_stale"] = not ok
            else:
                assert ok, f"NCCL consumer race ({mode}): the caller read before NCCL wrote"
    assert found["nccl_control_stale"], "NCCL control did not race: the check proves nothing"
    say("NCCL consumer race: the caller's stream waits for NCCL's event", comm.rank)
    return found


def part_collectives(backend: str) -> dict:
    """One rank, every path: the size-1 shortcut, MPI staged, MPI CUDA-aware, NCCL, auto."""
    from mpi4py import MPI

    from mpishard.comm import Communicator, detect_cuda_aware, nccl_available
    from mpishard.testing.fake_cupy import BackendAtSizeOne

    xp = np if backend == "numpy" else __import__("cupy")
    aware, aware_how = detect_cuda_aware()
    nccl_ok, nccl_why = nccl_available()
    paths = {"shortcut": dict(cuda_aware=False), "mpi_staged": dict(cuda_aware=False)}
    skipped = {}
    if backend == "cupy":
        if aware:
            paths["mpi_cuda_aware"] = dict(cuda_aware=True)
        else:
            skipped["mpi_cuda_aware"] = f"MPI is not CUDA-aware ({aware_how})"
        if nccl_ok:
            paths["nccl"] = dict(comm_backend="nccl")
            paths["auto"] = dict(comm_backend="auto")
        else:
            skipped["nccl"] = skipped["auto"] = f"NCCL unavailable: {nccl_why}"
    result = {"paths": {}, "skipped": skipped}
    for label, settings in paths.items():
        started = time.perf_counter()
        make = Communicator if label == "shortcut" else BackendAtSizeOne  # MPI or NCCL at 1
        comm = make(MPI.COMM_SELF.Dup(), label, _owned=True, **settings)
        found = {"ran": check_collectives(comm, xp, f"1 rank, {label}")}
        if backend == "cupy" and label != "shortcut":
            found["races"] = race_checks(comm, xp, f"1 rank, {label}")
        if label == "nccl":
            comm.stats.reset()
            comm.all_reduce(xp.ones(1 << 24, xp.float32))
            found["nccl_all_reduce_64MiB_device_s"] = comm.stats["all_reduce"].seconds
            assert found["nccl_all_reduce_64MiB_device_s"] > 0, "NCCL stats read 0 s"
        found.update(comm_backend=comm.comm_backend, how=comm.comm_backend_how,
                     seconds=round(time.perf_counter() - started, 2))
        result["paths"][label] = found
        comm.free()
    return result


def part_mpi() -> dict:
    """Every collective on device arrays over the world (staged unless MPI is CUDA-aware),
    a producer race, and what comm_backend="auto" decides for ranks sharing the GPUs."""
    import cupy as cp
    from mpi4py import MPI

    from mpishard.comm import Communicator, format_rank_reports, node_local_rank, rank_report

    world = Communicator.from_env(MPI.COMM_WORLD.Dup(), timeout=120)
    cp.cuda.Device(node_local_rank(world) % cp.cuda.runtime.getDeviceCount()).use()
    reports = world.all_gather_obj(rank_report(world))
    if world.rank == 0:
        print(format_rank_reports(reports), flush=True)
    label = f"{world.size} ranks, CUDA-aware={world.cuda_aware[0]}"
    ran = check_collectives(world, cp, label)
    races = race_checks(world, cp, label)
    auto = Communicator(MPI.COMM_WORLD.Dup(), "auto", comm_backend="auto", _owned=True)
    buf = cp.full(4, 1.0 + world.rank, cp.float32)
    auto.all_reduce(buf)
    np.testing.assert_array_equal(cp.asnumpy(buf), np.full(4, world.size * (world.size + 1) / 2))
    decided = {"comm_backend": auto.comm_backend, "how": auto.comm_backend_how}
    auto.free()
    if world.rank == 0:
        print(world.stats.format(), f"\nauto: {decided}", flush=True)
    return {"ranks": reports, "ran": ran, "races": races, "auto": decided}


# == the model on the device =====================================================

def _gpt_config(tiny: bool):
    from mpishard.models import GPTConfig

    if tiny:
        return GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
    return GPTConfig(vocab_size=50304, block_size=1024, n_layer=2, n_head=12, n_embd=768)


def _rel2(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _cosine(a, b) -> float:
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


def part_gpt(backend: str, tiny: bool) -> dict:
    """A GPT step (forward, backward, AdamW, forward) on ``backend`` against NumPy, float32."""
    from mpishard.core.backend import Backend, to_numpy
    from mpishard.models import GPT
    from mpishard.optim import AdamW

    cfg = _gpt_config(tiny)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, cfg.block_size + 1))
    tol = 1e-3 if os.environ.get("CUPY_TF32") == "1" else 1e-4
    runs = []
    for name in ("numpy", backend):
        be = Backend.resolve(name)
        model = GPT(cfg, seed=0, backend=be)
        opt = AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        x, y = be.asarray(tokens[:, :-1]), be.asarray(tokens[:, 1:])
        run = {"step_s": []}
        for step in range(2):   # the first pays for kernel compilation; AdamW in between
            started = time.perf_counter()
            logits, loss = model(x, y)
            loss.backward()
            value = loss.item()   # waits for the device
            run["step_s"].append(round(time.perf_counter() - started, 3))
            if step == 0:
                run.update(loss=value, logits=to_numpy(logits.data),
                           grads={n: to_numpy(p.grad) for n, p in model.named_parameters()})
                opt.step()
            else:
                run["loss_after_step"] = value
            model.zero_grad()
        runs.append(run)
        print(f"gpt {name}: loss {run['loss']:.5f} -> {run['loss_after_step']:.5f} after one "
              f"AdamW step; forward+backward {run['step_s'][0]} s (first, with kernel "
              f"compilation), {run['step_s'][1]} s (warm)", flush=True)
    ref, dev = runs
    found = {"config": vars(cfg), "tolerance": tol, "numpy_step_s": ref["step_s"],
             "device_step_s": dev["step_s"], "warmup_s": dev["step_s"][0] - dev["step_s"][1],
             "loss_rel": abs(dev["loss"] - ref["loss"]) / abs(ref["loss"]),
             "logits_rel": _rel2(dev["logits"], ref["logits"]),
             "grads_rel_max": max(_rel2(dev["grads"][n], g) for n, g in ref["grads"].items()),
             "loss_after_step_rel": abs(dev["loss_after_step"] - ref["loss_after_step"])
             / abs(ref["loss_after_step"])}
    print(json.dumps({k: v for k, v in found.items() if k != "config"}), flush=True)
    assert found["loss_rel"] <= tol and found["logits_rel"] <= tol, found
    assert found["grads_rel_max"] <= 10 * tol, found
    assert found["loss_after_step_rel"] <= 10 * tol, found
    assert ref["loss_after_step"] < ref["loss"], "one AdamW step did not lower the loss"
    return found


def part_float16(backend: str, tiny: bool) -> dict:
    """float16 and bfloat16 mixed precision against float32 on ``backend``: logits and
    gradients (bfloat16 where the array module has it: CuPy 14 or later)."""
    from mpi4py import MPI

    from mpishard.core.backend import Backend, to_numpy
    from mpishard.core.dtypes import resolve_dtype
    from mpishard.comm import Communicator, Mesh
    from mpishard.models import GPT
    from mpishard.parallel import DataParallel

    cfg = _gpt_config(tiny)
    be = Backend.resolve(backend)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, cfg.block_size + 1))
    x, y = be.asarray(tokens[:, :-1]), be.asarray(tokens[:, 1:])
    comm = Communicator(MPI.COMM_SELF.Dup(), "self", _owned=True)
    got, precisions = {}, ["float32", "float16", "bfloat16"]
    try:
        resolve_dtype("bfloat16", be.xp)
    except ValueError as refused:           # an array module without bfloat16 arrays
        precisions.remove("bfloat16")
        got["bfloat16_refused"] = str(refused)
    for precision in precisions:
        strategy = DataParallel(GPT(cfg, seed=0, backend=be), Mesh(comm, dp=1),
                                precision=precision)
        # a loss scale as training would find it: halved while the gradients overflow
        for scale in ((2.0 ** 16, 2.0 ** 12, 2.0 ** 8) if precision == "float16" else (1.0,)):
            logits, loss = strategy(x, y)
            (loss * scale).backward()
            strategy.reduce_grads()
            grads = np.concatenate([to_numpy(p.grad).astype(np.float64).ravel() / scale
                                    for p in strategy.module.parameters()])
            strategy.zero_grad()
            if np.isfinite(grads).all():
                break
        got[precision] = {"loss": loss.item(), "scale": scale, "grads": grads,
                          "logits": to_numpy(logits.data).astype(np.float64).ravel()}
        strategy = None
    comm.free()
    f32, f16 = got["float32"], got["float16"]
    found = {"loss_float32": f32["loss"], "loss_float16": f16["loss"],
             "float16_loss_scale": f16["scale"],
             "logits_cosine": _cosine(f16["logits"], f32["logits"]),
             "grads_cosine": _cosine(f16["grads"], f32["grads"]),
             "grads_finite": bool(np.isfinite(f16["grads"]).all())}
    if "bfloat16" in got:       # 8 bits of mantissa: the gradients agree less closely
        bf = got["bfloat16"]
        found.update(loss_bfloat16=bf["loss"],
                     bfloat16_logits_cosine=_cosine(bf["logits"], f32["logits"]),
                     bfloat16_grads_cosine=_cosine(bf["grads"], f32["grads"]))
    else:
        found["bfloat16_refused"] = got["bfloat16_refused"]
    print(json.dumps(found), flush=True)
    assert found["grads_finite"], "float16 gradients are not finite"
    assert found["logits_cosine"] > 0.999 and found["grads_cosine"] > 0.999, found
    assert "bfloat16_refused" in found or (found["bfloat16_logits_cosine"] > 0.999
                                           and found["bfloat16_grads_cosine"] > 0.99), found
    return found


# == environment =================================================================

def part_env() -> dict:
    """Versions, the MPI library and its float16 datatype, CuPy, CUDA, GPUs, NCCL."""
    facts = {"python": sys.executable, "python_version": platform.python_version(),
             "numpy": np.__version__, "host": platform.node(),
             "CUPY_TF32": os.environ.get("CUPY_TF32"),
             "CUPY_CACHE_DIR": os.environ.get("CUPY_CACHE_DIR"),
             "MPI4PY_LIBMPI": os.environ.get("MPI4PY_LIBMPI")}
    try:
        import ml_dtypes
        facts["ml_dtypes"] = ml_dtypes.__version__
    except ImportError:
        facts["ml_dtypes"] = None
    import mpi4py
    from mpi4py import MPI

    from mpishard.comm.gpu import detect_cuda_aware, loaded_libmpi, nccl_available

    try:
        facts["mpi_float16_datatype"] = MPI.Datatype.fromcode("e").Get_name()
    except Exception as exc:  # noqa: BLE001 (many builds: KeyError)
        facts["mpi_float16_datatype"] = f"none ({type(exc).__name__}: {exc})"
    vendor, version = MPI.get_vendor()
    cache = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))
    facts.update(mpi4py=mpi4py.__version__, mpi_vendor=f"{vendor} {'.'.join(map(str, version))}",
                 mpi_library=loaded_libmpi(), cuda_aware=detect_cuda_aware(),
                 mpi_library_version=MPI.Get_library_version().strip().splitlines()[0],
                 nccl=nccl_available(), cupy=None, gpus=0, devices=[],
                 cupy_kernel_cache_files=len(list(cache.glob("*"))) if cache.is_dir() else 0)
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
    from mpishard.kernels.cuda import headers
    facts["tensor_core_attention"] = headers.describe(cupy)   # compiles <mma.h> once
    facts["crt_directory"] = headers.crt_directory()
    return facts


# == compiling the later parts' kernels ahead =====================================

def warm_jobs(backend: str, ops: list) -> dict:
    """name -> the argv (after the interpreter) of each process :func:`part_warm` runs."""
    me, bench = str(Path(__file__).resolve()), str(ROOT / "benchmarks" / "gpu.py")
    return {"gpt": [me, "--part", "gpt", "--backend", backend, "--tiny"],
            "float16": [me, "--part", "float16", "--backend", backend, "--tiny"],
            "train": [str(ROOT / "scripts" / "gpu_train_check.py"), "--backend", backend,
                      "--warm"],
            "bench_single": [bench, "--backend", backend, "--tiny"],
            "test_ops": [me, "--part", "warm-ops", "--backend", backend, "--ops",
                         ",".join(ops)],
            "attention": [me, "--part", "warm-attention", "--backend", backend]}


def _cache_files(folder: Path) -> int:
    return sum(1 for _ in folder.iterdir()) if folder.is_dir() else 0


def part_warm(backend: str, ops: list) -> dict:
    """:func:`warm_jobs`, as many at once as there are CPU cores (NVRTC compiles on
    them); each job's seconds and the kernels the cache gained."""
    import subprocess

    cache = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))
    before, started = _cache_files(cache), time.perf_counter()
    waiting, running, jobs = list(warm_jobs(backend, ops).items()), {}, {}
    parallel = max(1, min(len(waiting), os.cpu_count() or 1))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    while waiting or running:
        while waiting and len(running) < parallel:
            name, argv = waiting.pop(0)
            running[name] = (subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env,
                                              stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True),
                             time.perf_counter())
        for name, (proc, t0) in list(running.items()):
            if proc.poll() is None:
                continue
            out = proc.stdout.read()
            jobs[name] = {"returncode": proc.returncode,
                          "seconds": round(time.perf_counter() - t0, 1),
                          "log_tail": out.splitlines()[-8:] if proc.returncode else []}
            del running[name]
            say(f"warm {name}: exit {proc.returncode} in {jobs[name]['seconds']} s")
        time.sleep(0.05)
    after = _cache_files(cache)
    found = {"kernel_cache": str(cache), "files_before": before, "files_after": after,
             "kernels_compiled": after - before, "parallel": parallel, "jobs": jobs,
             "seconds": round(time.perf_counter() - started, 1)}
    print(json.dumps(found, indent=1), flush=True)
    failed = {name: job["log_tail"] for name, job in jobs.items() if job["returncode"]}
    assert not failed, f"warm jobs failed (their kernels compile in their own parts): {failed}"
    return found


def _tests_on_path() -> None:
    for folder in (ROOT / "tests", *sorted((ROOT / "tests").iterdir())):
        if folder.is_dir() and str(folder) not in sys.path:
            sys.path.append(str(folder))


def part_warm_ops(backend: str, ops: list) -> dict:
    """The gradcheck cases of ``ops`` forward and backward once on ``backend`` in float64
    (the test suite's own cases), a float64 GPT step, and DDP and ZeRO-3 at size 1 in
    float64 and float32: what tests_1rank meets."""
    from mpishard.core.backend import Backend

    _tests_on_path()
    from test_array_modules import OP_CASES, _case, _run_op

    be = Backend.resolve(backend)
    ran = [f"{name}-{index}" for name, index in OP_CASES
           if any(op in name for op in ops) and "expert" not in name]
    for label in ran:
        name, index = label.rsplit("-", 1)
        fn, inputs = _case(name, int(index), be.xp)
        _run_op(fn, inputs, be.xp)
    for dtype in ("float64", "float32"):
        for strategy in ("ddp", "zero3"):
            _tiny_steps(be, dtype, "float32", strategy)
    say(f"warm: {len(ran)} op cases, GPT steps in float64 and float32, DDP and ZeRO-3")
    return {"op_cases": ran}


def _tiny_steps(be, dtype: str, precision: str, strategy: str, head_size: int = 16,
                steps: int = 2) -> None:
    """A few AdamW steps (clipped) of a tiny GPT on ``be`` under ``strategy`` at size 1."""
    from mpi4py import MPI

    from mpishard.comm import Communicator, Mesh
    from mpishard.models import GPT, GPTConfig
    from mpishard.optim import AdamW
    from mpishard.parallel import wrap_model

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=2 * head_size)
    comm = Communicator(MPI.COMM_SELF.Dup(), "self", _owned=True)
    model = GPT(cfg, seed=0, backend=be, dtype=dtype, materialize_now=strategy != "zero3")
    wrapped = wrap_model(model, Mesh(comm, dp=1), strategy, precision=precision)
    opt = AdamW(wrapped.parameters(), lr=1e-3, ledger=wrapped.ledger)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, cfg.block_size + 1))
    x, y = be.asarray(tokens[:, :-1]), be.asarray(tokens[:, 1:])
    for _ in range(steps):
        _, loss = wrapped(x, y)
        wrapped.scale_loss(loss).backward()
        wrapped.step(opt, max_norm=1.0)
    loss.item()
    comm.free()


def part_warm_attention(backend: str) -> dict:
    """Fused attention (``MPISHARD_ATTENTION=fused``) at the benchmark's head size of 64,
    float32 and float16 mixed precision: its kernels compile per head size."""
    from mpishard.core.backend import Backend

    os.environ["MPISHARD_ATTENTION"] = "fused"
    be = Backend.resolve(backend)
    for precision in ("float32", "float16"):
        _tiny_steps(be, "float32", precision, "ddp", head_size=64)
    say("warm: fused attention at head size 64, float32 and float16")
    return {"head_size": 64}


def part_pytest(junit_prefix: str, pytest_args: list) -> int:
    """pytest with a JUnit file per rank (``PREFIX.rankN.xml``)."""
    import pytest
    from mpi4py import MPI

    junit = f"--junitxml={junit_prefix}.rank{MPI.COMM_WORLD.rank}.xml"
    return int(pytest.main([*pytest_args, junit]))


def run_check(args) -> int:
    if args.part == "pytest":
        return part_pytest(args.junit, args.pytest_args)
    ops = args.ops.split(",") if args.ops else []
    checks = {"env": part_env, "collectives": lambda: part_collectives(args.backend),
              "gpt": lambda: part_gpt(args.backend, args.tiny),
              "float16": lambda: part_float16(args.backend, args.tiny), "mpi": part_mpi,
              "warm": lambda: part_warm(args.backend, ops),
              "warm-ops": lambda: part_warm_ops(args.backend, ops),
              "warm-attention": lambda: part_warm_attention(args.backend)}
    started = time.perf_counter()
    result = checks[args.part]()
    from mpi4py import MPI

    if args.result is not None and MPI.COMM_WORLD.rank == 0:
        result["part_seconds"] = round(time.perf_counter() - started, 2)
        args.result.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", required=True,
                        choices=("env", "collectives", "gpt", "float16", "mpi", "pytest",
                                 "warm", "warm-ops", "warm-attention"))
    parser.add_argument("--backend", choices=("cupy", "numpy"), default="cupy")
    parser.add_argument("--tiny", action="store_true", help="gpt, float16: a tiny GPT")
    parser.add_argument("--ops", default="",
                        help="warm, warm-ops: the autodiff ops whose test cases to run")
    parser.add_argument("--result", type=Path, help="write the check's findings here")
    parser.add_argument("--junit", help="(--part pytest) JUnit file prefix")
    parser.add_argument("pytest_args", nargs="*", help="(--part pytest) after --")
    return run_check(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())

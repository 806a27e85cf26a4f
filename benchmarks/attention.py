"""Causal attention on a GPU: the fused kernels against the batched products, side by side.

    python benchmarks/attention.py --json runs/attention.json    # CuPy, GPT-2 small's shape
    python benchmarks/attention.py --backend strict --tiny        # anywhere: the plumbing

Runs the attention op as a GPT block calls it (``causal_self_attention`` on the
packed ``(B*T, 3C)`` output of ``c_attn``, with its bias, no dropout) forward and
backward, once with ``MPISHARD_ATTENTION=batched`` (cuBLAS products, the float32
``T x T`` weights kept) and once with ``fused`` (the flash-style kernels, one
log-sum-exp per row kept), alternating, for float32 and float16 inputs, at GPT-2
small's shape (batch 8, 12 heads of 64, T = 1024; ``--tiny``: 2 x 2 heads of 8, T
= 40). Per path and dtype: the median milliseconds forward and backward with the
device synchronised around each, TFLOP/s counting the products as nanoGPT does
(``4 B T^2 C`` forward, twice that backward: full ``T x T``, so a causal kernel
that skips the masked half shows as twice its real rate), and the bytes the
forward keeps (the ledger's measurement: the CuPy pool's bytes in use, or
tracemalloc on the strict module); then the largest difference between the two
paths' outputs and gradients, relative to the largest value. Exit status 1 when
that exceeds 1e-4 in float32, 2e-2 in float16 or 8e-2 in bfloat16 (``--dtypes
float32,float16,bfloat16``; the two paths compute the same thing in another order),
or when the fused path keeps no less; it prints what and writes ``failures`` in the
JSON. float16 and bfloat16 at a head size of 64 run the fused kernels on tensor cores.
Then the fused kernels alone, forward and backward on head-major q, k and v (no
unpacking around them), beside the milliseconds the planner's GPU kernel model plans
for them on an H100 or H200 (``tensor_core_attention_seconds``): the measurement of
its ``TENSOR_CORE_ATTENTION_SHARE``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mpishard.autodiff import Tensor  # noqa: E402
from mpishard.autodiff.softmax_ops import causal_self_attention  # noqa: E402
from mpishard.core.backend import Backend  # noqa: E402
from mpishard.core.dtypes import resolve_dtype  # noqa: E402

TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 8e-2}   # 8x float16's step


def _sync(backend) -> None:
    if backend.name == "cupy":
        backend.xp.cuda.Device(backend.device).synchronize()


def _host(a) -> np.ndarray:
    return np.asarray(a.get() if hasattr(a, "get") else a, dtype=np.float64)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def run_path(backend, choice: str, qkv, bias, g, heads: int, B: int, repeats: int) -> dict:
    """Forward and backward ``repeats`` times with ``MPISHARD_ATTENTION=choice``."""
    os.environ["MPISHARD_ATTENTION"] = choice
    fwd, bwd, kept = [], [], None
    out = grad = None
    for run in range(repeats + 1):
        x, b = Tensor(qkv, requires_grad=True), Tensor(bias, requires_grad=True)
        _sync(backend)
        t0 = time.perf_counter()
        if run == 0:        # untimed (it compiles): the bytes kept, which the ledger's
            with backend.ledger.measure_activations() as measured:    # walk costs
                y = causal_self_attention(x, heads, B, bias=b)        # milliseconds
            kept = measured.nbytes
        else:
            y = causal_self_attention(x, heads, B, bias=b)
        _sync(backend)
        t1 = time.perf_counter()
        y.backward(g)
        _sync(backend)
        if run:
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t1)
        backend.ledger.release_activations()
        out, grad = y.data, x.grad
    return {"forward_ms": 1e3 * statistics.median(fwd),
            "backward_ms": 1e3 * statistics.median(bwd),
            "kept_bytes": int(kept), "out": out, "grad": grad}


def kernel_times(backend, qkv, B: int, heads: int, T: int, hs: int, repeats: int) -> dict:
    """The fused kernels alone on head-major q, k, v (``(3, B, heads, T, hs)``): median
    milliseconds forward and backward (the device synchronised around each call), and
    whether the tensor-core kernels ran; with the milliseconds the GPU kernel model
    plans for them where the device is one it describes."""
    from mpishard.kernels.cuda import attention as fused
    from mpishard.kernels.cuda.ops_src import ROWS16
    xp = backend.xp
    hm = xp.ascontiguousarray(qkv.reshape(B, T, 3, heads, hs).transpose(2, 0, 3, 1, 4))
    scale = 1.0 / float(np.sqrt(hs))
    y, lse = fused.flash_attention_forward(hm, scale)          # compiles
    gy = xp.ascontiguousarray(y[::-1])                         # any gradient of y's shape
    fused.flash_attention_backward(hm, y, gy, lse, scale)
    fwd, bwd = [], []
    for _ in range(repeats):
        _sync(backend)
        t0 = time.perf_counter()
        y, lse = fused.flash_attention_forward(hm, scale)
        _sync(backend)
        t1 = time.perf_counter()
        fused.flash_attention_backward(hm, y, gy, lse, scale)
        _sync(backend)
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
    name = hm.dtype.name
    tc = (backend.name == "cupy" and name in ROWS16
          and fused._tensor_cores(xp, ROWS16[name][0], hs) is not None)
    found = {"forward_ms": 1e3 * statistics.median(fwd),
             "backward_ms": 1e3 * statistics.median(bwd), "tensor_cores": tc}
    machine = _machine_of(backend) if tc else None
    if machine is not None:
        from mpishard.planning.gpu_time import tensor_core_attention_seconds
        planned = tensor_core_attention_seconds(machine, B * heads, T, hs, name)
        found.update(planned_forward_ms=1e3 * planned[0], planned_backward_ms=1e3 * planned[1],
                     machine=machine.name)
    return found


def _machine_of(backend):
    """The machine description of this GPU (H100 SXM, H200), or None."""
    from mpishard.planning import load_machine
    name = backend.xp.cuda.runtime.getDeviceProperties(backend.device)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    for part, machine in (("H200", "h200"), ("H100 PCIe", None), ("H100", "h100-sxm")):
        if part in name:
            return load_machine(machine) if machine else None
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("cupy", "strict"), default="cupy")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (the plumbing)")
    parser.add_argument("--repeats", type=int, default=4, help="timed runs per path (after "
                        "an untimed one that compiles and measures the bytes kept)")
    parser.add_argument("--dtypes", default="float32,float16")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1 timed run per path")
    if args.backend == "cupy":
        try:
            backend = Backend.resolve("cupy")
        except Exception as err:                       # no CuPy, no GPU
            print(f"SKIPPED: no CuPy GPU here ({err})")
            if args.json:
                Path(args.json).write_text(json.dumps({"status": "skipped",
                                                       "reason": str(err)}) + "\n")
            return 0
    else:
        backend = Backend.resolve("strict")
    B, heads, T, hs = (2, 2, 40, 8) if args.tiny else (8, 12, 1024, 64)
    C = heads * hs
    report = {"backend": backend.name, "shape": {"B": B, "heads": heads, "T": T, "hs": hs},
              "runs": [], "failures": []}
    flops = 4 * B * T * T * C                              # the two products, forward
    for dtype in args.dtypes.split(","):
        r = np.random.default_rng(0)
        qkv, bias, g = (backend.asarray(r.standard_normal(shape).astype(resolve_dtype(dtype)))
                        for shape in ((B * T, 3 * C), (3 * C,), (B * T, C)))
        paths = {}
        for choice in ("batched", "fused", "batched", "fused")[:2 if args.tiny else 4]:
            run = run_path(backend, choice, qkv, bias, g, heads, B, args.repeats)
            paths.setdefault(choice, []).append(run)
        runs = {}
        for choice, rs in paths.items():
            fwd = statistics.median(x["forward_ms"] for x in rs)
            bwd = statistics.median(x["backward_ms"] for x in rs)
            runs[choice] = {"forward_ms": fwd, "backward_ms": bwd,
                            "forward_tflops": flops / fwd / 1e9,
                            "backward_tflops": 2 * flops / bwd / 1e9,
                            "kept_bytes": min(x["kept_bytes"] for x in rs)}
        a, f = paths["batched"][-1], paths["fused"][-1]
        diff = {}
        for what in ("out", "grad"):
            want, got = _host(a[what]), _host(f[what])
            diff[what] = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
        kernels = kernel_times(backend, qkv, B, heads, T, hs, args.repeats)
        report["runs"].append({"dtype": dtype, **runs, "max_rel_diff": diff,
                               "kernels": kernels})
        print(f"{dtype}: " + "; ".join(
            f"{c} fwd {v['forward_ms']:.2f} ms ({v['forward_tflops']:.1f} TFLOP/s), bwd "
            f"{v['backward_ms']:.2f} ms ({v['backward_tflops']:.1f} TFLOP/s), keeps "
            f"{_size(v['kept_bytes'])}" for c, v in runs.items())
            + f"; fused vs batched: out {diff['out']:.1e}, grad {diff['grad']:.1e}", flush=True)
        planned = ("" if "planned_forward_ms" not in kernels else
                   f" (the GPU kernel model plans {kernels['planned_forward_ms']:.2f} and "
                   f"{kernels['planned_backward_ms']:.2f} ms on {kernels['machine']})")
        how = ("tensor cores" if kernels["tensor_cores"] else "a thread a row"
               if backend.name == "cupy" else "the reference on the strict module")
        print(f"{dtype}: the fused kernels alone ({how}): "
              f"fwd {kernels['forward_ms']:.2f} ms, bwd {kernels['backward_ms']:.2f} ms"
              f"{planned}", flush=True)
        if max(diff.values()) > TOLERANCE[dtype]:
            report["failures"].append(f"{dtype}: fused and batched differ by {diff} (more "
                                      f"than {TOLERANCE[dtype]})")
        if runs["fused"]["kept_bytes"] >= runs["batched"]["kept_bytes"]:
            report["failures"].append(f"{dtype}: fused attention keeps "
                                      f"{runs['fused']['kept_bytes']} bytes, batched "
                                      f"{runs['batched']['kept_bytes']}")
    for failure in report["failures"]:
        print(f"FAILED: {failure}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

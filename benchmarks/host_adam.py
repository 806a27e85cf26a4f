"""The host optimizer: mpishard's AdamW step against PyTorch's fastest CPU AdamW, side by side.

    python benchmarks/host_adam.py                        # 100M parameters, 7 rounds
    python benchmarks/host_adam.py --params 2e7 --rounds 5 --threads 1 2 4

What an offloaded optimizer (``--offload optimizer``, docs/offload.md) runs on the host
every step: AdamW with weight decay over float32 parameters, gradients and state,
``--params`` of them (default 100M: 1.6 GB of arrays per implementation), laid out two
ways: one flat buffer (a ZeRO shard, DDP's offloaded master) and GPT-2 small's tensors
(9 of its 12 blocks, 103M parameters; weight decay on the matrices only, as nanoGPT
does), as a list of tensors. Timed, per layout and thread count:

* ``mpishard``: ``mpishard.optim.AdamW.step`` (the compiled one-pass kernel when numba is
  installed, see [Note: one-pass host Adam] in mpishard/kernels/cpu/adam_jit.py);
* ``mpishard-numpy``: the same step as NumPy passes over cache-sized blocks (the
  fallback without numba; the kernel alone, ``numpy_multi_adam_update``);
* ``torch-fused`` and ``torch-foreach``: ``torch.optim.AdamW(fused=True)`` and
  ``(foreach=True)``, the same hyper-parameters;
* ``floor`` (with numba): a compiled loop with AdamW's loads and stores and no
  arithmetic but three additions (``m += g``, ``v += g``, ``p += g``), over the same
  threads: what moving 28 bytes per element costs on this machine, the least any
  AdamW over float32 state can take once its arrays outgrow the caches.

Threads: ``torch.set_num_threads(n)`` and ``MPISHARD_THREADS=n``. Each implementation
takes one untimed step first (first-touch page faults of its state); then the rounds
interleave every implementation and thread count, and each figure is the median over
rounds. The ratio is mpishard's median over the faster of torch's two. Also printed:
the effective memory bandwidth (28 bytes per element: p, g, m, v read, p, m, v written),
each time over the floor's, and the largest difference between mpishard's and torch's parameters after the same
steps, relative to the parameters' largest magnitude (float32 rounding: ~1e-7).

The script runs itself again in a child process with ``OPENBLAS_CORETYPE`` and
``OPENBLAS_L2_SIZE`` removed from its environment (as a user's run would be) and prints
the CPU model and the kernel OpenBLAS picks. Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))   # the CPU and BLAS lines other benchmarks print

from checkpoint_async import _blas_kernel, _cpu  # noqa: E402

#: GPT-2 small: vocabulary, context, width (9 of its 12 blocks make 103M parameters)
GPT2 = dict(vocab=50257, block=1024, width=768)
BYTES_PER_ELEMENT = 28
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def gpt2_shapes(n_params: int) -> list:
    """``(shape, decayed)`` of GPT-2 small's tensors, with as many blocks as come closest
    to ``n_params`` (at least one: 9 for 100M); the token table first, as nanoGPT lists
    them."""
    v, t, c = GPT2["vocab"], GPT2["block"], GPT2["width"]
    block = [((c,), False), ((c,), False), ((3 * c, c), True), ((3 * c,), False),
             ((c, c), True), ((c,), False), ((c,), False), ((c,), False),
             ((4 * c, c), True), ((4 * c,), False), ((c, 4 * c), True), ((c,), False)]
    outside = v * c + t * c + 2 * c
    blocks = max(1, round((n_params - outside) / sum(_numel(s) for s, _ in block)))
    return [((v, c), True), ((t, c), True)] + block * blocks + [((c,), False), ((c,), False)]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _layouts(n_params: int) -> dict:
    return {"flat": [((n_params,), True)], "gpt2": gpt2_shapes(n_params)}


class _Runs:
    """Every implementation's arrays for one layout, from the same start and gradients."""

    def __init__(self, shapes: list, seed: int = 0):
        import numpy as np
        import torch

        from mpishard.optim import AdamW
        from mpishard.parallel.flat import FlatShard

        rng = np.random.default_rng(seed)
        self.shapes = shapes
        self.grads = [rng.standard_normal(s, dtype=np.float32) for s, _ in shapes]
        start = [rng.standard_normal(s, dtype=np.float32) * 0.02 for s, _ in shapes]
        self.n = sum(g.size for g in self.grads)
        # mpishard: each tensor a flat target, decayed whole or not at all
        self.targets = []
        for (shape, decayed), p0, g in zip(shapes, start, self.grads):
            t = FlatShard(p0.reshape(-1).copy(), ((0, p0.size),) if decayed else (), "t")
            t.grad = g.reshape(-1)
            self.targets.append(t)
        self.adamw = AdamW(self.targets, **HYPER)
        self.adamw.allocate_state()
        # the NumPy passes alone: their own arrays, the optimizer's scalars
        self.np_state = [(p0.reshape(-1).copy(), g.reshape(-1), np.zeros(p0.size, np.float32),
                          np.zeros(p0.size, np.float32),
                          ((0, p0.size),) if decayed else ())
                         for (_, decayed), p0, g in zip(shapes, start, self.grads)]
        self.np_steps = 0
        self.floor = [(p0.reshape(-1).copy(), g.reshape(-1), np.zeros(p0.size, np.float32),
                       np.zeros(p0.size, np.float32)) for p0, g in zip(start, self.grads)]
        self.torch = {}
        for kind in ("fused", "foreach"):
            params = [torch.nn.Parameter(torch.from_numpy(p0.copy())) for p0 in start]
            for p, g in zip(params, self.grads):
                p.grad = torch.from_numpy(g)
            groups = [{"params": [p for p, (_, d) in zip(params, shapes) if d]},
                      {"params": [p for p, (_, d) in zip(params, shapes) if not d],
                       "weight_decay": 0.0}]
            groups = [g for g in groups if g["params"]]
            self.torch[kind] = (params, torch.optim.AdamW(groups, **HYPER, **{kind: True}))

    def step(self, name: str) -> None:
        if name == "mpishard":
            self.adamw.step()
        elif name == "mpishard-numpy":
            import math

            from mpishard.kernels.cpu.adam import numpy_multi_adam_update

            self.np_steps += 1
            b1, b2, t, lr = *HYPER["betas"], self.np_steps, HYPER["lr"]
            numpy_multi_adam_update(self.np_state, b1, b2, lr / (1.0 - b1 ** t),
                                    1.0 / math.sqrt(1.0 - b2 ** t), HYPER["eps"], 1.0,
                                    1.0 - lr * HYPER["weight_decay"])
        elif name == "floor":
            from mpishard.kernels.cpu.threads import for_shares

            touch = _floor_kernel()
            for p, g, m, v in self.floor:
                for_shares(lambda lo, hi: touch(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi]),
                           p.size)
        else:
            self.torch[name.removeprefix("torch-")][1].step()

    def difference(self) -> float:
        """Largest |mpishard - torch fused| over the parameters' largest magnitude."""
        import numpy as np

        params = self.torch["fused"][0]
        worst = scale = 0.0
        for t, p in zip(self.targets, params):
            ref = p.detach().numpy().reshape(-1)
            worst = max(worst, float(np.max(np.abs(t.data - ref))))
            scale = max(scale, float(np.max(np.abs(ref))))
        return worst / scale


NAMES = ("mpishard", "mpishard-numpy", "torch-fused", "torch-foreach", "floor")


@functools.cache
def _floor_kernel():
    """AdamW's memory traffic without its arithmetic (see the module docstring); compiled
    once."""
    import numba

    @numba.njit(nogil=True, error_model="numpy", cache=True)
    def touch(p, g, m, v):
        for i in range(p.size):
            gi = g[i]
            m[i] += gi
            v[i] += gi
            p[i] += gi
    return touch


def _child(args) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    from mpishard.kernels.cpu.adam import compiled_adam

    names = NAMES if compiled_adam() is not None else NAMES[:-1]
    results = {}
    for layout, shapes in _layouts(int(args.params)).items():
        runs = _Runs(shapes)
        times = {(n, k): [] for n in args.threads for k in names}
        for n in args.threads:                       # untimed: page faults, compiling
            torch.set_num_threads(n)
            os.environ["MPISHARD_THREADS"] = str(n)
            for name in names:
                runs.step(name)
        for r in range(args.rounds):
            for n in args.threads:
                torch.set_num_threads(n)
                os.environ["MPISHARD_THREADS"] = str(n)
                for name in names:
                    t0 = time.perf_counter()
                    runs.step(name)
                    times[(n, name)].append(time.perf_counter() - t0)
            print(f"{layout}: round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        results[layout] = {"params": runs.n, "tensors": len(shapes),
                           "difference": runs.difference(),
                           "median_s": {f"{name}@{n}": statistics.median(times[(n, name)])
                                        for n in args.threads for name in names}}
        del runs
    return {"results": results, "compiled": compiled_adam() is not None,
            "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=1e8, help="parameters (default 1e8)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args)))
        return
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    env["PYTHONPATH"] = str(ROOT)
    child = subprocess.run([sys.executable, __file__, "--child", "--params", str(args.params),
                            "--rounds", str(args.rounds), "--threads",
                            *map(str, args.threads)], env=env, stdout=subprocess.PIPE,
                           text=True)
    if child.returncode:
        raise SystemExit(f"the benchmark's child process failed ({child.returncode})")
    out = json.loads(child.stdout.strip().splitlines()[-1])
    cpu, blas = _cpu(), _blas_kernel(env)
    print(f"CPU {cpu} ({os.cpu_count()} cores); BLAS {blas}; torch {out['torch']}; "
          f"mpishard's AdamW {'compiled (numba)' if out['compiled'] else 'NumPy passes'}; "
          f"median of {args.rounds} interleaved rounds", file=sys.stderr)
    summary = {}
    for layout, res in out["results"].items():
        med = res["median_s"]
        print(f"\n{layout}: {res['params'] / 1e6:.1f}M float32 parameters in {res['tensors']} "
              f"tensor(s); mpishard - torch after the same steps: {res['difference']:.1e} of "
              f"the largest parameter", file=sys.stderr)
        print(f"{'threads':>7} {'implementation':<15} {'median ms':>10} {'GB/s':>6} "
              f"{'x best torch':>13} {'x floor':>8}", file=sys.stderr)
        for n in args.threads:
            best = min(med[f"torch-fused@{n}"], med[f"torch-foreach@{n}"])
            floor = med.get(f"floor@{n}")
            for name in NAMES:
                if f"{name}@{n}" not in med:
                    continue
                s = med[f"{name}@{n}"]
                gbs = BYTES_PER_ELEMENT * res["params"] / s / 1e9
                over = f"{s / floor:>8.3f}" if floor else f"{'':>8}"
                print(f"{n:>7} {name:<15} {s * 1e3:>10.1f} {gbs:>6.1f} {s / best:>13.3f} "
                      f"{over}", file=sys.stderr)
            summary[f"{layout}@{n}"] = med[f"mpishard@{n}"] / best
    print(json.dumps({"benchmark": "host_adam", "cpu": cpu, "blas": blas,
                      "params": args.params, "rounds": args.rounds,
                      "compiled": out["compiled"], "ratio_vs_best_torch": summary,
                      "results": out["results"]}))


if __name__ == "__main__":
    main()

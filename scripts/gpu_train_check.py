"""Training end to end on an array module: a small GPT learns, in float32 and float16.

    python scripts/gpu_train_check.py --backend cupy [--result PATH]   # scripts/gpu_check.sh
    python scripts/gpu_train_check.py --backend numpy                  # the same on the CPU
    python scripts/gpu_train_check.py --backend cupy --warm   # 2 steps a run, no checks

Trains a small GPT (2 layers, width 64, DataParallel at size 1) for 30 AdamW
steps on one fixed batch, three ways: float32; float16 mixed precision with
the dynamic loss scale; float16 with activation checkpointing. Checks that
each run learns (the loss ends below half its start), that float16 follows
float32 (first five losses within 1%), and that activation checkpointing gives
the losses it gives without (bit-identical on NumPy; within 1e-5 on CuPy,
whose scatter-add in the embedding's backward adds in no fixed order). Prints
one line per run, writes the loss curves and step times to ``--result``, and
exits non-zero on any failure. (Each op and a GPT step against NumPy are in
tests/testing/test_array_modules.py, which the GPU check runs on CuPy.) ``--warm``
runs each run for 2 steps and checks nothing: the GPU check's ``warm_kernels`` part
runs it so that CuPy has compiled these kernels before the ``train_check`` part.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mpi4py import MPI  # noqa: E402

from mpishard.core.backend import Backend  # noqa: E402
from mpishard.comm import Communicator, Mesh  # noqa: E402
from mpishard.models import GPT, GPTConfig  # noqa: E402
from mpishard.optim import AdamW  # noqa: E402
from mpishard.parallel import DataParallel  # noqa: E402

CFG = GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=64)
STEPS, BATCH = 30, 8
WARM_STEPS = 2      # --warm: each run's kernels met, nothing checked
RUNS = (("float32", "float32", False), ("float16", "float16", False),
        ("float16+checkpointing", "float16", True))


def train(backend_name: str, precision: str, checkpointing: bool, steps: int = STEPS) -> dict:
    """Train on one fixed batch; the losses, step times and what the loss scale did."""
    backend = Backend.resolve(backend_name)
    comm = Communicator(MPI.COMM_SELF.Dup(), "self", _owned=True)
    model = GPT(CFG, seed=0, backend=backend).set_activation_checkpointing(checkpointing)
    strategy = DataParallel(model, Mesh(comm, dp=1), precision=precision)
    opt = AdamW(strategy.parameters(), lr=3e-3, ledger=strategy.ledger)
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (BATCH, CFG.block_size + 1))
    x, y = backend.asarray(tokens[:, :-1]), backend.asarray(tokens[:, 1:])
    losses, times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        _, loss = strategy(x, y)
        strategy.scale_loss(loss).backward()
        strategy.step(opt, max_norm=1.0)
        losses.append(loss.item())  # waits for the device
        times.append(time.perf_counter() - start)
    comm.free()
    return {"losses": losses, "step_s_median": statistics.median(times[1:]),
            "skipped_steps": strategy.skipped_steps, "loss_scale": strategy.scaler.scale}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("cupy", "numpy"), default="cupy")
    parser.add_argument("--result", type=Path, default=None, help="write the results here")
    parser.add_argument("--warm", action="store_true",
                        help="2 steps a run and no checks: compile the kernels ahead")
    args = parser.parse_args()
    runs, failures = {}, []
    for label, precision, checkpointing in RUNS:
        run = runs[label] = train(args.backend, precision, checkpointing,
                                  WARM_STEPS if args.warm else STEPS)
        if args.warm:
            print(f"{args.backend} {label}: {WARM_STEPS} steps (warm: nothing checked)",
                  flush=True)
            continue
        first, last = run["losses"][0], run["losses"][-1]
        print(f"{args.backend} {label:<22} loss {first:.3f} -> {last:.3f}, "
              f"{run['step_s_median'] * 1e3:.1f} ms/step, skipped {run['skipped_steps']}, "
              f"loss scale {run['loss_scale']:g}", flush=True)
        if not last < 0.5 * first:
            failures.append(f"{label}: the loss fell only from {first:.3f} to {last:.3f}")
    if args.warm:
        return 0
    f32, f16 = np.array(runs["float32"]["losses"]), np.array(runs["float16"]["losses"])
    drift = float(np.max(np.abs(f16[:5] - f32[:5]) / f32[:5]))
    if not drift <= 0.01:
        failures.append(f"float16 left float32 by {drift:.2%} in the first five steps")
    recomputed = np.array(runs["float16+checkpointing"]["losses"])
    exact = args.backend == "numpy"
    if not (np.array_equal(recomputed, f16) if exact else np.allclose(recomputed, f16, rtol=1e-5)):
        failures.append(f"activation checkpointing changed the losses: {recomputed} vs {f16}")
    for failure in failures:
        print(f"FAIL {failure}", flush=True)
    if args.result is not None:
        args.result.write_text(json.dumps({"backend": args.backend, "runs": runs,
                                           "float16_drift_first_5": drift,
                                           "failures": failures}, indent=1) + "\n")
    print(f"gpu_train_check: {len(failures)} failure(s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Activation checkpointing on GPT config S: activation bytes saved, step time paid,
for whole blocks and for attention's core alone (selective recomputation).

    OMP_NUM_THREADS=1 python benchmarks/activations.py
    python benchmarks/activations.py --steps 10 --dropout 0.1
    python benchmarks/activations.py --block-size 1024 --batch-size 2   # long sequences

GPT config S (vocab 256, block 128, 4 layers, 4 heads, width 256, float32),
batch 16 x 128 tokens, as in ``benchmarks/step.py`` (``--block-size`` and
``--batch-size`` change the sequence length and batch), built three times from the
same seed: plain, with ``set_activation_checkpointing(True)`` (each block
recomputed) and with ``set_activation_checkpointing("selective")`` (attention's
``T x T`` core recomputed). For each,
the memory ledger measures the bytes one training forward leaves alive for
backward (:meth:`mpishard.core.backend.MemoryLedger.measure_activations`: NumPy
allocations traced by tracemalloc, minus what the ledger counts elsewhere).
Then full steps (forward, backward, AdamW) are timed, the modes taking turns
step by step so all see the same machine load, untraced. The block recompute
costs about one extra forward of every block per step, the selective one the
attention core's forward. Prints a
table on stderr and one JSON line on stdout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import numpy as np  # noqa: E402

from mpishard.models import GPT, GPTConfig  # noqa: E402
from mpishard.optim import AdamW  # noqa: E402

CONFIG_S = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256)
BATCH = 16
MIB = 2**20
MODES = ("plain", "checkpointed", "selective")
_SETTING = {"plain": "none", "checkpointed": "full", "selective": "selective"}


def _setup(mode: str, dropout: float, config: dict, batch: int):
    model = GPT(GPTConfig(**config, dropout=dropout), seed=0)
    model.set_activation_checkpointing(_SETTING[mode])
    opt = AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    r = np.random.default_rng(0)
    x = r.integers(0, config["vocab_size"], (batch, config["block_size"]))
    y = r.integers(0, config["vocab_size"], (batch, config["block_size"]))

    def measure() -> int:
        with model.backend.ledger.measure_activations() as m:
            _, loss = model(x, y)
        loss.backward()
        model.zero_grad()
        model.backend.ledger.release_activations()
        return m.nbytes

    def step() -> float:
        t0 = time.perf_counter()
        _, loss = model(x, y)
        model.zero_grad()
        loss.backward()
        opt.step()
        return time.perf_counter() - t0
    return measure, step


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per mode")
    parser.add_argument("--dropout", type=float, default=0.0, help="GPT dropout (config S: 0)")
    parser.add_argument("--block-size", type=int, default=CONFIG_S["block_size"],
                        help="sequence length T (config S: 128)")
    parser.add_argument("--batch-size", type=int, default=BATCH, help="sequences per step")
    args = parser.parse_args(argv)

    config = {**CONFIG_S, "block_size": args.block_size}
    runs = {mode: _setup(mode, args.dropout, config, args.batch_size) for mode in MODES}
    nbytes = {mode: runs[mode][0]() for mode in MODES}
    times = {mode: [] for mode in MODES}
    for i in range(args.warmup + args.steps):
        for mode in MODES[i % len(MODES):] + MODES[:i % len(MODES)]:
            seconds = runs[mode][1]()
            if i >= args.warmup:
                times[mode].append(seconds)
    median = {mode: statistics.median(times[mode]) for mode in MODES}
    result = {"benchmark": "activations", "config": "S", **config, "batch": args.batch_size,
              "dtype": "float32", "dropout": args.dropout,
              "activation_bytes": nbytes,
              "activation_ratio": round(nbytes["plain"] / nbytes["checkpointed"], 2),
              "median_step_s": {m: round(s, 4) for m, s in median.items()},
              "step_time_ratio": round(median["checkpointed"] / median["plain"], 3),
              "selective_activation_ratio": round(nbytes["plain"] / nbytes["selective"], 2),
              "selective_kept_fraction": round(nbytes["selective"] / nbytes["plain"], 3),
              "selective_step_time_ratio": round(median["selective"] / median["plain"], 3)}
    for mode in MODES:
        print(f"{mode:13s} activations {nbytes[mode] / MIB:8.2f} MiB   "
              f"step {median[mode]:.3f} s (median of {args.steps})", file=sys.stderr)
    print(f"checkpointing keeps {result['activation_ratio']}x fewer activation bytes for "
          f"{result['step_time_ratio']}x the step time; selective recomputation "
          f"{result['selective_activation_ratio']}x fewer (keeps "
          f"{result['selective_kept_fraction']} of them) for "
          f"{result['selective_step_time_ratio']}x; T = {config['block_size']}, batch "
          f"{args.batch_size}", file=sys.stderr)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

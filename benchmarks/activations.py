"""Activation checkpointing on GPT config S: activation bytes saved, step time paid,
for whole blocks and for attention's core alone (selective recomputation).

    OMP_NUM_THREADS=1 python benchmarks/activations.py
    python benchmarks/activations.py --steps 10 --dropout 0.1
    python benchmarks/activations.py --block-size 1024 --batch-size 2   # long sequences
    python benchmarks/activations.py --block-size 1024 --batch-size 2 --dropout 0.1 \
        --precision bfloat16        # Megatron's accounting: 16-bit rows, 1-byte masks
    python benchmarks/activations.py ... --n-layer 12     # GPT-2 small's depth
    python benchmarks/activations.py --model llama        # Llama config S

GPT config S (vocab 256, block 128, 4 layers, 4 heads, width 256, float32),
batch 16 x 128 tokens, as in ``benchmarks/step.py`` (``--block-size`` and
``--batch-size`` change the sequence length and batch), built three times from the
same seed (``--model llama``: Llama config S of ``benchmarks/step.py``, grouped-query
attention with 2 key/value heads and a SwiGLU MLP of width 768, no dropout):
plain, with ``set_activation_checkpointing(True)`` (each block
recomputed), with ``set_activation_checkpointing("selective")`` (attention's
``T x T`` core recomputed) and with ``set_activation_checkpointing("op")`` (each
block recomputed but for every second matrix product, whose output it keeps:
torchtitan's selective recomputation by op). For each,
the memory ledger measures the bytes one training forward leaves alive for
backward (printed beside the plan's figure, ``GPT.activation_bytes``) (:meth:`mpishard.core.backend.MemoryLedger.measure_activations`: NumPy
allocations traced by tracemalloc, minus what the ledger counts elsewhere).
Then full steps (forward, backward, AdamW) are timed, the modes taking turns
step by step so all see the same machine load, untraced. The block recompute
costs about one extra forward of every block per step, the selective one the
attention core's forward. Prints a
table on stderr and one JSON line on stdout.

``--precision bfloat16`` (or ``float16``) runs the three through data parallelism on
one rank with that mixed precision (16-bit activations, float32 masters, as
:func:`~mpishard.parallel.wrap_model` gives it). The fractions are printed twice:
for the whole model, and per block (a 1-block model's bytes taken away: what is left
is the blocks', the quantity of Korthikanti et al. 2022's ``s b h (34 + 5 a s / h)``
per layer, whose selective share ``34 / (34 + 5 a s / h)`` is 0.298 at config S's
``h = 256, a = 4`` and ``s = 1024``).
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

from mpishard.models import GPT, GPTConfig, Llama, LlamaConfig  # noqa: E402
from mpishard.optim import AdamW  # noqa: E402

CONFIG_S = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256)
#: Llama config S (as benchmarks/step.py's)
LLAMA_S = dict(CONFIG_S, n_kv_head=2, intermediate_size=768)
BATCH = 16
MIB = 2**20
MODES = ("plain", "checkpointed", "selective", "by op")
_SETTING = {"plain": "none", "checkpointed": "full", "selective": "selective", "by op": "op"}


def _make(config: dict, dropout: float, **kw):
    """A GPT or (``config`` with key/value heads) a Llama of ``config``."""
    if "n_kv_head" in config:
        return Llama(LlamaConfig(**config), **kw)
    return GPT(GPTConfig(**config, dropout=dropout), **kw)


def _build(mode: str, dropout: float, config: dict, precision: str):
    """``(model or its wrapper, ledger, optimizer)``: float32 as it is; 16-bit through data
    parallelism on this rank alone (the mixed-precision path a run takes)."""
    if precision == "float32":
        model = _make(config, dropout, seed=0)
        model.set_activation_checkpointing(_SETTING[mode])
        return model, model.backend.ledger, AdamW(model.parameters(), lr=3e-4,
                                                  weight_decay=0.1)
    from mpi4py import MPI  # noqa: PLC0415  (only the 16-bit runs need a communicator)

    from mpishard.comm import Communicator, Mesh  # noqa: PLC0415
    from mpishard.parallel import wrap_model  # noqa: PLC0415
    model = _make(config, dropout, seed=0, materialize_now=False)
    model.set_activation_checkpointing(_SETTING[mode])
    run = wrap_model(model, Mesh(Communicator(MPI.COMM_SELF)), "ddp", precision=precision)
    opt = AdamW(run.parameters(), lr=3e-4, weight_decay=0.1, ledger=run.ledger)
    return run, run.ledger, opt


def _setup(mode: str, dropout: float, config: dict, batch: int, precision: str = "float32"):
    """``(measure, step, planned bytes)`` of one mode."""
    model, ledger, opt = _build(mode, dropout, config, precision)
    inner = getattr(model, "module", model)
    planned = inner.activation_bytes(batch, config["block_size"], precision)
    r = np.random.default_rng(0)
    x = r.integers(0, config["vocab_size"], (batch, config["block_size"]))
    y = r.integers(0, config["vocab_size"], (batch, config["block_size"]))

    def measure() -> int:
        with ledger.measure_activations() as m:
            _, loss = model(x, y)
        loss.backward()
        model.zero_grad()
        ledger.release_activations()
        return m.nbytes

    def step() -> float:
        t0 = time.perf_counter()
        _, loss = model(x, y)
        model.zero_grad()
        loss.backward()
        if precision == "float32":
            opt.step()
        else:
            model.step(opt)
        return time.perf_counter() - t0
    return measure, step, planned


def _second(measure) -> int:
    """``measure()``'s bytes the second time: the first forward of a process (or of a
    mode) also allocates what it builds once and keeps (4 MiB at T = 1024 in bfloat16),
    which is not what a forward keeps for backward."""
    measure()
    return measure()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("gpt", "llama"), default="gpt",
                        help="GPT config S, or Llama config S (no dropout)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per mode")
    parser.add_argument("--dropout", type=float, default=0.0, help="GPT dropout (config S: 0)")
    parser.add_argument("--block-size", type=int, default=CONFIG_S["block_size"],
                        help="sequence length T (config S: 128)")
    parser.add_argument("--batch-size", type=int, default=BATCH, help="sequences per step")
    parser.add_argument("--n-layer", type=int, default=CONFIG_S["n_layer"],
                        help="blocks (config S: 4; the embeddings, head and loss are a fixed "
                             "share of the whole model's bytes, smaller the deeper it is)")
    parser.add_argument("--precision", default="float32",
                        choices=("float32", "bfloat16", "float16"),
                        help="activations' precision (16-bit: mixed, float32 masters)")
    args = parser.parse_args(argv)

    if args.n_layer < 2:
        parser.error(f"--n-layer {args.n_layer}: the per-block figures need at least 2 blocks")
    if args.model == "llama" and args.dropout:
        parser.error(f"--dropout {args.dropout}: the Llama has no dropout")
    config = {**(LLAMA_S if args.model == "llama" else CONFIG_S),
              "block_size": args.block_size, "n_layer": args.n_layer}
    runs = {mode: _setup(mode, args.dropout, config, args.batch_size, args.precision)
            for mode in MODES}
    nbytes = {mode: _second(runs[mode][0]) for mode in MODES}
    one_block = {**config, "n_layer": 1}   # the embeddings, head and loss, one block
    per_block = {mode: (nbytes[mode] - _second(_setup(mode, args.dropout, one_block,
                                                      args.batch_size, args.precision)[0]))
                 / (config["n_layer"] - 1) for mode in MODES}
    times = {mode: [] for mode in MODES}
    for i in range(args.warmup + args.steps):
        for mode in MODES[i % len(MODES):] + MODES[:i % len(MODES)]:
            seconds = runs[mode][1]()
            if i >= args.warmup:
                times[mode].append(seconds)
    median = {mode: statistics.median(times[mode]) for mode in MODES}
    result = {"benchmark": "activations", "model": args.model, "config": "S", **config,
              "batch": args.batch_size,
              "dtype": args.precision, "dropout": args.dropout,
              "activation_bytes": nbytes,
              "planned_activation_bytes": {m: runs[m][2] for m in MODES},
              "activation_bytes_per_block": {m: int(b) for m, b in per_block.items()},
              "selective_kept_fraction_per_block": round(per_block["selective"]
                                                         / per_block["plain"], 3),
              "activation_ratio": round(nbytes["plain"] / nbytes["checkpointed"], 2),
              "median_step_s": {m: round(s, 4) for m, s in median.items()},
              "step_time_ratio": round(median["checkpointed"] / median["plain"], 3),
              "selective_activation_ratio": round(nbytes["plain"] / nbytes["selective"], 2),
              "selective_kept_fraction": round(nbytes["selective"] / nbytes["plain"], 3),
              "selective_step_time_ratio": round(median["selective"] / median["plain"], 3),
              "op_kept_fraction": round(nbytes["by op"] / nbytes["plain"], 3),
              "op_step_time_ratio": round(median["by op"] / median["plain"], 3)}
    if args.model == "gpt":   # Korthikanti et al. 2022, Table 2: s b h (34 + 5 a s / h) a layer
        a, h = config["n_head"], config["n_embd"]
        result["paper_selective_fraction_per_block"] = round(
            34 / (34 + 5 * a * config["block_size"] / h), 3)
        paper = (f" (Korthikanti et al.'s 34 / (34 + 5 a s / h): "
                 f"{result['paper_selective_fraction_per_block']})")
    else:
        paper = ""
    for mode in MODES:
        print(f"{mode:13s} activations {nbytes[mode] / MIB:8.2f} MiB "
              f"({per_block[mode] / MIB:7.2f} MiB a block; planned "
              f"{runs[mode][2] / nbytes[mode] - 1:+.1%})   "
              f"step {median[mode]:.3f} s (median of {args.steps})", file=sys.stderr)
    print(f"checkpointing keeps {result['activation_ratio']}x fewer activation bytes for "
          f"{result['step_time_ratio']}x the step time; selective recomputation "
          f"{result['selective_activation_ratio']}x fewer (keeps "
          f"{result['selective_kept_fraction']} of them) for "
          f"{result['selective_step_time_ratio']}x; a block keeps "
          f"{result['selective_kept_fraction_per_block']} of its bytes{paper}; T = "
          f"{config['block_size']}, batch {args.batch_size}, {args.precision}", file=sys.stderr)
    print(f"recomputation by op (every second product's output kept) keeps "
          f"{result['op_kept_fraction']} of them for {result['op_step_time_ratio']}x the "
          f"step time", file=sys.stderr)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

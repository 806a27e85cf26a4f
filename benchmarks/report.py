"""Run every benchmark and regenerate docs/performance.md from what they print.

    python benchmarks/report.py --run --results benchmarks/results/<date>     # run all (30-40 min on 2 cores)
    python benchmarks/report.py --results runs/bench           # only rebuild the page

Each benchmark writes one JSON line on stdout and a readable table on stderr;
``--run`` stores both as ``<name>.json`` / ``<name>.txt`` in the results folder,
and the page is built from those files alone: the tables verbatim, the headline
ratios pulled out of the JSON. Needs torch (``pip install torch==2.13.0``) for
the side-by-side columns; without it those columns are missing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def _mpi(n, script, *args):
    return [str(BIN / "mpiexec"), "-n", str(n), sys.executable, "-m", "mpi4py", script, *args]


BENCHMARKS = {  # name -> (command, environment overrides)
    "step": ([sys.executable, "benchmarks/step.py"], {}),
    "comm": (_mpi(4, "benchmarks/comm.py"), THREADS),
    "strategies": ([sys.executable, "benchmarks/strategies.py", "--rounds", "4"], THREADS),
    "memory": (_mpi(4, "benchmarks/memory.py"), THREADS),
    "layouts": ([sys.executable, "benchmarks/layouts.py", "--launch"], THREADS),
    "checkpoint_kill": ([sys.executable, "benchmarks/checkpoint_kill.py", "--kills", "24"],
                        THREADS),
    "precision": (_mpi(4, "benchmarks/precision.py", "--steps", "8"), THREADS),
    "activations": ([sys.executable, "benchmarks/activations.py"], THREADS),
    "long_context": (_mpi(4, "benchmarks/long_context.py"), THREADS),
    "moe": (_mpi(4, "benchmarks/moe.py"), THREADS),
}


def run_all(results: Path, only=None) -> None:
    results.mkdir(parents=True, exist_ok=True)
    for name, (cmd, extra) in BENCHMARKS.items():
        if only and name not in only:
            continue
        print(f"running {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        (results / f"{name}.json").write_text(out.stdout)
        (results / f"{name}.txt").write_text(out.stderr)
        if out.returncode:
            print(f"  {name} exited {out.returncode}", file=sys.stderr)


def _json(results: Path, name: str):
    path = results / f"{name}.json"
    if not path.exists():
        return None
    lines = [l for l in path.read_text().splitlines() if l.strip().startswith("{")]
    return json.loads(lines[-1]) if lines else None


def _everything(line: str) -> bool:
    return True


def _table(results: Path, name: str, keep=_everything) -> str:
    """The benchmark's readable table: its stderr, or the non-JSON lines of its stdout."""
    text = ""
    for suffix in (".txt", ".json"):
        path = results / f"{name}{suffix}"
        if path.exists():
            text = "\n".join(l for l in path.read_text().splitlines()
                             if l.strip() and not l.lstrip().startswith("{") and keep(l))
        if text:
            break
    return "```\n" + text + "\n```" if text else "(not run)"


#: (heading, what was measured, benchmark name, which lines of its table to keep)
SECTIONS = [
    ("Collectives: mpishard against raw mpi4py, 4 ranks",
     "Median bus bandwidth per collective and size, nccl-tests definitions "
     "(`benchmarks/comm.py`).", "comm", _everything),
    ("Strategies against PyTorch DDP and FSDP2",
     "GPT config S, 16 sequences per rank, float32, at 2 and 4 ranks "
     "(`benchmarks/strategies.py`); torch uses gloo and `torchrun`.",
     "strategies", lambda l: not l.startswith("round ")),
    ("Bigger than one rank",
     "A GPT whose parameters, gradients and Adam state exceed the per-rank "
     "budget trains under ZeRO-3; DDP fails on the same budget with "
     "`OutOfMemoryBudget` (`benchmarks/memory.py`).", "memory", _everything),
    ("Every 4-rank layout: dp, tp, pp",
     "GPT config S, the same global batch everywhere, one `mpiexec` per layout; "
     "pipelines with 4 micro-batches, measured idle fraction next to the ideal "
     "bubble (p-1)/(m+p-1) (`benchmarks/layouts.py --launch`).",
     "layouts", lambda l: not l.endswith(": done")),
    ("Killing a rank during checkpoint saves",
     "SIGKILL at random moments of repeated saves; after each kill the newest "
     "complete checkpoint must verify and load, and the next save must succeed "
     "(`benchmarks/checkpoint_kill.py`).", "checkpoint_kill", _everything),
    ("Mixed precision on the CPU",
     "ZeRO-3 on 4 ranks, GPT config S, float32 against float16 and bfloat16 "
     "compute (float32 masters, float32 gradient reduction), stepped in turn; "
     "NumPy has no 16-bit matrix product, so the 16-bit runs compute in float32 "
     "inside each op and pay the casts (`benchmarks/precision.py`).", "precision", _everything),
    ("Activation checkpointing",
     "GPT config S, one process: activation bytes one forward keeps for backward "
     "(`MemoryLedger.measure_activations`) and step time, without and with "
     "`set_activation_checkpointing(True)` (`benchmarks/activations.py`).",
     "activations", _everything),
    ("Long sequences and many nodes: context, sequence and hybrid sharding",
     "4 ranks, GPT config S widths at sequence 2048 (2 blocks), one measured step per "
     "layout: activation bytes per rank (cp4 ring vs dp4, tp4 with sequence parallelism "
     "vs without), the longest sequence within a 48 MiB per-rank budget (cp4 vs dp4), "
     "ring attention's bytes against the K/V volume and its per-rank work (zigzag vs "
     "contiguous split), and the bytes that cross nodes on 2 emulated nodes x 2 ranks "
     "(hybrid sharding vs ZeRO-3 over all 4) (`benchmarks/long_context.py`). Sequence "
     "parallelism shrinks only the rows between the tensor-split layers (norms, residual "
     "adds, row-parallel outputs); the head-split attention weights (B x heads/tp x T x T "
     "per layer, kept for backward) and the feature-split activations are 1/tp without it. "
     "Megatron-LM's own count (Korthikanti et al., 2022: 34/t against 10 + 24/t units of "
     "s b h per layer, before attention) gives 0.53x at best for tp = 4, so its 0.35x "
     "target is out of reach while attention keeps its T x T weights.",
     "long_context", lambda l: not l.lstrip().startswith(("dp4:", "cp4:", "tp4:"))),
    ("Mixture of experts: expert parallelism",
     "4 ranks, a Llama of config S widths with 8 SwiGLU experts of width 384 in every "
     "block, top-2, dropless, batch 4 sequences of 128 per rank: the expert weights the "
     "busiest rank holds at ep4 vs ep1 (DDP, and ZeRO-3 with the bytes its all-gathers "
     "move), tokens per second against a dense Llama with the same active parameters per "
     "token (SwiGLU width 768) on the same 4 ranks (DDP, interleaved rounds), and the "
     "all-to-all-v bytes of one step against the rows that step's routing sent off each "
     "rank (`benchmarks/moe.py`).", "moe", _everything),
]


def render(results: Path) -> str:
    step = _json(results, "step") or {}
    parts = ["# Performance", "",
             "Generated by `python benchmarks/report.py --results "
             f"{results}` from the benchmarks' own output; do not edit by hand.", "",
             "## How the figures are measured", "",
             f"- machine: {platform.machine()}, {os.cpu_count()} cores, Python "
             f"{platform.python_version()}; MPI from the `mpich` wheel.",
             "- every comparison runs both sides in one invocation, interleaved round by "
             "round, and reports medians; read ratios, not absolute times (the machine "
             "is shared).",
             "- multi-rank runs use `OMP_NUM_THREADS=1`; 4 ranks on 2 cores oversubscribe.", ""]
    parts += ["## One training step, one process: mpishard against PyTorch eager", "",
              "GPT config S (vocab 256, block 128, 4 layers, 4 heads, width 256), batch 16, "
              "float32, forward + backward + AdamW (`benchmarks/step.py`).", ""]
    rows = ["| BLAS threads | mpishard s/step | torch s/step | mpishard / torch | "
            "peak RSS mpishard / torch (MiB) |", "|---|---|---|---|---|"]
    for key, entry in step.get("results", {}).items():
        m, t = entry.get("mpishard", {}), entry.get("torch", {})
        rows.append(f"| {key.split('_')[0]} | {m.get('median_step_s', '')} | "
                    f"{t.get('median_step_s', '-')} | "
                    f"{entry.get('ratio_mpishard_over_torch', '-')} | "
                    f"{m.get('peak_rss_mib', '')} / {t.get('peak_rss_mib', '-')} |")
    parts += rows + ["", "At 1 thread mpishard's NumPy step is faster than PyTorch eager (the "
                      "target). With 2 threads only BLAS uses the second core in NumPy, while "
                      "PyTorch also runs its elementwise kernels in parallel, so the ratio "
                      "rises above 1 there; the cache-blocked elementwise ops of "
                      "`mpishard/autodiff/nn_ops.py` are where a thread pool would go.", ""]
    for title, text, name, keep in SECTIONS:
        parts += [f"## {title}", "", text, "", _table(results, name, keep), ""]
    parts += ["## Regenerating this page", "",
              "```", "python benchmarks/report.py --run --results benchmarks/results/<date>", "```", "",
              "See [performance-benchmarks.md](performance-benchmarks.md) for what each "
              "column means."]
    return "\n".join(parts) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="runs/bench", help="folder of benchmark outputs")
    parser.add_argument("--run", action="store_true", help="run the benchmarks first")
    parser.add_argument("--only", help="comma-separated benchmarks to run")
    parser.add_argument("--out", default=str(ROOT / "docs" / "performance.md"))
    args = parser.parse_args(argv)
    results = Path(args.results)
    if args.run:
        run_all(results, args.only.split(",") if args.only else None)
    Path(args.out).write_text(render(results))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

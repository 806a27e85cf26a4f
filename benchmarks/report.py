"""Run every benchmark and regenerate docs/performance.md from what they print.

    python benchmarks/report.py --run --results benchmarks/results/$(date +%F)   # run all (30-40 min on 2 cores)
    python benchmarks/report.py                                                 # only rebuild the page

Each benchmark writes one JSON line on stdout and a readable table on stderr;
``--run`` stores both as ``<name>.json`` / ``<name>.txt`` in the results folder.
The page is built from the files under ``benchmarks/results/`` alone: for each
benchmark the newest dated folder that holds it (``<name>_final.*``, a stop's
final code, before ``<name>.*``), the tables verbatim, the headline ratios pulled
out of the JSON, each section dated. The dated notes that went with earlier
figures are in ``benchmarks/results/HISTORY.md``. Needs torch (``pip install torch==2.13.0``) for
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
    "activations_llama": ([sys.executable, "benchmarks/activations.py", "--model", "llama"],
                          THREADS),
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


RESULTS = ROOT / "benchmarks" / "results"
STEMS = ("{name}_final", "{name}")    # within one folder, the first that exists


def latest(results: Path, name: str):
    """``(folder, stem)`` of the newest result of benchmark ``name`` under ``results``
    (a folder of dated folders, or one dated folder), or ``None``."""
    folders = [results] if any(results.glob("*.json")) else sorted(
        (d for d in results.iterdir() if d.is_dir()), reverse=True)
    for folder in folders:
        for pattern in STEMS:
            stem = pattern.format(name=name)
            if (folder / f"{stem}.json").exists() or (folder / f"{stem}.txt").exists():
                return folder, stem
    return None


def _where(found) -> str:
    folder, stem = found
    suffix = ".json" if (folder / f"{stem}.json").exists() else ".txt"
    return f"measured {folder.name}, `{_shown(folder)}/{stem}{suffix}`"


def _scalars(results: Path, name: str) -> str:
    """A JSON-only result's top-level numbers, one per line (its table when it printed none)."""
    data = _json(results, name) or {}
    lines = [f"{key}: {value}" for key, value in data.items()
             if isinstance(value, (int, float)) and not isinstance(value, bool)]
    return "```\n" + "\n".join(lines) + "\n```" if lines else "(not run)"


def _shown(folder: Path) -> str:
    try:
        return str(folder.resolve().relative_to(ROOT))
    except ValueError:
        return str(folder)


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
    ("Activation checkpointing: a Llama",
     "Llama config S (grouped-query attention with 2 key/value heads, SwiGLU width 768), "
     "one process, float32: the same figures, with selective recomputation (on NumPy the "
     "one-op grouped-query attention recomputed whole) (`benchmarks/activations.py "
     "--model llama`).", "activations_llama", _everything),
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
     "token (SwiGLU width 768) on the same 4 ranks and against the same MoE at ep1 (DDP, "
     "interleaved rounds), and the "
     "all-to-all-v bytes of one step against the rows that step's routing sent off each "
     "rank (`benchmarks/moe.py`).", "moe", _everything),
    ("Host synchronisations and kernel launches on a device",
     "Host reads per training step on the strict module, per strategy and world size, and "
     "the kernel launches of one GPT block, counted on the strict module as a GPU would run "
     "them (`benchmarks/syncs.py`).", "syncs", _everything),
]


def _ratio(entry: dict, key: str) -> str:
    value = entry.get(key)
    return f"{value:.3f}" if isinstance(value, (int, float)) else "-"


def _expect(results: Path) -> list:
    """The headline figures: what a user can expect today, each with its date."""
    rows = ["| what | figure | measured |", "|---|---|---|"]
    found = latest(results, "step")
    if found:
        step = _json(*found) or {}
        for key, entry in step.get("results", {}).items():
            threads = key.split("_")[0]
            rows.append(f"| one process, GPT config S, {threads} BLAS thread(s): mpishard / "
                        f"PyTorch eager step time | {_ratio(entry, 'ratio_mpishard_over_torch')}"
                        f" | {found[0].name} |")
            if "ratio_llama_mpishard_over_transformers" in entry:
                rows.append(f"| one process, Llama config S, {threads} BLAS thread(s): "
                            f"mpishard / transformers | "
                            f"{_ratio(entry, 'ratio_llama_mpishard_over_transformers')} | "
                            f"{found[0].name} |")
    found = latest(results, "strategies")
    if found:
        for ranks, entry in (_json(*found) or {}).get("results", {}).items():
            for pair, value in entry.get("ratios", {}).items():
                rows.append(f"| {ranks.replace('_', ' ')}: {pair} step time | {value:.3f} | "
                            f"{found[0].name} |")
    found = latest(results, "syncs")
    if found:
        syncs = _json(*found) or {}
        if "launches_per_block" in syncs:
            rows.append(f"| kernel launches per GPT block on a device (strict module count) | "
                        f"{syncs['launches_per_block']} | {found[0].name} |")
    return rows


def render(results: Path = RESULTS) -> str:
    parts = ["# Performance", "",
             "Generated by `python benchmarks/report.py` from the newest benchmark results in "
             "`benchmarks/results/`; do not edit by hand.", "",
             "## What to expect", "",
             "Ratios below 1 mean mpishard is faster. They come from 2-core x86_64 machines "
             "(the CPU model differs between dates: only ratios measured side by side in one "
             "run mean anything, and a ratio can move with the CPU).", ""]
    parts += _expect(results) + [""]
    parts += ["## Measuring it on your machine", "",
              "```",
              "make bench                                    # benchmarks/step.py: one process against PyTorch",
              ".venv/bin/python benchmarks/strategies.py     # DDP/ZeRO against torch DDP/FSDP2 at 2 and 4 ranks",
              ".venv/bin/python benchmarks/report.py --run --results benchmarks/results/$(date +%F)",
              "```", "",
              "Each script prints a readable table on stderr and one JSON line on stdout. For "
              "a comparison as you would run it, unset `OPENBLAS_CORETYPE` and "
              "`OPENBLAS_L2_SIZE` if your environment sets them (`python -m threadpoolctl -i "
              "numpy` names the kernel OpenBLAS then picks). Multi-rank runs use `OMP_NUM_THREADS=1`; 4 ranks "
              "on 2 cores oversubscribe. Every comparison runs both sides in one invocation, "
              "interleaved round by round, and reports medians.", ""]
    parts += ["## One training step, one process: mpishard against PyTorch eager", "",
              "GPT config S (vocab 256, block 128, 4 layers, 4 heads, width 256), batch 16, "
              "float32, forward + backward + AdamW; Llama config S is the same depth, heads and "
              "width with 2 key/value heads and a SwiGLU MLP of width 768, against "
              "transformers' `LlamaForCausalLM` (`benchmarks/step.py`).", ""]
    found = latest(results, "step")
    step = (_json(*found) if found else None) or {}
    rows = ["| BLAS threads | model | mpishard s/step | reference s/step | mpishard / reference | "
            "peak RSS mpishard / reference (MiB) |", "|---|---|---|---|---|---|"]
    for key, entry in step.get("results", {}).items():
        for model, ours, theirs, ratio in (
                ("GPT", "mpishard", "torch", "ratio_mpishard_over_torch"),
                ("Llama", "mpishard-llama", "torch-llama",
                 "ratio_llama_mpishard_over_transformers")):
            if ours not in entry:
                continue
            m, t = entry.get(ours, {}), entry.get(theirs, {})
            rows.append(f"| {key.split('_')[0]} | {model} | {m.get('median_step_s', '')} | "
                        f"{t.get('median_step_s', '-')} | {_ratio(entry, ratio)} | "
                        f"{m.get('peak_rss_mib', '')} / {t.get('peak_rss_mib', '-')} |")
    parts += rows + ["", f"({_where(found)})" if found else "(not run)", ""]
    for title, text, name, keep in SECTIONS:
        found = latest(results, name)
        table = _table(*found, keep) if found else "(not run)"
        if found and table == "(not run)":
            table = _scalars(*found)
        parts += [f"## {title}", "", text, "", table, ""]
        if found:
            parts += [f"({_where(found)})", ""]
    parts += ["## Earlier figures", "",
              "The dated figures and the notes that went with them, as each change measured "
              "them: [benchmarks/results/HISTORY.md](../benchmarks/results/HISTORY.md). See "
              "[performance-benchmarks.md](performance-benchmarks.md) for what each column "
              "means."]
    return "\n".join(parts) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(RESULTS),
                        help="where results are: a folder of dated folders (the newest result "
                             "of each benchmark is shown), or one dated folder (default "
                             "%(default)s); with --run, the folder to write")
    parser.add_argument("--run", action="store_true", help="run the benchmarks first")
    parser.add_argument("--only", help="comma-separated benchmarks to run")
    parser.add_argument("--out", default=str(ROOT / "docs" / "performance.md"))
    args = parser.parse_args(argv)
    results = Path(args.results)
    if args.run:
        run_all(results, args.only.split(",") if args.only else None)
        results = results.parent if results.parent.resolve() == RESULTS.resolve() else results
    Path(args.out).write_text(render(results))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Single-process training step: mpishard vs PyTorch eager, side by side.

    python benchmarks/step.py                 # GPT and Llama config S, 1 and 2 BLAS threads
    python benchmarks/step.py --rounds 5 --steps 6 --models llama
    python benchmarks/step.py --blas mkl      # mpishard on MKL's products only

Times a full step (forward, backward, AdamW) of GPT config S (vocab 256, block
128, 4 layers, 4 heads, width 256, batch 16, float32) against a PyTorch nanoGPT,
and of Llama config S (the same shape with 2 key/value heads and a SwiGLU MLP
of width 768) against ``transformers``' ``LlamaForCausalLM`` (eager attention),
the torch side when it is installed. mpishard runs with NumPy's BLAS and, where MKL
loads (``pip install mkl``), also with ``MPISHARD_BLAS=mkl`` (the ``-mkl`` rows; torch's
products are MKL's too). Each measurement runs in
a fresh worker process with the thread count fixed by environment variables
before NumPy/torch load; workers for mpishard and torch alternate round by
round so both see the same machine load. Prints progress on stderr and one
JSON line on stdout: median step seconds, tokens/s, peak RSS per
implementation and thread count, and the ratio mpishard / torch.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG_S = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256)
#: Llama config S: the same depth, heads and width, grouped-query attention with 2
#: key/value heads, SwiGLU width 768 (8C/3 rounded up to 256), untied head
LLAMA_S = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_kv_head=2, n_embd=256,
               intermediate_size=768)
BATCH = 16


def _mpishard_step_fn(seed: int, model_name: str = "gpt"):
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from mpishard.models import GPT, GPTConfig, Llama, LlamaConfig
    from mpishard.optim import AdamW

    shape = CONFIG_S if model_name == "gpt" else LLAMA_S
    model = (GPT(GPTConfig(**CONFIG_S), seed=seed) if model_name == "gpt"
             else Llama(LlamaConfig(**LLAMA_S), seed=seed))
    opt = AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    r = np.random.default_rng(seed)
    x = r.integers(0, shape["vocab_size"], (BATCH, shape["block_size"]))
    y = r.integers(0, shape["vocab_size"], (BATCH, shape["block_size"]))

    def step():
        _, loss = model(x, y)
        model.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()
    return step


def _torch_llama_step_fn(seed: int, threads: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    c = LLAMA_S
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=c["vocab_size"], hidden_size=c["n_embd"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["n_layer"], num_attention_heads=c["n_head"],
        num_key_value_heads=c["n_kv_head"], max_position_embeddings=c["block_size"],
        tie_word_embeddings=False, attn_implementation="eager"))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=3e-4)
    x = torch.randint(0, c["vocab_size"], (BATCH, c["block_size"]))
    y = torch.randint(0, c["vocab_size"], (BATCH, c["block_size"]))

    def step():
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()
    return step


def _torch_step_fn(seed: int, threads: int):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch

    from torch_nanogpt import GPT

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    cfg = argparse.Namespace(**CONFIG_S, bias=True)
    model = GPT(cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=3e-4)
    x = torch.randint(0, CONFIG_S["vocab_size"], (BATCH, CONFIG_S["block_size"]))
    y = torch.randint(0, CONFIG_S["vocab_size"], (BATCH, CONFIG_S["block_size"]))

    def step():
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()
    return step


def worker(impl: str, threads: int, steps: int, warmup: int) -> dict:
    impl = impl.removesuffix("-mkl")                   # MPISHARD_BLAS=mkl is in the env
    step = {"mpishard": lambda: _mpishard_step_fn(0),
            "torch": lambda: _torch_step_fn(0, threads),
            "mpishard-llama": lambda: _mpishard_step_fn(0, "llama"),
            "torch-llama": lambda: _torch_llama_step_fn(0, threads)}[impl]()
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"times": times, "peak_rss_mib": peak_kib / 1024}


def _run_worker(impl: str, threads: int, steps: int, warmup: int) -> dict:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    env["MPISHARD_BLAS"] = "mkl" if impl.endswith("-mkl") else "numpy"
    if impl.endswith("-mkl"):         # MKL's threads take the products; OpenBLAS's would
        env["OPENBLAS_NUM_THREADS"] = "1"                      # only spin against them
    cmd = [sys.executable, __file__, "--worker", impl, "--threads", str(threads),
           "--steps", str(steps), "--warmup", str(warmup)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _transformers_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("transformers") is not None


def _mkl_available() -> bool:
    """Whether MKL loads here (mpishard's ``MPISHARD_BLAS=mkl``), asked in a subprocess."""
    probe = ("import os; os.environ['MPISHARD_BLAS'] = 'mkl'; "
             "from mpishard.kernels.cpu.blas import mkl_library; mkl_library()")
    return subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode == 0


def _torch_available() -> bool:
    try:
        import importlib.util
        return importlib.util.find_spec("torch") is not None
    except Exception:
        return False


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated BLAS thread counts")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds per impl")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per round")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch side")
    parser.add_argument("--models", default="gpt,llama", help="gpt, llama or both")
    parser.add_argument("--blas", default="auto",
                        help="mpishard's BLAS: numpy, mkl, or auto (both when MKL loads)")
    parser.add_argument("--worker", choices=["mpishard", "torch", "mpishard-llama",
                                             "torch-llama", "mpishard-mkl",
                                             "mpishard-llama-mkl"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(args.worker, int(args.threads), args.steps, args.warmup)))
        return {}

    models = args.models.split(",")
    with_torch = not args.no_torch and _torch_available()
    impls = [i for m in models for i in ((["mpishard"] + (["torch"] if with_torch else []))
             if m == "gpt" else (["mpishard-llama"] + (["torch-llama"] if with_torch
                                                         and _transformers_available() else [])))]
    blas = {"auto": ["numpy"] + (["mkl"] if _mkl_available() else []),
            "numpy": ["numpy"], "mkl": ["mkl"]}[args.blas]
    impls = [v for i in impls for v in (
        [i] if i.startswith("torch") else [i] * ("numpy" in blas) + [i + "-mkl"] * ("mkl" in blas))]
    if not with_torch:
        print("torch not importable: timing mpishard alone "
              "(pip install torch==2.13.0 for the side-by-side)", file=sys.stderr)
    result = {"benchmark": "step", "config": "S", **CONFIG_S, "batch": BATCH,
              "dtype": "float32", "results": {}}
    for threads in [int(t) for t in args.threads.split(",")]:
        times = {impl: [] for impl in impls}
        rss = {impl: 0.0 for impl in impls}
        for rnd in range(args.rounds):
            order = impls if rnd % 2 == 0 else impls[::-1]
            for impl in order:
                out = _run_worker(impl, threads, args.steps, args.warmup)
                times[impl] += out["times"]
                rss[impl] = max(rss[impl], out["peak_rss_mib"])
                print(f"threads={threads} round {rnd + 1}/{args.rounds} {impl:8s} "
                      f"median {statistics.median(out['times']):.3f} s", file=sys.stderr)
        entry = {}
        for impl in impls:
            med = statistics.median(times[impl])
            entry[impl] = {"median_step_s": round(med, 4),
                           "tokens_per_s": round(BATCH * CONFIG_S["block_size"] / med, 1),
                           "peak_rss_mib": round(rss[impl], 1)}
        if "torch" in entry and "mpishard" in entry:
            entry["ratio_mpishard_over_torch"] = round(
                entry["mpishard"]["median_step_s"] / entry["torch"]["median_step_s"], 3)
        if "torch" in entry and "mpishard-mkl" in entry:
            entry["ratio_mpishard_mkl_over_torch"] = round(
                entry["mpishard-mkl"]["median_step_s"] / entry["torch"]["median_step_s"], 3)
        if "torch-llama" in entry and "mpishard-llama-mkl" in entry:
            entry["ratio_llama_mpishard_mkl_over_transformers"] = round(
                entry["mpishard-llama-mkl"]["median_step_s"]
                / entry["torch-llama"]["median_step_s"], 3)
        if "torch-llama" in entry and "mpishard-llama" in entry:
            entry["ratio_llama_mpishard_over_transformers"] = round(
                entry["mpishard-llama"]["median_step_s"] / entry["torch-llama"]["median_step_s"], 3)
        result["results"][f"{threads}_thread"] = entry
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""The models through the command: presets in estimate, a family alone, the Llama demo.

examples/llama_hf.sh runs end to end (a BPE trained on the built-in corpus,
ZeRO-3 on 4 ranks, export, generation by transformers), at a few steps.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"


from ckpt_scripts.common import run_mpishard as mpishard  # noqa: E402


def test_llama_8b_estimate_matches_the_hand_count():
    out = mpishard("estimate", "--preset", "llama3.1-8b", "--dp", "8", "--strategy", "zero3",
                   "--batch-size", "1")
    assert out.returncode == 0, out.stderr
    # docs/models.md: 2 x 128256 x 4096 + 32 x 218,112,000 + 4096
    hand = 2 * 128256 * 4096 + 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096
                                     + 2 * 4096) + 4096
    assert hand == 8_030_261_248
    assert f"{hand:,} parameters" in out.stdout
    state = float(re.search(r"model state ([\d.]+) MiB", out.stdout).group(1))
    want = hand * (4 + 4 + 8) / 8 / 2**20         # f32 params, grads, AdamW m and v over dp 8
    assert abs(state - want) <= 0.01 * want, (state, want)


def test_gpt2_xl_estimate_over_tp_and_pp():
    out = mpishard("estimate", "--preset", "gpt2-xl", "--tp", "4", "--pp", "2", "--dp", "1",
                   "--strategy", "zero1", "--batch-size", "1")
    assert out.returncode == 0, out.stderr
    assert "1,557,611,200 parameters" in out.stdout and "dp=1 x tp=4 x pp=2" in out.stdout
    assert re.search(r"params\s+[\d.]+ MiB", out.stdout)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_a_family_alone_trains_with_its_own_defaults(name):
    """``--model llama`` alone: Llama's [model] defaults (no biases), not GPT-2's; the
    refusals of what a family cannot do are in test_config_refusals.py."""
    out = mpishard("train", "--model", name, "--steps", "2", "--max-bytes", "20000",
                   "--eval-batches", "1", "--batch-size", "2", "--progress", "false")
    assert out.returncode == 0, out.stderr
    assert f"mpishard train: {name}" in out.stdout + out.stderr
    assert "after 2 steps" in out.stdout + out.stderr


@pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec next to python")
@pytest.mark.timeout(600)
def test_llama_hf_example_runs(tmp_path):
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHON=sys.executable, MPIEXEC=str(MPIEXEC), STEPS="4",
               MAX_BYTES="400000", PYTHONPATH=str(ROOT))
    for var in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        env.pop(var, None)
    out = subprocess.run(["bash", str(ROOT / "examples" / "llama_hf.sh"), str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=540, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "after 4 steps (zero3, 4 ranks)" in out.stdout
    assert re.search(r"LlamaForCausalLM with [\d,]+ parameters", out.stdout)
    assert "def main(" in out.stdout.split("LlamaForCausalLM with", 1)[1]
    assert (tmp_path / "hf" / "config.json").is_file()


def _losses(path) -> dict:
    import json
    return {r["step"]: r["loss"] for r in map(json.loads, open(path)) if "loss" in r}


def test_token_data_resume_continues_at_the_same_token(tmp_path):
    """Train on a token folder, stop at step 3, resume to 6: the same losses as one run
    of 6 steps (same batches, same token positions; float64, and a constant learning
    rate: the schedule's length is --steps)."""
    tok = tmp_path / "tok"
    out = mpishard("prepare", "default", tok, "--train-bpe", "300", "--max-bytes", "60000",
                   "--progress", "false")
    assert out.returncode == 0, out.stderr
    common = ["train", "--preset", "llama-tiny", "--n-layer", "1", "--block-size", "32",
              "--batch-size", "2", "--data", tok, "--dtype", "float64", "--eval-batches", "1",
              "--progress", "false", "--warmup-steps", "0", "--lr", "1e-3", "--min-lr", "1e-3"]
    whole = mpishard(*common, "--steps", "6", "--metrics", tmp_path / "whole.jsonl")
    assert whole.returncode == 0, whole.stderr
    first = mpishard(*common, "--steps", "3", "--checkpoint-dir", tmp_path / "ck",
                     "--metrics", tmp_path / "part.jsonl")
    assert first.returncode == 0, first.stderr
    second = mpishard(*common, "--steps", "6", "--checkpoint-dir", tmp_path / "ck",
                      "--resume", "true", "--metrics", tmp_path / "part.jsonl")
    assert second.returncode == 0, second.stderr
    want, got = _losses(tmp_path / "whole.jsonl"), _losses(tmp_path / "part.jsonl")
    assert sorted(got) == [1, 2, 3, 4, 5, 6] and got == want


def test_output_piped_into_head_is_no_crash():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(f"'{sys.executable}' -m mpishard estimate --preset gpt2 --dp 8 | head -1",
                         shell=True, env=env, capture_output=True, text=True, timeout=120)
    assert "parameters" in out.stdout and "Traceback" not in out.stderr, out.stderr

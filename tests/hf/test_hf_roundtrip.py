"""transformers -> `mpishard train --init-from` (4 ranks) -> `checkpoint export` -> transformers.

A random transformers model (GPT-2, Llama, Qwen2, Mixtral; vocabulary 260, so the built-in
byte corpus fits) is saved with its own ``save_pretrained``, fine-tuned for one step with
learning rate 0 under ZeRO-3 and under tp 2 x pp 2 (the Mixtral under tp 2 x ep 2)
(``mpiexec -n 4``), exported with
``mpishard checkpoint export CK OUT --format hf``, and loaded back by transformers:
no missing or unexpected keys are logged and the logits equal the original's
exactly (``torch.equal``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_hf import batch, load_quietly, make_hf  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec next to python")]


from ckpt_scripts.common import run_mpishard  # noqa: E402


def mpishard(*args, n=None, timeout=400):
    return run_mpishard(*args, n=n, timeout=timeout)


@pytest.mark.parametrize("kind, layout", [
    ("gpt2", ["--strategy", "zero3"]),
    ("gpt2", ["--tp", "2", "--pp", "2", "--strategy", "ddp"]),
    ("llama", ["--strategy", "zero3"]),
    ("llama", ["--tp", "2", "--pp", "2", "--strategy", "zero1"]),
    ("qwen2", ["--tp", "2", "--strategy", "zero3"]),
    ("mixtral", ["--ep", "2", "--tp", "2", "--strategy", "zero1"]),
])
def test_init_from_train_export_roundtrip(kind, layout, tmp_path):
    original = make_hf(kind, tmp_path / "in", vocab=260)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    trained = mpishard("train", "--init-from", str(tmp_path / "in"), "--lr", "0", "--min-lr",
                       "0", "--steps", "1", *layout, "--checkpoint-dir", str(ckpt),
                       "--max-bytes", "20000", "--eval-batches", "1", "--batch-size", "2",
                       "--progress", "false", n=4)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert "the [model] shape comes from its config.json" in trained.stdout + trained.stderr
    exported = mpishard("checkpoint", "export", str(ckpt), str(out), "--format", "hf")
    assert exported.returncode == 0, exported.stdout + exported.stderr
    back, _ = load_quietly(out, **({"experts_implementation": "eager"} if kind == "mixtral"
                                   else {}))
    idx, _ = batch(260)
    with torch.no_grad():
        assert torch.equal(back(torch.tensor(idx)).logits, original(torch.tensor(idx)).logits)
    for name, p in original.state_dict().items():
        assert torch.equal(back.state_dict()[name], p), name


def test_init_from_refuses_what_it_cannot_reproduce(tmp_path):
    make_hf("llama", tmp_path / "in", vocab=260)
    from test_hf import edit_config

    edit_config(tmp_path / "in", rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                  "rope_theta": 1e4})
    out = mpishard("train", "--init-from", str(tmp_path / "in"), "--steps", "1",
                   "--progress", "false", timeout=120)
    assert out.returncode == 2
    assert 'rope_parameters.rope_type="yarn" is not implemented' in out.stderr
    assert np.all([not p.name.startswith("step-") for p in tmp_path.iterdir()])


def test_a_llama_keeps_its_context(tmp_path):
    """A Llama of 128 positions (Llama 3 scaling from 64) trained at block size 64 exports
    max_position_embeddings 128 and its rope scaling unchanged; transformers loads it
    with no warning and equal logits. Without --block-size it trains at the folder's
    128 positions."""
    import json

    original = make_hf("llama3", tmp_path / "in", vocab=260)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    trained = mpishard("train", "--init-from", str(tmp_path / "in"), "--block-size", "64",
                       "--lr", "0", "--min-lr", "0", "--steps", "1", "--checkpoint-dir",
                       str(ckpt), "--max-bytes", "20000", "--eval-batches", "1",
                       "--batch-size", "2", "--progress", "false")
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert "sequences of 64 of its 128 positions" in trained.stdout + trained.stderr
    exported = mpishard("checkpoint", "export", str(ckpt), str(out), "--format", "hf")
    assert exported.returncode == 0, exported.stdout + exported.stderr
    written = json.loads((out / "config.json").read_text())
    assert written["max_position_embeddings"] == 128
    back, log = load_quietly(out)
    assert back.config.rope_parameters == original.config.rope_parameters, log
    assert back.config.max_position_embeddings == 128 and not log.strip(), log
    idx, _ = batch(260)
    with torch.no_grad():
        assert torch.equal(back(torch.tensor(idx)).logits, original(torch.tensor(idx)).logits)
    plan = mpishard("train", "--init-from", str(tmp_path / "in"), "--dry-run", "true",
                    "--max-bytes", "20000")
    assert plan.returncode == 0, plan.stderr
    assert "sequences of" not in plan.stdout + plan.stderr      # the folder's 128


@pytest.mark.parametrize("kind, flags, message", [
    ("llama", ["--n-layer", "4"], "its config.json gives n_layer = 2 (num_hidden_layers); "
                                  "--n-layer 4 contradicts it: leave --n-layer out"),
    ("llama", ["--model", "gpt"], "gives name = 'llama'; --model 'gpt' contradicts it"),
    ("gpt2", ["--block-size", "16"], "gives block_size = 32 (n_positions)"),
    ("llama", ["--block-size", "128"], "block_size = 128 is beyond the 64 positions"),
    ("llama3", ["--block-size", "512"], "block_size = 512 is beyond the 128 positions"),
    ("gpt2", ["--preset", "gpt2"], "--preset gpt2 contradicts it: leave --preset out"),
])
def test_a_flag_that_contradicts_the_folder_is_refused(kind, flags, message, tmp_path):
    make_hf(kind, tmp_path / "in", vocab=260)
    out = mpishard("train", "--init-from", str(tmp_path / "in"), *flags, "--steps", "1",
                   "--dry-run", "true", timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and message in lines[0], out.stderr


def test_llama3_scaling_reaches_past_the_positions(tmp_path):
    """Llama 3 scaling (factor 4 of 64 original positions) takes 256 of 128 positions."""
    make_hf("llama3", tmp_path / "in", vocab=260)
    out = mpishard("train", "--init-from", str(tmp_path / "in"), "--block-size", "256",
                   "--steps", "1", "--dry-run", "true", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "sequences of 256 of its 128 positions" in out.stdout + out.stderr


def test_a_mixtral_folder_takes_its_loss_weights_from_the_flags(tmp_path):
    """router_aux_loss_coef is a weight of the training loss, not the model's shape:
    --moe-aux-coef / --moe-z-coef 0 with --init-from is what pipeline stages and
    activation checkpointing need, and it trains (the folder's weights load)."""
    make_hf("mixtral", tmp_path / "in", vocab=260)
    args = ["train", "--init-from", str(tmp_path / "in"), "--steps", "1", "--max-bytes",
            "20000", "--eval-batches", "1", "--batch-size", "2", "--progress", "false"]
    refused = mpishard(*args, "--activation-checkpointing", "full", "--dry-run", "true",
                       timeout=120)
    assert refused.returncode == 2 and "set moe_aux_coef and moe_z_coef to 0" in \
        refused.stderr, refused.stderr
    zero = ["--moe-aux-coef", "0", "--moe-z-coef", "0"]
    out = mpishard(*args, "--activation-checkpointing", "full", *zero, "--dry-run", "true",
                   timeout=120)
    assert out.returncode == 0, out.stderr
    out = mpishard(*args, "--pp", "2", *zero, "--checkpoint-dir", tmp_path / "ck", n=2,
                   timeout=200)
    assert out.returncode == 0, out.stdout + out.stderr
    from mpishard.checkpoint.reader import verify_checkpoint
    from mpishard.checkpoint.locate import resolve_checkpoint

    saved = verify_checkpoint(resolve_checkpoint(tmp_path / "ck")).extra["config"]["model"]
    assert saved["moe_aux_coef"] == 0.0 and saved["moe_experts"] == 4

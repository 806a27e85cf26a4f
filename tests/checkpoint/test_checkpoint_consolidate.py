"""The consolidated export: nanoGPT names for PyTorch, streamed in bounded memory; import
from it (fine-tuning); the ``mpishard checkpoint`` commands."""
import argparse
import importlib.util
import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from ckpt_scripts.common import ROOT, SCRIPTS, build, clean_env
from mpishard.autodiff import no_grad
from mpishard.checkpoint import (CheckpointError, consolidate, load_consolidated,
                                 save_checkpoint)
from mpishard.cli.checkpoint import add_checkpoint_commands
from mpishard.comm import Communicator, Mesh
from mpishard.models import GPT, GPTConfig
from mpishard.nn import Constant, Module, Parameter
from mpishard.parallel import DataParallel
from parity import make_optimizer

pytestmark = pytest.mark.timeout(120)
CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=12)


def self_comm():
    return Communicator(MPI.COMM_SELF.Dup(), "self", _owned=True)


def trained_checkpoint(root, dtype="float64"):
    """A ZeRO-3 GPT after two AdamW steps, saved at step 2; returns the strategy."""
    strategy = build("zero3", self_comm(), dtype, cfg=CFG)
    opt = make_optimizer(strategy.parameters())
    for step in range(2):
        x = np.random.default_rng(step).integers(0, CFG.vocab_size, (2, 8))
        _, loss = strategy(x, x)
        loss.backward()
        strategy.step(opt)
    save_checkpoint(root, 2, strategy, opt)
    return strategy


def fixed_batch():
    r = np.random.default_rng(99)
    return r.integers(0, CFG.vocab_size, (3, 8)), r.integers(0, CFG.vocab_size, (3, 8))


def test_consolidated_file_loads_into_pytorch_nanogpt(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    spec = importlib.util.spec_from_file_location("torch_nanogpt",
                                                  ROOT / "benchmarks" / "torch_nanogpt.py")
    torch_nanogpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(torch_nanogpt)
    strategy = trained_checkpoint(tmp_path / "ckpt")
    out = consolidate(tmp_path / "ckpt", tmp_path / "model.safetensors")
    x, y = fixed_batch()
    strategy.eval()
    with no_grad():
        ours = strategy(x, y)[1].item()
    model = torch_nanogpt.GPT(SimpleNamespace(**{k: getattr(CFG, k) for k in (
        "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "bias")})).double()
    state = load_file(str(out))
    assert "lm_head.weight" in state and state["lm_head.weight"].shape == (37, 12)
    assert state["transformer.h.0.mlp.c_fc.weight"].shape == (48, 12)      # [out, in]
    model.load_state_dict(state)   # strict: every name present, none extra
    with torch.no_grad():
        theirs = model(torch.from_numpy(x), torch.from_numpy(y))[1].item()
    assert abs(ours - theirs) <= 1e-12 * abs(ours), (ours, theirs)


def test_import_from_a_consolidated_file(tmp_path):
    trained = trained_checkpoint(tmp_path / "ckpt", "float32")
    out = consolidate(tmp_path / "ckpt", tmp_path / "model.safetensors")
    expected = trained.gather_full_params()
    sharded = build("zero3", self_comm(), "float32", seed=7, cfg=CFG)
    load_consolidated(out, sharded)
    plain = GPT(CFG, seed=7)
    load_consolidated(out, plain)
    for name, value in expected.items():
        assert np.array_equal(sharded.gather_full_params()[name], value), name
        assert np.array_equal(dict(plain.named_parameters())[name].data, value), name
    other = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=1, n_head=2, n_embd=12))
    with pytest.raises(CheckpointError, match="transformer.h.1.ln_1.bias") as info:
        load_consolidated(out, other)
    assert info.value.rule == "mismatch"
    wider = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16))
    with pytest.raises(CheckpointError) as info:
        load_consolidated(out, wider)
    assert info.value.rule == "shape" and "transformer.wte.weight" in str(info.value)


class Wide(Module):
    """Many 1 MiB parameters: a model much larger than its largest tensor."""

    def __init__(self, n: int):
        super().__init__()
        for i in range(n):
            setattr(self, f"w{i}", Parameter((512, 512), init=Constant(float(i))))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_consolidate_streams_in_bounded_memory(tmp_path):
    from mpishard.nn import materialize

    n, largest = 120, 512 * 512 * 4
    strategy = DataParallel(materialize(Wide(n), seed=0), Mesh(self_comm()))
    save_checkpoint(tmp_path / "ckpt", 1, strategy)
    del strategy
    out = tmp_path / "wide.safetensors"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "consolidate_rss.py"),
                           str(tmp_path / "ckpt"), str(out)], env=clean_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    limit = 2 * largest + 100 * 2**20
    total = n * largest
    assert total > limit
    assert not report["mpi"]              # the export does not start MPI
    assert report["peak_kib"] * 1024 < limit, (report, limit)
    from safetensors import safe_open
    with safe_open(str(out), framework="np") as f:
        assert len(f.keys()) == n
        assert np.all(f.get_tensor("w77") == 77.0)


def test_checkpoint_commands(tmp_path, capsys):
    trained_checkpoint(tmp_path / "ckpt", "float32")
    parser = argparse.ArgumentParser(prog="mpishard")
    add_checkpoint_commands(parser.add_subparsers(dest="command", required=True))

    def run(*argv):
        args = parser.parse_args(list(argv))
        return args.func(args), capsys.readouterr()

    rc, out = run("checkpoint", "inspect", str(tmp_path / "ckpt"))
    assert rc == 0, out.err
    assert "(step 2)" in out.out and "ZeRO stage 3, world 1" in out.out
    assert "transformer.h.1.mlp.c_proj.weight" in out.out and "12x48" in out.out
    assert "alias       lm_head.weight -> transformer.wte.weight" in out.out
    assert "integrity   ok" in out.out
    rc, out = run("checkpoint", "consolidate", str(tmp_path / "ckpt"),
                  str(tmp_path / "out.safetensors"))
    assert rc == 0 and (tmp_path / "out.safetensors").exists()
    shard = tmp_path / "ckpt" / "step-2" / "rank-0.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    rc, out = run("checkpoint", "inspect", str(tmp_path / "ckpt"))
    assert rc == 1 and f"integrity   FAILED: {shard}: sha256:" in out.out
    rc, out = run("checkpoint", "consolidate", str(tmp_path / "ckpt"),
                  str(tmp_path / "bad.safetensors"))
    assert rc == 2 and out.err.startswith(f"mpishard: error: {shard}: sha256:")
    assert not (tmp_path / "bad.safetensors").exists()
    assert not (tmp_path / "bad.safetensors.tmp").exists()
    rc, out = run("checkpoint", "inspect", str(tmp_path / "nowhere"))
    assert rc == 2 and "no-checkpoint" in out.err


@pytest.mark.parametrize("argv", [
    ("consolidate", "ckpt", "ckpt/step-2/rank-0.safetensors"),
    ("consolidate", "ckpt/step-1", "ckpt/step-2/rank-0.safetensors"),
    ("export", "--format", "safetensors", "ckpt/step-2", "ckpt/step-2/manifest.json"),
    ("export", "ckpt", "ckpt/step-2"),
    ("export", "ckpt", "ckpt/step-1/hf"),
])
def test_an_output_inside_a_checkpoint_is_refused(argv, tmp_path, capsys, monkeypatch):
    """An output in a step folder of the run being read (the one read, or another) would
    write over a checkpoint: one line, status 2, every file as it was."""
    strategy = trained_checkpoint(tmp_path / "ckpt", "float32")
    save_checkpoint(tmp_path / "ckpt", 1, strategy, make_optimizer(strategy.parameters()))
    before = {p: p.read_bytes() for p in (tmp_path / "ckpt").rglob("*") if p.is_file()}
    parser = argparse.ArgumentParser(prog="mpishard")
    add_checkpoint_commands(parser.add_subparsers(dest="command", required=True))
    monkeypatch.chdir(tmp_path)
    args = parser.parse_args(["checkpoint", *argv])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mpishard: error: {argv[-1]} ") and err.count("\n") == 1, err
    assert "a step folder of the checkpoint being read" in err and "pass an output " \
        "outside ckpt/step-" in err
    assert {p: p.read_bytes() for p in (tmp_path / "ckpt").rglob("*") if p.is_file()} == before

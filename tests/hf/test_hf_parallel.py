"""Hugging Face weights onto every layout, and back, in-process under MPI.

Folders written by transformers (GPT-2; Llama with grouped-query attention and an
untied head; a tied Llama with Llama 3 RoPE scaling) are loaded with
``load_pretrained`` into ParallelModel layouts -- DDP and ZeRO-1/2/3 over dp, tensor
parallel with the key/value heads split (tp 2) and kept whole (tp 4), pipelines (the
tied Llama's token table on both end stages), compositions, mixed precision -- and
``gather_full_params()`` equals the files' tensors exactly (GPT-2's Conv1D transposed),
each rank having read exactly the elements of its own pieces.
The loss equals the one-process model's; ``save_pretrained`` of the strategy
(collective, streamed to rank 0) writes the same tensors back. Bad folders raise the
same CheckpointError on every rank.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from mpishard import hf
from mpishard.checkpoint import CheckpointError
from mpishard.comm import Mesh
from mpishard.hf.files import HFWeights
from mpishard.parallel import ParallelModel
from parity import sub_world, wait_for_every_rank

pytestmark = pytest.mark.mpi
CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight",
          ".mlp.c_proj.weight")
LAYOUTS = [  # (world size, dp, tp, pp, strategy, precision)
    (4, 4, 1, 1, "ddp", None), (4, 4, 1, 1, "zero3", None), (4, 2, 2, 1, "zero1", None),
    (4, 1, 4, 1, "zero3", None), (4, 2, 1, 2, "ddp", None), (4, 1, 2, 2, "zero3", None),
    (4, 2, 1, 2, "zero2", None), (4, 4, 1, 1, "zero3", "bfloat16"), (3, 3, 1, 1, "zero3", None),
    (2, 1, 2, 1, "ddp", None), (1, 1, 1, 1, "zero3", None)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """transformers-written folders, made on rank 0 and shared by path."""
    made = None
    if MPI.COMM_WORLD.rank == 0:
        try:
            from test_hf import edit_config, make_hf

            base = tmp_path_factory.mktemp("hf_parallel")
            made = {"base": str(base)}
            for kind in ("gpt2", "llama", "llama3"):
                make_hf(kind, base / kind, vocab=37)
                made[kind] = str(base / kind)
            shutil.copytree(base / "gpt2", base / "bad")
            edit_config(base / "bad", n_positions=16)
            made["bad"] = str(base / "bad")
        except BaseException as exc:  # noqa: BLE001 -- shared, so no rank waits
            made = {"error": repr(exc)}
    wait_for_every_rank()  # asleep while rank 0 builds, not spinning in the bcast
    made = MPI.COMM_WORLD.bcast(made, root=0)
    if "error" in made:
        pytest.skip(f"could not build the transformers folders: {made['error']}")
    return {k: Path(v) for k, v in made.items()}


def file_params(folder: Path) -> dict:
    """mpishard name -> the file's tensor in mpishard's layout, float64."""
    from safetensors.numpy import load_file

    out = {}
    for key, value in load_file(folder / "model.safetensors").items():
        value = value.astype(np.float64)
        out[key] = np.ascontiguousarray(value.T) if key.endswith(CONV1D) else value
    return out


def batch(vocab: int, seed: int = 3):
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (12, 16)), rng.integers(0, vocab, (12, 16))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "-".join(map(str, l)))
@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama3"])
def test_load_and_save_on_every_layout(kind, layout, folders, monkeypatch):
    size, dp, tp, pp, strategy, precision = layout
    if size > MPI.COMM_WORLD.size:
        pytest.skip(f"needs {size} ranks")
    with sub_world(size) as comm:
        if comm is None:
            return
        folder = folders[kind]
        cfg = hf.config_from_pretrained(folder)
        one = hf.from_pretrained(folder, dtype="float64")
        cls = type(one)
        run = ParallelModel(cls(cfg, dtype="float64", seed=9, materialize_now=False),
                            Mesh(comm, dp=dp, tp=tp, pp=pp), strategy=strategy,
                            precision=precision)
        read = []
        real = HFWeights.read
        monkeypatch.setattr(HFWeights, "read", lambda self, key, first, count: (
            read.append(count), real(self, key, first, count))[1])
        hf.load_pretrained(run.strategy, folder)
        monkeypatch.undo()
        # each rank read exactly the elements of its pieces, no more
        assert sum(read) == sum(p.size for p in run.strategy.pieces() if p.kind == "param")
        full, want = run.gather_full_params(), file_params(folder)
        assert set(full) == set(want)
        for name, value in full.items():
            assert np.array_equal(value, want[name]), name
        x, y = batch(cfg.vocab_size)
        share = x.shape[0] // dp
        rows = slice(run.mesh.dp.rank * share, (run.mesh.dp.rank + 1) * share)
        loss = np.array([run.eval_step(x[rows], y[rows])])
        run.mesh.dp.all_reduce(loss, op="avg")
        _, ref = one(x, y)
        tol = 1e-2 if precision else 1e-12
        assert abs(loss[0] - float(ref.data)) <= tol * abs(float(ref.data)), (loss, ref.data)
        out = folders["base"] / f"out-{kind}-{'-'.join(map(str, layout))}"
        limit = 20_000 if strategy == "zero3" else 5 * 2**30
        assert hf.save_pretrained(run, out, max_shard_bytes=limit) == out
        if comm.rank == 0:
            assert (out / "model.safetensors.index.json").is_file() == (limit == 20_000)
            back = hf.from_pretrained(out, dtype="float64")
            assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float64"
            for name, p in back.named_parameters():
                assert np.array_equal(p.data, want[name]), name
        comm.barrier()


def test_refusals_are_agreed_on_every_rank(folders):
    """A shape mismatch, a config that is not the model's, a missing folder: the same
    CheckpointError on every rank, nothing loaded."""
    world = MPI.COMM_WORLD
    with sub_world(world.size) as comm:
        bad = hf.config_from_pretrained(folders["bad"])            # n_positions 16, file 32
        cls = type(hf.from_pretrained(folders["gpt2"]))
        run = ParallelModel(cls(bad, materialize_now=False), Mesh(comm), strategy="zero3")
        with pytest.raises(CheckpointError, match=r"transformer.wpe.weight has shape \[32, 32\]"
                                                  r" in model.safetensors, the model needs "
                                                  r"\[16, 32\]") as err:
            hf.load_pretrained(run.strategy, folders["bad"])
        if comm.size > 1:
            assert "failed on" in str(err.value)
        with pytest.raises(CheckpointError, match="n_positions=32, but the model has "
                                                  "block_size=16"):
            hf.load_pretrained(run.strategy, folders["gpt2"])
        with pytest.raises(CheckpointError, match="missing-file"):
            hf.load_pretrained(run.strategy, folders["base"] / "nowhere")


def test_failed_save_writes_nothing_and_raises_everywhere(folders, monkeypatch):
    """The disk fills up on rank 0 mid-export: every rank raises, no folder appears."""
    from mpishard.checkpoint.shards import SafetensorsWriter
    from mpishard.models import Llama

    with sub_world(MPI.COMM_WORLD.size) as comm:
        cfg = hf.config_from_pretrained(folders["llama"])
        run = ParallelModel(Llama(cfg, materialize_now=False), Mesh(comm), strategy="zero3")
        hf.load_pretrained(run.strategy, folders["llama"])
        calls, real = [], SafetensorsWriter.write

        def failing(self, key, array):
            calls.append(key)
            if len(calls) == 3:
                raise OSError(28, "No space left on device")
            return real(self, key, array)

        monkeypatch.setattr(SafetensorsWriter, "write", failing)
        out = folders["base"] / "failed"
        with pytest.raises(CheckpointError, match="No space left on device"):
            hf.save_pretrained(run, out, max_shard_bytes=10_000)
        comm.barrier()
        assert not out.exists() and not list(folders["base"].glob(".failed.tmp-*"))

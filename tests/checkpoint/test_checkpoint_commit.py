"""The commit protocol on one rank: leftovers, replacement, latest, keep_last, extra state."""
import json
import os
import signal

import numpy as np
import pytest
from mpi4py import MPI

from ckpt_scripts.common import build
from mpishard.checkpoint import (INTERRUPT_TOO, CheckpointError, StopSignals, generator_state,
                                 latest_checkpoint, load_checkpoint, load_module_rng_states,
                                 module_rng_states, resolve_checkpoint,
                                 save_checkpoint, set_generator_state, verify_checkpoint)
from mpishard.comm import Communicator
from mpishard.models import GPT, GPTConfig
from parity import make_optimizer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def model():
    comm = Communicator(MPI.COMM_SELF.Dup(), "self", _owned=True)
    strategy = build("zero3", comm, "float32")
    return strategy, make_optimizer(strategy.parameters())


def _set_params(strategy, value: float):
    for unit in strategy.units:
        unit.target.data[...] = value


def test_layout_on_disk(tmp_path, model):
    strategy, opt = model
    path = save_checkpoint(tmp_path, 7, strategy, opt, extra_state={"data": {"index": 3}})
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-7"]
    assert sorted(os.listdir(path)) == ["manifest.json", "rank-0.safetensors"]
    assert (tmp_path / "latest").read_text() == "step-7\n"
    raw = (path / "manifest.json").read_bytes()
    assert raw.startswith(b'{"sha256":"') and raw.endswith(b"}\n")
    body = json.loads(raw)["manifest"]
    assert body["step"] == 7 and body["format_version"] == 1
    assert body["extra"] == {"data": {"index": 3}}
    assert body["strategy"] == {"name": "ZeRO", "stage": 3, "steps": 0, "skipped_steps": 0,
                                "precision": {"compute_dtype": "float32",
                                              "loss_scale": {"scale": 1.0, "clean_steps": 0,
                                                             "dynamic": False}}}
    assert body["optimizer"]["type"] == "AdamW"
    assert body["aliases"] == {"lm_head.weight": "transformer.wte.weight"}
    names = [(t["name"], t["kind"]) for t in body["tensors"]]
    assert names[:3] == [("transformer.wte.weight", "param"),
                         ("transformer.wte.weight", "exp_avg"),
                         ("transformer.wte.weight", "exp_avg_sq")]
    # the shard opens with the safetensors library itself
    from safetensors import safe_open
    with safe_open(str(path / "rank-0.safetensors"), framework="np") as f:
        keys = list(f.keys())
        assert "transformer.wte.weight::param::0" in keys
        assert f.get_tensor("transformer.wte.weight::param::0").shape == (370,)


def test_leftover_tmp_of_a_killed_save_is_replaced(tmp_path, model):
    strategy, opt = model
    save_checkpoint(tmp_path, 1, strategy, opt)
    stale = tmp_path / "step-2.tmp"
    stale.mkdir()
    (stale / "rank-0.safetensors").write_bytes(b"half a file")
    (tmp_path / "step-9.tmp").mkdir()
    (tmp_path / "latest.tmp").write_text("step-9\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-1"   # .tmp never counts
    save_checkpoint(tmp_path, 2, strategy, opt)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-1", "step-2"]
    assert verify_checkpoint(tmp_path).step == 2


def test_saving_an_existing_step_replaces_it(tmp_path, model):
    strategy, opt = model
    _set_params(strategy, 1.0)
    save_checkpoint(tmp_path, 3, strategy, opt)
    _set_params(strategy, 2.0)
    save_checkpoint(tmp_path, 3, strategy, opt)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-3"]
    fresh = build("zero3", strategy.dp, "float32", seed=4)
    load_checkpoint(tmp_path, fresh)
    assert np.all(fresh.units[0].target.data[:10] == 2.0)


def test_a_crash_while_replacing_leaves_the_old_step_findable(tmp_path, model):
    strategy, opt = model
    save_checkpoint(tmp_path, 4, strategy, opt)
    os.rename(tmp_path / "step-4", tmp_path / "step-4.old")   # killed between the renames
    assert latest_checkpoint(tmp_path) == tmp_path / "step-4.old"
    assert verify_checkpoint(tmp_path).step == 4
    save_checkpoint(tmp_path, 4, strategy, opt)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-4"]


def test_latest_is_authoritative_and_falls_back_when_dangling(tmp_path, model):
    strategy, opt = model
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, strategy, opt)
    (tmp_path / "latest").write_text("step-2\n")       # e.g. resumed from step 2 on purpose
    assert latest_checkpoint(tmp_path) == tmp_path / "step-2"
    (tmp_path / "latest").write_text("step-8\n")       # names a step that is gone
    assert latest_checkpoint(tmp_path) == tmp_path / "step-3"
    (tmp_path / "latest").unlink()
    (tmp_path / "step-5").mkdir()                      # no manifest: not complete
    assert latest_checkpoint(tmp_path) == tmp_path / "step-3"
    assert resolve_checkpoint(tmp_path / "step-1") == tmp_path / "step-1"
    with pytest.raises(CheckpointError) as info:
        resolve_checkpoint(tmp_path / "nothing-here")
    assert info.value.rule == "no-checkpoint" and "nothing-here" in str(info.value)
    assert latest_checkpoint(tmp_path / "nothing-here") is None


def test_keep_last_keeps_the_newest(tmp_path, model):
    strategy, opt = model
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, strategy, opt, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-4", "step-5"]
    # a run resumed from step 2 writes step 3: the newest (just written) is kept too
    save_checkpoint(tmp_path, 3, strategy, opt, keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-3", "step-5"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-3"


def test_bad_arguments_raise_before_anything_is_written(tmp_path, model):
    strategy, opt = model
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        save_checkpoint(tmp_path, -1, strategy, opt)
    with pytest.raises(ValueError, match="keep_last must be None or an int >= 1"):
        save_checkpoint(tmp_path, 1, strategy, opt, keep_last=0)
    with pytest.raises(CheckpointError, match="extra_state is not JSON-able") as info:
        save_checkpoint(tmp_path, 1, strategy, opt, extra_state={"rng": np.random.default_rng()})
    assert info.value.failures == {0: info.value.failures[0]}
    assert not (tmp_path / "step-1").exists() and not (tmp_path / "step-1.tmp").exists()


def test_generator_states_round_trip_through_json(tmp_path):
    gen = np.random.default_rng(42)
    gen.random(5)
    state = json.loads(json.dumps(generator_state(gen)))
    expected = gen.random(3)
    other = np.random.default_rng(0)
    set_generator_state(other, state)
    assert np.array_equal(other.random(3), expected)
    with pytest.raises(ValueError, match="not a PCG64 state"):
        set_generator_state(other, {"bit_generator": "MT19937"})
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=1, n_embd=4,
                          dropout=0.1), seed=1)
    states = json.loads(json.dumps(module_rng_states(model)))
    assert len(states) == 4  # drop, attn and resid dropout, mlp dropout
    x = np.random.default_rng(0).integers(0, 11, (2, 8))
    first = model(x, x)[1].item()
    load_module_rng_states(model, states)
    assert model(x, x)[1].item() == first
    with pytest.raises(ValueError, match="no saved generator state for modules"):
        load_module_rng_states(model, {})
    world = Communicator(MPI.COMM_SELF.Dup(), "self", _owned=True)
    assert module_rng_states(model, world) == module_rng_states(model)


def test_stop_signals_set_a_flag_and_restore_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    world = Communicator(MPI.COMM_SELF.Dup(), "self", _owned=True)
    with StopSignals() as stop:
        assert not stop.requested and not stop.should_stop(world)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested and stop.received == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == "SIGUSR1" and stop.should_stop(world)
    assert signal.getsignal(signal.SIGUSR1) is before


def test_ctrl_c_is_caught_once_when_asked_for_and_reads_as_interrupted():
    world = Communicator(MPI.COMM_SELF.Dup(), "self", _owned=True)
    with StopSignals() as stop:                      # Slurm's signals only: Ctrl-C is not
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with StopSignals(INTERRUPT_TOO) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == "SIGINT" and stop.should_stop(world) and stop.interrupted
        with pytest.raises(KeyboardInterrupt):       # a second Ctrl-C does not wait
            os.kill(os.getpid(), signal.SIGINT)
    with StopSignals(INTERRUPT_TOO) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.should_stop(world) and not stop.interrupted
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_resume_tries_latest_first_then_the_highest_steps(tmp_path):
    from mpishard.checkpoint.locate import resume_candidates
    from mpishard.checkpoint.recover import set_aside

    for step in (2, 4, 6):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / "manifest.json").write_text("{}")
    (tmp_path / "step-8").mkdir()                                   # no manifest: incomplete
    (tmp_path / "latest").write_text("step-4\n")
    assert [p.name for p in resume_candidates(tmp_path)] == ["step-4", "step-6", "step-2"]
    assert set_aside(tmp_path / "step-4").name == "step-4.damaged"
    (tmp_path / "step-4").mkdir()
    assert set_aside(tmp_path / "step-4").name == "step-4.damaged-2"
    assert [p.name for p in resume_candidates(tmp_path)] == ["step-6", "step-2"]
    assert resume_candidates(tmp_path / "none") == []


def test_load_newest_valid_skips_damage_but_not_a_checkpoint_of_another_model(tmp_path, model):
    from mpishard.checkpoint import load_newest_valid
    from mpishard.models import GPTConfig

    strategy, opt = model
    _set_params(strategy, 2.0)
    save_checkpoint(tmp_path, 2, strategy, opt)
    _set_params(strategy, 4.0)
    shard = save_checkpoint(tmp_path, 4, strategy, opt) / "rank-0.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])
    _set_params(strategy, 0.0)
    extra, step_dir, skipped = load_newest_valid(tmp_path, strategy, opt)
    assert step_dir.name == "step-2" and strategy.steps == 0
    assert all(np.all(u.target.data == 2.0) for u in strategy.units)
    assert [(a.name, b.name, e.rule) for a, b, e in skipped] == \
        [("step-4", "step-4.damaged", "truncated")]
    other = build("zero3", strategy.mesh.world, "float32",
                  cfg=GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=12))
    with pytest.raises(CheckpointError, match="does not fit this model") as err:
        load_newest_valid(tmp_path, other, make_optimizer(other.parameters()))
    assert err.value.rule == "mismatch" and (tmp_path / "step-2").is_dir()
    with pytest.raises(CheckpointError) as err:
        load_newest_valid(tmp_path / "none", strategy, opt)
    assert err.value.rule == "no-checkpoint"
    shard = tmp_path / "step-2" / "rank-0.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])
    (tmp_path / "step-4.damaged").rename(tmp_path / "step-4")
    with pytest.raises(CheckpointError, match="step-4") as err:     # none verifies
        load_newest_valid(tmp_path, strategy, opt)
    assert err.value.rule == "truncated" and (tmp_path / "step-2").is_dir() \
        and (tmp_path / "step-4").is_dir()

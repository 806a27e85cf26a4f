"""Save and load across strategies and world sizes: bit-identical, collective errors.

MPI tests on sub-communicators of sizes 1-4 (see parity.sub_world), so the
4-rank leg covers saving at 4 ranks under ZeRO-3 and loading at 2 (ZeRO-2),
1 (no sharding) and 3 (ZeRO-3); the serial leg runs the size-1 cases.
"""
import numpy as np
import pytest
from mpi4py import MPI

from ckpt_scripts.common import build, full_tensors, shared_tmp
from mpishard.comm import Communicator
from mpishard.checkpoint import (CheckpointError, ShardReader, latest_checkpoint,
                                 load_checkpoint, read_manifest, save_checkpoint,
                                 verify_checkpoint)
from mpishard.optim import AdamW
from mpishard.parallel import load_pieces, pieces_of
from parity import batch, make_optimizer, max_rel_err, sub_world

KINDS = ["ddp", "zero1", "zero2", "zero3"]


def _train(strategy, opt, dp_rank: int, first: int, steps: int) -> list:
    losses = []
    for step in range(first, first + steps):
        _, loss = strategy(*batch(step, 0, dp_rank))
        loss.backward()
        strategy.step(opt)
        buf = np.array([loss.item()])
        strategy.dp.all_reduce(buf, op="avg")
        losses.append(buf[0])
    return losses


def _assert_same(saved: dict, loaded: dict, what: str):
    assert saved.keys() == loaded.keys(), what
    for key in saved:
        assert saved[key].dtype == loaded[key].dtype, (what, key)
        assert np.array_equal(saved[key], loaded[key]), (what, key)


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_round_trip_is_bit_identical(size, kind):
    if size > MPI.COMM_WORLD.size:
        pytest.skip(f"needs {size} ranks")
    with sub_world(size) as comm:
        if comm is None:
            return
        with shared_tmp(comm) as root:
            strategy = build(kind, comm, "float32")
            opt = make_optimizer(strategy.parameters())
            _train(strategy, opt, comm.rank, 0, 2)
            opt.lr = 0.0123
            saved = full_tensors(strategy, opt, comm)
            path = save_checkpoint(root, 2, strategy, opt, extra_state={"data": [1, 2]})
            assert path == root / "step-2" and latest_checkpoint(root) == path

            fresh = build(kind, comm, "float32", seed=1)
            fresh_opt = make_optimizer(fresh.parameters())
            extra = load_checkpoint(root, fresh, fresh_opt)
            _assert_same(saved, full_tensors(fresh, fresh_opt, comm), f"{kind} at {size}")
            assert extra == {"data": [1, 2]}
            assert (fresh_opt.step_count, fresh_opt.lr, fresh.steps) == (2, 0.0123, 2)
            # the loaded model trains on exactly as the saved one does
            assert _train(fresh, fresh_opt, comm.rank, 2, 1) == _train(strategy, opt,
                                                                        comm.rank, 2, 1)


def _reference(root, dp_size: int, first: int, steps: int):
    """One process, loaded from the checkpoint, trained on all dp ranks' batches concatenated."""
    self_comm = Communicator(MPI.COMM_SELF.Dup(), "self", _owned=True)
    strategy = build("ddp", self_comm, "float64", seed=5)
    opt = make_optimizer(strategy.parameters())
    load_checkpoint(root, strategy, opt)
    losses = []
    for step in range(first, first + steps):
        xs, ys = zip(*[batch(step, 0, r) for r in range(dp_size)])
        _, loss = strategy(np.concatenate(xs), np.concatenate(ys))
        loss.backward()
        strategy.step(opt)
        losses.append(loss.item())
    return np.array(losses), strategy.gather_full_params()


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_zero3_checkpoint_loads_onto_other_layouts_and_trains_on():
    world_size = MPI.COMM_WORLD.size
    save_size = min(4, world_size)
    world = Communicator(MPI.COMM_WORLD)
    with shared_tmp(world) as root:
        saved = None
        with sub_world(save_size) as comm:
            if comm is not None:
                strategy = build("zero3", comm, "float64")
                opt = make_optimizer(strategy.parameters())
                _train(strategy, opt, comm.rank, 0, 3)
                save_checkpoint(root, 3, strategy, opt, extra_state={"step": 3})
                saved = full_tensors(strategy, opt, comm)
        saved = world.broadcast_obj(saved)
        manifest = read_manifest(root / "step-3")
        assert manifest.world_size == save_size and len(manifest.files) == save_size
        for size, kind in [(2, "zero2"), (1, "ddp"), (3, "zero3"), (4, "zero1"), (1, "zero3")]:
            if size > world_size:
                continue
            with sub_world(size) as comm:
                if comm is None:
                    continue
                strategy = build(kind, comm, "float64", seed=9)
                opt = make_optimizer(strategy.parameters())
                assert load_checkpoint(root, strategy, opt) == {"step": 3}
                what = f"saved zero3 at {save_size}, loaded {kind} at {size}"
                _assert_same(saved, full_tensors(strategy, opt, comm), what)
                assert opt.step_count == 3
                losses = np.array(_train(strategy, opt, comm.rank, 3, 5))
                ref_losses, ref_params = _reference(root, size, 3, 5)
                assert np.all(np.isfinite(losses)) and len(losses) == 5
                assert np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)) <= 1e-10, what
                assert max_rel_err(strategy.gather_full_params(), ref_params) <= 1e-10, what


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_each_rank_reads_only_its_own_bytes():
    with sub_world(MPI.COMM_WORLD.size) as comm:
        with shared_tmp(comm) as root:
            strategy = build("zero3", comm, "float32")
            opt = make_optimizer(strategy.parameters())
            save_checkpoint(root, 0, strategy, opt)
            manifest = read_manifest(root / "step-0")
            fresh = build("zero3", comm, "float32", seed=3)
            fresh_opt = make_optimizer(fresh.parameters())
            with ShardReader(root / "step-0", manifest) as reader:
                load_pieces(fresh, fresh_opt, reader.read)
                needed = sum(p.size * 4 for p in pieces_of(fresh, fresh_opt))
                assert reader.bytes_read == needed
            total = sum(t.nbytes for t in manifest.tensors.values())
            assert comm.size == 1 or needed < total


class FailingAdamW(AdamW):
    """AdamW whose state cannot be read on the ranks told to fail (an injected write error)."""

    fail = False

    def allocate_state(self):
        if self.fail:
            raise OSError(28, "No space left on device (injected)")
        super().allocate_state()


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_a_rank_that_fails_to_save_fails_the_save_everywhere():
    with sub_world(MPI.COMM_WORLD.size) as comm:
        with shared_tmp(comm) as root:
            strategy = build("zero2", comm, "float32")
            opt = FailingAdamW(strategy.parameters(), lr=1e-3)
            save_checkpoint(root, 1, strategy, opt)
            opt.fail = comm.rank == comm.size - 1
            with pytest.raises(CheckpointError) as info:
                save_checkpoint(root, 2, strategy, opt, keep_last=1)
            err = info.value
            assert list(err.failures) == [comm.size - 1]
            assert "No space left on device (injected)" in err.failures[comm.size - 1]
            assert "No space left on device (injected)" in str(err)
            comm.barrier()
            seen = {"no step-2": not (root / "step-2").exists(),
                    "no step-2.tmp": not (root / "step-2.tmp").exists(),
                    "latest": latest_checkpoint(root) == root / "step-1",
                    "verifies": verify_checkpoint(root).step == 1}
            # Every rank looks before rank 0 starts the next save (it makes step-2.tmp),
            # and every rank learns what the others saw: a failed check fails all of them.
            everyone = comm.all_gather_obj(seen)
            assert all(all(s.values()) for s in everyone), everyone
            opt.fail = False
            assert save_checkpoint(root, 2, strategy, opt, keep_last=1) == root / "step-2"
            assert not (root / "step-1").exists()


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", ["flip", "missing"])
def test_a_damaged_checkpoint_fails_the_load_everywhere(damage):
    with sub_world(MPI.COMM_WORLD.size) as comm:
        with shared_tmp(comm) as root:
            strategy = build("zero2", comm, "float32")
            opt = make_optimizer(strategy.parameters())
            save_checkpoint(root, 5, strategy, opt)
            last = f"rank-{comm.size - 1}.safetensors"
            if comm.rank == 0:
                path = root / "step-5" / last
                if damage == "flip":
                    data = bytearray(path.read_bytes())
                    data[-3] ^= 0x40
                    path.write_bytes(bytes(data))
                else:
                    path.unlink()
            comm.barrier()
            fresh = build("zero2", comm, "float32", seed=1)
            with pytest.raises(CheckpointError) as info:
                # verify=False for "missing": the reads themselves fail, on some ranks only
                load_checkpoint(root, fresh, make_optimizer(fresh.parameters()),
                                verify=damage == "flip")
            assert info.value.rule == ("sha256" if damage == "flip" else "missing-file")
            assert last in str(info.value)


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_a_checkpoint_of_another_model_is_a_mismatch_everywhere():
    from mpishard.models import GPTConfig

    with sub_world(MPI.COMM_WORLD.size) as comm:
        with shared_tmp(comm) as root:
            strategy = build("zero3", comm, "float32")
            save_checkpoint(root, 1, strategy, make_optimizer(strategy.parameters()))
            wider = build("zero3", comm, "float32", cfg=GPTConfig(
                vocab_size=37, block_size=8, n_layer=3, n_head=2, n_embd=10))
            with pytest.raises(CheckpointError, match="does not fit this model") as info:
                load_checkpoint(root, wider, make_optimizer(wider.parameters()))
            assert info.value.rule == "mismatch"
            assert "transformer.h.2.ln_1.weight is not in the checkpoint" in str(info.value)
            sgd_like = build("zero3", comm, "float32", seed=2)
            from mpishard.optim import SGD
            with pytest.raises(CheckpointError, match="SGD keeps"):
                load_checkpoint(root, sgd_like, SGD(sgd_like.parameters(), momentum=0.9))
            # parameters only: a fresh optimizer keeps its zero state
            params_only = build("zero3", comm, "float32", seed=2)
            opt = make_optimizer(params_only.parameters())
            load_checkpoint(root, params_only, None)
            assert opt.step_count == 0


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_checkpoint_saved_without_optimizer_loads_into_one():
    with sub_world(MPI.COMM_WORLD.size) as comm:
        with shared_tmp(comm) as root:
            strategy = build("ddp", comm, "float32")
            save_checkpoint(root, 4, strategy)
            manifest = read_manifest(root / "step-4")
            assert manifest.optimizer is None and manifest.kinds() == ["param"]
            assert list(manifest.files) == ["rank-0.safetensors"]  # replicas: dp rank 0 only
            fresh = build("zero3", comm, "float32", seed=1)
            opt = make_optimizer(fresh.parameters())
            load_checkpoint(root, fresh, opt)
            assert opt.step_count == 0
            assert all(not np.any(s) for slot in opt.state for s in slot.values())
            full = full_tensors(fresh, opt, comm)
            ref = strategy.gather_full_params()
            for name, value in ref.items():
                assert np.array_equal(full[(name, "param")], value.reshape(-1)), name


@pytest.mark.mpi
@pytest.mark.timeout(180)
@pytest.mark.parametrize("dp, tp, pp", [(1, 2, 2), (2, 2, 1)])
def test_tensor_and_pipeline_layouts_load_anywhere(dp, tp, pp):
    """A dp x tp x pp checkpoint (pieces of many runs, tied copies on two stages) loads into
    ZeRO-3 over all ranks and back, bit for bit: layout comes from the runs alone."""
    if MPI.COMM_WORLD.size != 4:
        pytest.skip("needs 4 ranks")
    from mpishard.comm import Mesh
    from mpishard.models import GPT, GPTConfig
    from mpishard.parallel import ParallelModel

    cfg = GPTConfig(vocab_size=40, block_size=8, n_layer=2, n_head=2, n_embd=12)
    world = Communicator(MPI.COMM_WORLD)
    mesh = Mesh(world, dp=dp, tp=tp, pp=pp)
    with shared_tmp(world) as root:
        run = ParallelModel(GPT(cfg, dtype="float64", materialize_now=False), mesh,
                            strategy="zero3", micro_batches=2)
        opt = make_optimizer(run.parameters())
        x = np.random.default_rng(mesh.dp_rank).integers(0, 40, (4, 8))
        run.train_step(x, x)
        run.step(opt)
        saved = full_tensors(run.strategy, opt, world)
        save_checkpoint(root, 1, run.strategy, opt)
        manifest = read_manifest(root / "step-1")
        assert manifest.mesh == {"pp": pp, "dp": dp, "tp": tp, "cp": 1, "dp_replicate": 1,
                                 "dp_shard": dp, "ep": 1}
        assert manifest.aliases == {"lm_head.weight": "transformer.wte.weight"}
        assert max(len(p.runs) for t in manifest.tensors.values() for p in t.pieces) > 1

        flat = build("zero3", world, "float64", seed=3, cfg=cfg)
        flat_opt = make_optimizer(flat.parameters())
        load_checkpoint(root, flat, flat_opt)
        _assert_same(saved, full_tensors(flat, flat_opt, world), f"dp{dp} tp{tp} pp{pp} -> zero3")
        save_checkpoint(root, 2, flat, flat_opt)

        back = ParallelModel(GPT(cfg, seed=5, dtype="float64", materialize_now=False), mesh,
                             strategy="zero3", micro_batches=2)
        back_opt = make_optimizer(back.parameters())
        load_checkpoint(root / "step-2", back.strategy, back_opt)
        _assert_same(saved, full_tensors(back.strategy, back_opt, world), "and back")


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_fine_tuning_starts_from_a_consolidated_file_on_every_rank():
    from mpishard.checkpoint import consolidate, load_consolidated

    with sub_world(MPI.COMM_WORLD.size) as comm:
        with shared_tmp(comm) as root:
            strategy = build("zero3", comm, "float32")
            opt = make_optimizer(strategy.parameters())
            _train(strategy, opt, comm.rank, 0, 1)
            save_checkpoint(root, 1, strategy, opt)
            saved = strategy.gather_full_params()
            if comm.rank == 0:
                consolidate(root, root / "model.safetensors")
            comm.barrier()
            fresh = build("zero2", comm, "float32", seed=4)
            load_consolidated(root / "model.safetensors", fresh)
            for name, value in fresh.gather_full_params().items():
                assert np.array_equal(value, saved[name]), name


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_zero3_load_after_an_evaluation_forward_uses_the_loaded_values():
    """An eval forward leaves ZeRO-3's root unit gathered; loading must drop that copy."""
    from mpishard.autodiff import no_grad

    world = Communicator(MPI.COMM_WORLD)
    with shared_tmp(world) as root:
        saved = build("zero3", world, seed=0)
        opt = make_optimizer(saved.parameters())
        _train(saved, opt, world.rank, 0, 2)
        save_checkpoint(root, 2, saved, opt, world=world)
        x, y = batch(9, 0, world.rank)
        with no_grad():
            expected = saved(x, y)[1].item()
        loaded = build("zero3", world, seed=1)
        with no_grad():
            before = loaded(x, y)[1].item()               # gathers the root unit
        load_checkpoint(root, loaded, make_optimizer(loaded.parameters()), world=world)
        with no_grad():
            after = loaded(x, y)[1].item()
        assert before != expected and after == expected


def test_a_parallel_model_saves_and_loads_as_its_strategy(tmp_path):
    """``save_checkpoint(dir, step, run, opt)`` with a ParallelModel takes its strategy;
    anything else, and a path that is not one, are named."""
    from mpishard.comm import Mesh
    from mpishard.models import GPT, GPTConfig
    from mpishard.parallel import ParallelModel

    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=1, n_embd=4)
    with Communicator(MPI.COMM_SELF.Dup(), "ckpt", _owned=True) as world:
        run = ParallelModel(GPT(cfg, seed=0), Mesh(world, dp=1), strategy="zero1")
        opt = AdamW(run.parameters(), lr=1e-3)
        saved = save_checkpoint(tmp_path, 0, run, opt, world=world)
        again = ParallelModel(GPT(cfg, seed=1), Mesh(world, dp=1), strategy="zero1")
        load_checkpoint(saved, again, AdamW(again.parameters(), lr=1e-3), world=world)
        for (name, a), (_, b) in zip(run.strategy.module.named_parameters(),
                                     again.strategy.module.named_parameters()):
            assert np.array_equal(a.data, b.data), name
        with pytest.raises(TypeError, match="save_checkpoint takes the strategy wrapping the "
                                            "model .* got GPT"):
            save_checkpoint(tmp_path, 1, run.strategy.module, opt, world=world)
        with pytest.raises(TypeError, match="load_checkpoint: path must be a step directory "
                                            "or a checkpoint root .* got None"):
            load_checkpoint(None, run, opt, world=world)
        with pytest.raises(CheckpointError, match="does not exist; pass a checkpoint root"):
            load_checkpoint(tmp_path / "nowhere", run, opt, world=world)

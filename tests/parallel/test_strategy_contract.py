"""A strategy defined only here goes through every path a built-in one does.

``AllReduceEach`` is the simplest correct data parallelism: every rank holds
the whole model and, at the end of backward, each gradient is averaged with
one blocking all-reduce of its own. It registers itself under
``test-allreduce-each`` and, with no other edit anywhere, trains against the
single-process reference, saves and reloads checkpoints (into itself and into
ZeRO-3), is planned by ``estimate_memory`` (from what its registry line says it
keeps sharded: nothing), appears in ``mpishard estimate`` and
trains through ``mpishard train``. It is what docs/concepts.md's "add a
strategy" walk shows.
"""
import contextlib
import io

import numpy as np
import pytest
from mpi4py import MPI

from mpishard.checkpoint import load_checkpoint, save_checkpoint
from mpishard.comm import Mesh
from mpishard.models import GPT
from mpishard.optim.clip import grad_sq_sum
from mpishard.parallel import STRATEGIES, Sharded, Strategy, ZeRO, register_strategy, wrap_model
from mpishard.planning.memory import estimate_memory
from parity import UNEVEN, make_optimizer, max_rel_err, reference, sub_world, train

NAME = "test-allreduce-each"


@register_strategy(NAME, "test only: one blocking all-reduce per gradient after backward",
                   keeps_sharded=Sharded.NOTHING)
class AllReduceEach(Strategy):
    """Replicated parameters; every gradient averaged on its own in ``reduce_grads``."""

    def parameters(self):
        return self.module.parameters()

    def reduce_grads(self):
        for p in self.module.parameters():
            if p.grad is None:
                p.grad = self.xp.zeros(p.shape, p.dtype)
            p.grad = self.xp.ascontiguousarray(p.grad)
            self.dp.all_reduce(p.grad, op="avg")

    def local_grad_sq(self):
        if self.dp.rank != 0:      # replicas hold the same gradients: count them once
            return 0.0
        return grad_sq_sum(p.grad for p in self.module.parameters()
                           if self.counts_once(p.spec))


def test_registered_once_with_its_summary():
    entry = STRATEGIES[NAME]
    assert entry.cls is AllReduceEach and "one blocking all-reduce" in entry.summary
    with pytest.raises(ValueError, match="already registered"):
        register_strategy(NAME, "again")(type("Other", (Strategy,), {}))
    with pytest.raises(ValueError, match=f"unknown strategy 'nope'; use one of ddp, zero1, "
                                         f"zero2, zero3.*{NAME}"):
        estimate_memory(GPT(UNEVEN, materialize_now=False), "nope", 2)


def test_the_registry_says_what_each_strategy_keeps_sharded():
    assert [(n, STRATEGIES[n].keeps_sharded) for n in ("ddp", "zero1", "zero2", "zero3")] == \
        [("ddp", Sharded.NOTHING), ("zero1", Sharded.OPTIMIZER_STATE),
         ("zero2", Sharded.GRADIENTS), ("zero3", Sharded.PARAMETERS)]
    assert STRATEGIES["zero2"].cls.max_inflight_reductions == 2
    assert STRATEGIES[NAME].cls.max_inflight_reductions is None
    with pytest.raises(ValueError, match="keeps_sharded=4 is not a level of Sharded; pass one "
                                         "of Sharded.NOTHING, Sharded.OPTIMIZER_STATE"):
        register_strategy("test-bad-level", "never", keeps_sharded=4)
    assert "test-bad-level" not in STRATEGIES


def test_the_planner_reads_the_registry_line_not_the_name():
    """ZeRO under another name and the same level is planned byte for byte as zero2."""
    register_strategy("test-zero-again", "test only", keeps_sharded=Sharded.GRADIENTS,
                      stage=2)(STRATEGIES["zero2"].cls)
    try:
        ours = estimate_memory(GPT(UNEVEN, materialize_now=False), "test-zero-again", 4,
                               dp_replicate=2)
        zero2 = estimate_memory(GPT(UNEVEN, materialize_now=False), "zero2", 4,
                                dp_replicate=2)
    finally:
        del STRATEGIES["test-zero-again"]
    assert ours.strategy == "test-zero-again"
    assert (ours.steady, ours.peak, ours.bus_bytes_by_group) == \
        (zero2.steady, zero2.peak, zero2.bus_bytes_by_group)
    assert ours.steady["grads"] < ours.steady["params"]      # gradients sharded, not params


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_trains_like_one_process(size):
    if size > MPI.COMM_WORLD.size:
        pytest.skip(f"needs {size} ranks")
    with sub_world(size) as comm:
        if comm is None:
            return
        ref_losses, ref_params = reference(size, 5, 2, "float64", 0.5)
        strategy = wrap_model(GPT(UNEVEN, seed=0, dtype="float64", materialize_now=False),
                              Mesh(comm), NAME)
        assert isinstance(strategy, AllReduceEach)
        losses, params = train(strategy, comm.rank, 5, 2, 0.5)
        assert float(np.max(np.abs(losses - ref_losses) / ref_losses)) <= 1e-10
        assert max_rel_err(params, ref_params) <= 1e-10


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_checkpoints_through_the_contract(tmp_path_factory):
    world = MPI.COMM_WORLD
    root = world.bcast(str(tmp_path_factory.mktemp("contract")) if world.rank == 0 else None)
    with sub_world(world.size) as comm:
        mesh = Mesh(comm)
        strategy = wrap_model(GPT(UNEVEN, seed=0, dtype="float64"), mesh, NAME)
        _, trained = train(strategy, comm.rank, 3, 1)
        opt = make_optimizer(strategy.parameters())
        save_checkpoint(root, 3, strategy, opt, extra_state={"note": "contract"})
        back = wrap_model(GPT(UNEVEN, seed=7, dtype="float64"), mesh, NAME)
        extra = load_checkpoint(root, back, make_optimizer(back.parameters()))
        assert extra == {"note": "contract"} and back.steps == strategy.steps == 3
        for name, value in back.gather_full_params().items():
            assert np.array_equal(value, trained[name]), name
        other = ZeRO(GPT(UNEVEN, seed=7, dtype="float64", materialize_now=False), mesh, stage=3)
        load_checkpoint(root, other, None)
        for name, value in other.gather_full_params().items():
            assert np.array_equal(value, trained[name]), name


def test_planned_like_its_ledger():
    world = MPI.COMM_SELF
    from mpishard.comm import Communicator

    with Communicator(world.Dup(), "self", _owned=True) as comm:
        strategy = wrap_model(GPT(UNEVEN, seed=0), Mesh(comm), NAME)
        opt = make_optimizer(strategy.parameters(), strategy.ledger)
        opt.allocate_state()
        plan = estimate_memory(GPT(UNEVEN, materialize_now=False), NAME, 1)
        held = strategy.ledger.bytes_by_category()
        assert plan.steady["params"] == held["params"] > 0
        assert plan.steady["optim"] == held["optim"] > 0
        assert plan.strategy == NAME


def test_appears_in_mpishard_estimate():
    from mpishard.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["estimate", "--strategy", NAME, "--dp", "4", "--n-layer", "2"]) == 0
    assert f"{NAME} on dp=4" in out.getvalue()
    assert "bus bytes per step" in out.getvalue()


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_trains_and_resumes_through_mpishard_train(tmp_path_factory):
    """The trainer, config validation and checkpoints find it by name alone."""
    from mpishard.checkpoint import read_manifest
    from mpishard.comm import Communicator
    from mpishard.config.sections import load_config
    from mpishard.run.train import run

    world = MPI.COMM_WORLD
    root = world.bcast(str(tmp_path_factory.mktemp("train")) if world.rank == 0 else None)
    flags = dict(strategy=NAME, n_layer=1, n_embd=16, n_head=2, block_size=16, batch_size=2,
                 max_bytes=20_000, eval_batches=1, progress=False, steps=3, checkpoint_dir=root)
    with Communicator(world.Dup(), "train", _owned=True) as comm:
        first = run(load_config(None, flags), comm)
        again = run(load_config(None, dict(flags, steps=5, resume=True)), comm)
    assert first["steps"] == 3 and again["steps"] == 5 and not again["stopped"]
    manifest = read_manifest(f"{root}/step-5")
    assert manifest.strategy["name"] == "AllReduceEach" and manifest.strategy["steps"] == 5
    assert manifest.extra["config"]["parallel"]["strategy"] == NAME

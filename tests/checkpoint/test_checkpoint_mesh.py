"""Checkpoints of the five-axis mesh: saved on one layout (hybrid sharding, context and
sequence parallelism), loaded on any other, bit for bit, and training goes on equal."""
import numpy as np
import pytest
from mpi4py import MPI

from ckpt_scripts.common import full_tensors, shared_tmp
from mpishard.checkpoint import load_checkpoint, read_manifest, save_checkpoint
from mpishard.comm import Communicator, Mesh
from mpishard.models import Llama, LlamaConfig
from mpishard.parallel import ParallelModel
from parity import make_optimizer

CFG = LlamaConfig(vocab_size=37, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=16,
                  intermediate_size=20)
LAYOUTS = {  # name -> (mesh sizes, strategy, extra ParallelModel options)
    "hsdp2x2-zero3": (dict(dp_replicate=2, dp_shard=2), "zero3", {}),
    "cp2-tp2-sp-zero2": (dict(cp=2, tp=2), "zero2", dict(sequence_parallel=True)),
    "cp4-ddp": (dict(cp=4), "ddp", {}),
    "dp_replicate2-cp2-zero1": (dict(dp_replicate=2, cp=2), "zero1", dict(cp_mode="all-to-all")),
    "pp2-cp2-zero3": (dict(pp=2, cp=2), "zero3", {}),
}


def build(world, name, seed=0):
    sizes, strategy, extra = LAYOUTS[name]
    mesh = Mesh(world, **sizes)
    run = ParallelModel(Llama(CFG, seed=seed, dtype="float64", materialize_now=False), mesh,
                        strategy=strategy, micro_batches=2, **extra)
    return run, make_optimizer(run.parameters())


def step(run, n: int):
    share = 4 // run.mesh.dp.size            # the global batch: 4 data ranks' worth
    parts = [np.random.default_rng(100 * n + run.mesh.dp_rank * share + k).integers(
        0, 37, (2, 2, 16)) for k in range(share)]
    x, y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    loss = run.train_step(x, y)
    run.step(run_opt[id(run)], max_norm=1.0)
    buf = np.array([loss])
    run.mesh.dp_cp.all_reduce(buf, op="avg")
    return buf[0]


run_opt: dict = {}


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("source,target", [("hsdp2x2-zero3", "cp2-tp2-sp-zero2"),
                                           ("cp2-tp2-sp-zero2", "hsdp2x2-zero3"),
                                           ("cp4-ddp", "dp_replicate2-cp2-zero1"),
                                           ("pp2-cp2-zero3", "cp4-ddp")])
def test_a_checkpoint_loads_on_another_layout_and_trains_on_equal(source, target):
    if MPI.COMM_WORLD.size != 4:
        pytest.skip("written for 4 ranks")
    world = Communicator(MPI.COMM_WORLD)
    with shared_tmp(world) as root:
        a, a_opt = build(world, source)
        run_opt[id(a)] = a_opt
        step(a, 0)
        saved = full_tensors(a.strategy, a_opt, world)
        save_checkpoint(root, 1, a.strategy, a_opt)
        mesh = read_manifest(root / "step-1").mesh
        assert mesh["cp"] == a.mesh.cp.size and mesh["dp_replicate"] == a.mesh.dp_replicate.size
        b, b_opt = build(world, target, seed=7)        # other initial values, overwritten
        run_opt[id(b)] = b_opt
        load_checkpoint(root, b.strategy, b_opt)
        loaded = full_tensors(b.strategy, b_opt, world)
        assert saved.keys() == loaded.keys()
        for key in saved:
            assert np.array_equal(saved[key], loaded[key]), key
        # both go on with the same global batches: the same losses to rounding
        ahead = [step(a, n) for n in (1, 2)]
        other = [step(b, n) for n in (1, 2)]
        assert max(abs(x - y) / x for x, y in zip(ahead, other)) <= 1e-10

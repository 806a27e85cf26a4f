"""An exact resume with dropout on a device: the generators' states go into the checkpoint.

On CuPy (and the strict module) each dropout layer draws from a device
generator whose whole state is one device array. A checkpoint saves it with
the NumPy generators' states (mpishard.checkpoint.state), so a run saved after
two steps and resumed in a fresh process continues with the same masks: its
next losses and parameters equal the uninterrupted run's bit for bit. Without
restoring them the masks, and so the losses, differ.

    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi tests/testing/test_strict_resume.py
"""
import numpy as np
import pytest
from mpi4py import MPI

from ckpt_scripts.common import shared_tmp
from mpishard.testing import strict
from mpishard.core.backend import Backend, to_numpy
from mpishard.checkpoint import (load_checkpoint, load_module_rng_states, module_rng_states,
                                 save_checkpoint)
from mpishard.comm import Mesh
from mpishard.models import GPT, GPTConfig
from mpishard.optim import AdamW
from mpishard.parallel import ParallelModel
from parity import sub_world

CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=12, dropout=0.2)
LAYOUTS = {"ddp": lambda n: {"dp": n}, "zero3": lambda n: {"dp": n},
           "pp2": lambda n: {"dp": n // 2, "pp": 2} if n % 2 == 0 else None}


def _build(comm, layout):
    model = GPT(CFG, seed=0, dtype="float64", backend=Backend.resolve("strict"),
                materialize_now=False)
    run = ParallelModel(model, Mesh(comm, **LAYOUTS[layout](comm.size)),
                        strategy="ddp" if layout == "pp2" else layout, micro_batches=2)
    return run, AdamW(run.parameters(), lr=1e-2, weight_decay=0.1, ledger=run.ledger)


def _step(run, opt, step):
    r = np.random.default_rng(100 * step + run.mesh.dp.rank)
    x, y = r.integers(0, CFG.vocab_size, (4, 8)), r.integers(0, CFG.vocab_size, (4, 8))
    loss = run.train_step(x, y)
    run.step(opt, max_norm=1.0)
    return loss


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("size", [1, 2])
def test_resume_with_device_dropout_is_exact(size, layout):
    if size > MPI.COMM_WORLD.size:
        pytest.skip(f"needs {size} ranks")
    if LAYOUTS[layout](size) is None:
        pytest.skip(f"{layout} does not fit {size} ranks")
    with sub_world(size) as comm:
        if comm is None:
            return
        with shared_tmp(comm) as root:
            run, opt = _build(comm, layout)
            gens = [m.rng for _, m in run.module.named_modules() if "rng" in m.__dict__]
            assert gens and all(isinstance(g, strict.random.Generator) for g in gens)
            for step in range(2):
                _step(run, opt, step)
            rng = module_rng_states(run.module, comm)
            assert rng and all("device_state" in s for s in rng.values())
            save_checkpoint(root, 2, run.strategy, opt, world=comm, extra_state={"rng": rng})
            expected = [_step(run, opt, step) for step in (2, 3)]
            final = {n: to_numpy(a) for n, a in run.gather_full_params().items()}

            resumed, resumed_opt = _build(comm, layout)
            extra = load_checkpoint(root, resumed.strategy, resumed_opt, world=comm)
            load_module_rng_states(resumed.module, extra["rng"])
            assert [_step(resumed, resumed_opt, step) for step in (2, 3)] == expected
            again = resumed.gather_full_params()
            assert all(np.array_equal(to_numpy(again[n]), final[n]) for n in final)

            seeded, seeded_opt = _build(comm, layout)       # the states left out: other masks
            load_checkpoint(root, seeded.strategy, seeded_opt, world=comm)
            assert [_step(seeded, seeded_opt, step) for step in (2, 3)] != expected

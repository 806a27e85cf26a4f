"""Tensor and pipeline parallelism, alone and composed with DDP/ZeRO, vs one process.

Every layout trains the same global batch (two dp ranks' worth of different
data) for 10 AdamW steps in float64 with global-norm clipping active (the
norm is ~1, the limit 0.5), and must match the single-process reference
within 1e-10 (losses and gathered parameters). Uneven splits on purpose: 4
layers over 4 heads of width 3 and a vocabulary of 37.
"""
import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import Mesh
from mpishard.models import GPT, GPTConfig
from mpishard.parallel import ParallelModel, bubble_fraction, partition_blocks
from parity import batch, make_optimizer, max_rel_err, reference, sub_world

CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=4, n_head=4, n_embd=12)
DATA_DP, STEPS, MAX_NORM, TOL = 2, 10, 0.5, 1e-10
_REF = {}


def _reference():
    if "ref" not in _REF:
        _REF["ref"] = reference(DATA_DP, STEPS, 1, "float64", MAX_NORM, CFG)
    return _REF["ref"]


def train_layout(comm, dp, tp, pp, strategy="ddp", schedule="1f1b", micro=1):
    mesh = Mesh(comm, dp=dp, tp=tp, pp=pp)
    run = ParallelModel(GPT(CFG, dtype="float64", materialize_now=False), mesh,
                        strategy=strategy, micro_batches=micro, schedule=schedule)
    opt = make_optimizer(run.parameters(), run.ledger)
    share = DATA_DP // dp          # data of `share` reference ranks per dp rank
    losses = []
    for step in range(STEPS):
        parts = [batch(step, 0, mesh.dp.rank * share + k, CFG) for k in range(share)]
        x, y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        loss = run.train_step(x, y)
        result = run.step(opt, max_norm=MAX_NORM)
        assert not result.skipped and result.grad_norm > MAX_NORM   # clipping is active
        buf = np.array([loss])
        mesh.dp.all_reduce(buf, op="avg")
        losses.append(buf[0])
    return np.array(losses), run.gather_full_params()


LAYOUTS = [  # (dp, tp, pp, strategy, schedule, micro-batches)
    (1, 2, 1, "ddp", "1f1b", 1),
    (1, 4, 1, "ddp", "1f1b", 1),
    (1, 3, 1, "zero3", "1f1b", 1),      # uneven: heads 2+1+1, vocabulary 13+12+12
    (1, 1, 2, "ddp", "gpipe", 2),
    (1, 1, 2, "ddp", "1f1b", 2),
    (1, 1, 4, "ddp", "1f1b", 4),
    (2, 2, 1, "ddp", "1f1b", 1),
    (2, 2, 1, "zero3", "1f1b", 1),
    (2, 1, 2, "ddp", "1f1b", 2),
    (2, 1, 2, "zero3", "gpipe", 2),
    (1, 2, 2, "zero1", "1f1b", 2),
]


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "dp{}-tp{}-pp{}-{}-{}-m{}".format(*l))
def test_layout_matches_single_process(layout):
    dp, tp, pp, strategy, schedule, micro = layout
    size = dp * tp * pp
    if MPI.COMM_WORLD.size < size:
        pytest.skip(f"needs {size} ranks")
    with sub_world(size) as comm:
        if comm is None:
            return
        ref_losses, ref_params = _reference()
        losses, params = train_layout(comm, dp, tp, pp, strategy, schedule, micro)
        assert float(np.max(np.abs(losses - ref_losses) / ref_losses)) <= TOL
        assert max_rel_err(params, ref_params) <= TOL


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(300)
def test_dp2xtp2_and_tp2xpp2_end_equal():
    with sub_world(4) as comm:
        _, a = train_layout(comm, 2, 2, 1, "zero2")
        _, b = train_layout(comm, 1, 2, 2, "ddp", "1f1b", 2)
        assert max_rel_err(a, b) <= TOL


def test_partition_and_bubble():
    assert [len(r) for r in partition_blocks(4, 2, 100, first_extra=0, last_extra=0)] == [2, 2]
    # embeddings as heavy as a block push a block off the first stage
    assert [len(r) for r in partition_blocks(5, 2, 100, first_extra=100)] == [2, 3]
    assert [len(r) for r in partition_blocks(4, 2, plan=[1, 3])] == [1, 3]
    with pytest.raises(ValueError, match="pp=5 is larger than the number of blocks"):
        partition_blocks(4, 5)
    with pytest.raises(ValueError, match="stage plan"):
        partition_blocks(4, 2, plan=[4, 0])
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_bad_layouts_raise_before_communicating():
    with sub_world(1) as comm:
        if comm is None:
            return
        mesh = Mesh(comm)
        with pytest.raises(ValueError, match="micro_batches must be an integer >= 1"):
            ParallelModel(GPT(CFG, materialize_now=False), mesh, micro_batches=0)
        run = ParallelModel(GPT(CFG, materialize_now=False), mesh, micro_batches=3)
        with pytest.raises(ValueError, match="batch of 2 does not split into 3 micro-batches"):
            run.train_step(*batch(0, 0, 0, CFG))


def test_tp_larger_than_heads_is_refused():
    from mpishard.parallel import apply_tensor_plan

    class FiveRanks:  # only the size is read before the check
        size, rank = 5, 0
    with pytest.raises(ValueError, match="tp=5 is larger than n_head=4"):
        apply_tensor_plan(GPT(CFG, materialize_now=False), FiveRanks())

"""The Llama family under every strategy and layout, against one process (float64, 1e-10).

A Llama with grouped-query attention (4 query heads, 2 key/value heads), an
untied head (and a tied variant), vocabulary 37 and MLP width 40 (neither
divides by 3 or 4), trained 6 AdamW steps with clipping active and different
data per dp rank: DDP and ZeRO-1/2/3 at dp 1-4; tensor parallel with the
key/value heads split (tp 2) and kept whole on every rank with their gradients
summed (tp 3, 4, and tp 2 with one key/value head); pipelines with 1F1B and
GPipe; and compositions. Checkpoints saved on one layout load on another. Qwen2
(the Llama with q/k/v biases, mpishard.models.qwen2) on dp 2 x tp 2 under ZeRO-3,
cp 2 x tp 2 with sequence parallelism, and two pipeline stages.
"""
import numpy as np
import pytest
from mpi4py import MPI

from mpishard.checkpoint import load_checkpoint, save_checkpoint
from mpishard.comm import Communicator, Mesh
from mpishard.models import Llama, LlamaConfig
from mpishard.models.qwen2.spec import Qwen2Config
from mpishard.parallel import ParallelModel, wrap_model
from parity import batch, make_optimizer, max_rel_err, reference, sub_world, train

GQA = LlamaConfig(vocab_size=37, block_size=8, n_layer=4, n_head=4, n_kv_head=2, n_embd=16,
                  intermediate_size=40, rope_theta=500.0)
ONE_KV = LlamaConfig(vocab_size=37, block_size=8, n_layer=2, n_head=4, n_kv_head=1, n_embd=16,
                     intermediate_size=40)
TIED = LlamaConfig(vocab_size=37, block_size=8, n_layer=4, n_head=4, n_kv_head=2, n_embd=16,
                   intermediate_size=40, tie_embeddings=True,
                   rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 2.0,
                                 "original_max_position_embeddings": 4})
QWEN2 = Qwen2Config(vocab_size=37, block_size=8, n_layer=2, n_head=4, n_kv_head=2, n_embd=16,
                    intermediate_size=40, rope_theta=500.0)
CONFIGS = {"gqa": GQA, "one_kv": ONE_KV, "tied": TIED, "qwen2": QWEN2}
STEPS, MAX_NORM, TOL, DATA_DP = 6, 0.5, 1e-10, 2
_REF = {}


def _reference(name, dp=DATA_DP, accum=1):
    key = (name, dp, accum)
    if key not in _REF:
        _REF[key] = reference(dp, STEPS, accum, "float64", MAX_NORM, CONFIGS[name],
                              model_cls=Llama)
    return _REF[key]


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero2", "zero3"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_strategies_match_one_process(size, kind):
    if size > MPI.COMM_WORLD.size:
        pytest.skip(f"needs {size} ranks")
    with sub_world(size) as comm:
        if comm is None:
            return
        ref_losses, ref_params = _reference("gqa", size, 2)
        strategy = wrap_model(Llama(GQA, dtype="float64", materialize_now=False), Mesh(comm),
                              kind)
        losses, params = train(strategy, comm.rank, STEPS, 2, MAX_NORM, GQA)
        assert float(np.max(np.abs(losses - ref_losses) / ref_losses)) <= TOL
        assert max_rel_err(params, ref_params) <= TOL


def train_layout(comm, name, dp, tp, pp, strategy, schedule="1f1b", micro=1, cp=1, sp=False):
    cfg = CONFIGS[name]
    mesh = Mesh(comm, dp=dp, tp=tp, pp=pp, cp=cp)
    run = ParallelModel(Llama(cfg, dtype="float64", materialize_now=False), mesh,
                        strategy=strategy, micro_batches=micro, schedule=schedule,
                        sequence_parallel=sp)
    opt = make_optimizer(run.parameters(), run.ledger)
    share = DATA_DP // dp
    losses = []
    for step in range(STEPS):
        parts = [batch(step, 0, mesh.dp.rank * share + k, cfg) for k in range(share)]
        x, y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        loss = run.train_step(x, y)
        result = run.step(opt, max_norm=MAX_NORM)
        assert not result.skipped and result.grad_norm > MAX_NORM
        buf = np.array([loss])
        mesh.dp_cp.all_reduce(buf, op="avg")
        losses.append(buf[0])
    return np.array(losses), run.gather_full_params(), run, opt


LAYOUTS = [  # (config, dp, tp, pp, strategy, schedule, micro-batches)
    ("gqa", 1, 2, 1, "ddp", "1f1b", 1),        # key/value heads split: 1 each
    ("one_kv", 1, 2, 1, "zero3", "1f1b", 1),   # one key/value head: whole on both ranks
    ("gqa", 1, 3, 1, "ddp", "1f1b", 1),        # uneven: query heads 2+1+1, MLP 14+13+13
    ("gqa", 1, 4, 1, "zero1", "1f1b", 1),      # 2 key/value heads over 4: whole, summed
    ("gqa", 1, 1, 2, "ddp", "gpipe", 2),
    ("tied", 1, 1, 4, "ddp", "1f1b", 4),       # the tied table on the first and last stage
    ("gqa", 2, 2, 1, "zero3", "1f1b", 1),
    ("tied", 1, 2, 2, "zero1", "1f1b", 2),
    ("gqa", 2, 1, 2, "zero3", "gpipe", 2),
]


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "{}-dp{}-tp{}-pp{}-{}-{}-m{}".format(*l))
def test_layout_matches_one_process(layout):
    name, dp, tp, pp, strategy, schedule, micro = layout
    if MPI.COMM_WORLD.size < dp * tp * pp:
        pytest.skip(f"needs {dp * tp * pp} ranks")
    with sub_world(dp * tp * pp) as comm:
        if comm is None:
            return
        ref_losses, ref_params = _reference(name)
        losses, params, _, _ = train_layout(comm, name, dp, tp, pp, strategy, schedule, micro)
        assert float(np.max(np.abs(losses - ref_losses) / ref_losses)) <= TOL
        assert max_rel_err(params, ref_params) <= TOL


QWEN2_LAYOUTS = [  # (dp, tp, pp, cp, sequence parallel, strategy)
    (2, 2, 1, 1, False, "zero3"),
    (1, 2, 1, 2, True, "zero3"),
    (2, 1, 2, 1, False, "ddp"),
]


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", QWEN2_LAYOUTS,
                         ids=lambda l: "dp{}-tp{}-pp{}-cp{}-sp{:d}-{}".format(*l))
def test_qwen2_matches_one_process(layout):
    """The q/k/v biases split with their heads under tp (and the rows under sp)."""
    dp, tp, pp, cp, sp, strategy = layout
    if MPI.COMM_WORLD.size < dp * tp * pp * cp:
        pytest.skip(f"needs {dp * tp * pp * cp} ranks")
    with sub_world(dp * tp * pp * cp) as comm:
        if comm is None:
            return
        ref_losses, ref_params = _reference("qwen2")
        assert any(n.endswith("q_proj.bias") for n in ref_params)
        losses, params, _, _ = train_layout(comm, "qwen2", dp, tp, pp, strategy,
                                            micro=pp, cp=cp, sp=sp)
        assert float(np.max(np.abs(losses - ref_losses) / ref_losses)) <= TOL
        assert max_rel_err(params, ref_params) <= TOL


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(300)
def test_checkpoint_saved_on_one_layout_loads_on_another(tmp_path_factory):
    world = Communicator(MPI.COMM_WORLD)
    root = world.mpi.bcast(str(tmp_path_factory.mktemp("llama")) if world.rank == 0 else None)
    _, saved, run, opt = train_layout(world, "tied", 1, 2, 2, "zero1", micro=2)
    save_checkpoint(root, STEPS, run.strategy, opt)
    flat = wrap_model(Llama(TIED, seed=3, dtype="float64", materialize_now=False),
                      Mesh(world), "zero3")
    load_checkpoint(root, flat, make_optimizer(flat.parameters()))
    for name, value in flat.gather_full_params().items():
        assert np.array_equal(value, saved[name]), name
    save_checkpoint(root, STEPS + 1, flat, None)
    back = ParallelModel(Llama(TIED, seed=5, dtype="float64", materialize_now=False),
                         Mesh(world, tp=4), "ddp")
    load_checkpoint(f"{root}/step-{STEPS + 1}", back.strategy, None)
    for name, value in back.gather_full_params().items():
        assert np.array_equal(value, saved[name]), name

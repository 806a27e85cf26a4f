"""Context parallelism (ring and all-to-all) and hybrid sharding vs one process.

Every layout trains the same global batch (four data ranks' worth of different
data) for several AdamW steps in float64, with clipping active and two
micro-batches per step, and must match one process training on the whole
batch within 1e-10 (losses and gathered parameters), GPT and Llama. The
sequence (24) splits into 2 x cp chunks for cp = 2, 3, 4; the vocabulary (37)
divides by none of the group sizes.
"""
import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import Mesh
from mpishard.models import GPT, GPTConfig, Llama, LlamaConfig
from mpishard.parallel import ParallelModel
from parity import make_optimizer, max_rel_err, sub_world

SEQ, BATCH, DATA, STEPS, MAX_NORM, TOL = 24, 2, 4, 3, 0.05, 1e-10
MODELS = {
    "gpt": (GPT, GPTConfig(vocab_size=37, block_size=SEQ, n_layer=2, n_head=4, n_embd=12)),
    "llama": (Llama, LlamaConfig(vocab_size=37, block_size=SEQ, n_layer=2, n_head=4,
                                 n_kv_head=2, n_embd=16, intermediate_size=20)),
    # mixtures of experts, dropless, without their auxiliary losses (those are per batch)
    "gpt-moe": (GPT, GPTConfig(vocab_size=37, block_size=SEQ, n_layer=2, n_head=4, n_embd=12,
                               moe_experts=3, moe_top_k=2, moe_every=2, moe_aux_coef=0.0,
                               moe_router="sigmoid", moe_shared_expert=True)),
    "llama-moe": (Llama, LlamaConfig(vocab_size=37, block_size=SEQ, n_layer=2, n_head=4,
                                     n_kv_head=2, n_embd=16, intermediate_size=12,
                                     moe_experts=4, moe_top_k=2, moe_aux_coef=0.0)),
}
_REF = {}


def data(step: int, rank: int, vocab: int = 37, ignored: bool = False):
    """Data rank ``rank``'s batch of ``step``; with ``ignored``, a different number of
    ignored targets (-100) on every rank and step, all of them in some chunks."""
    r = np.random.default_rng(1000 * step + rank)
    x = r.integers(0, vocab, (BATCH, SEQ))
    y = r.integers(0, vocab, (BATCH, SEQ))
    if ignored:
        y[0, : 3 + 5 * rank + step] = -100       # row 0's first chunks lose their targets
        y[1, SEQ - 2 - rank:] = -100
    return x, y


def reference(model: str, ignored: bool = False):
    """One process on the concatenation of all DATA ranks' batches: (losses, params)."""
    key = (model, ignored)
    if key not in _REF:
        cls, cfg = MODELS[model]
        net = cls(cfg, dtype="float64")
        opt = make_optimizer(net.parameters())
        losses = []
        for step in range(STEPS):
            parts = [data(step, r, ignored=ignored) for r in range(DATA)]
            _, loss = net(np.concatenate([p[0] for p in parts]),
                          np.concatenate([p[1] for p in parts]))
            loss.backward()
            from mpishard.optim import clip_grad_norm
            clip_grad_norm(net.parameters(), MAX_NORM)
            opt.step()
            net.zero_grad()
            losses.append(loss.item())
        _REF[key] = (np.array(losses), {n: p.data.copy() for n, p in net.named_parameters()})
    return _REF[key]


def train(comm, model: str, strategy: str, mesh_sizes: dict, cp_mode="ring", micro=2,
          ignored=False, schedule="1f1b", sp=False):
    cls, cfg = MODELS[model]
    mesh = Mesh(comm, **mesh_sizes)
    run = ParallelModel(cls(cfg, dtype="float64", materialize_now=False), mesh,
                        strategy=strategy, micro_batches=micro, cp_mode=cp_mode,
                        schedule=schedule, sequence_parallel=sp)
    opt = make_optimizer(run.parameters(), run.ledger)
    share = DATA // mesh.dp.size
    losses = []
    for step in range(STEPS):
        parts = [data(step, mesh.dp_rank * share + k, ignored=ignored) for k in range(share)]
        x, y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        loss = run.train_step(x, y)
        result = run.step(opt, max_norm=MAX_NORM)
        assert not result.skipped and result.grad_norm > MAX_NORM      # clipping is active
        buf = np.array([loss])
        mesh.dp_cp.all_reduce(buf, op="avg")
        losses.append(buf[0])
    return np.array(losses), run.gather_full_params()


def check_layout(comm, model: str, strategy: str, mesh_sizes: dict, cp_mode="ring",
                 ignored=False, sp=False):
    """Train the layout on ``comm`` and assert its losses and parameters are one
    process's to TOL."""
    ref_losses, ref_params = reference(model, ignored)
    losses, params = train(comm, model, strategy, mesh_sizes, cp_mode, ignored=ignored, sp=sp)
    assert float(np.max(np.abs(losses - ref_losses) / ref_losses)) <= TOL
    assert max_rel_err(params, ref_params) <= TOL


LAYOUTS = [  # (strategy, mesh sizes, cp mode)
    ("ddp", dict(cp=4), "ring"),
    ("zero3", dict(cp=4), "all-to-all"),
    ("zero2", dict(cp=2), "ring"),
    ("zero1", dict(cp=3), "ring"),                       # odd: 3 ranks
    ("ddp", dict(cp=2), "all-to-all"),
    ("zero3", dict(dp_replicate=2, dp_shard=2), "ring"),
    ("zero2", dict(dp_replicate=2, dp_shard=2), "ring"),
    ("zero1", dict(dp_replicate=2, dp_shard=1), "ring"),
    ("zero3", dict(dp_replicate=2, cp=2), "ring"),
    ("zero3", dict(pp=2, cp=2), "ring"),
    ("ddp", dict(tp=2, cp=2), "all-to-all"),
    ("zero3", dict(tp=2, cp=2), "ring", "sp"),          # sequence parallel with tp
    ("ddp", dict(tp=4), "ring", "sp"),
    ("zero2", dict(tp=3), "ring", "sp"),                # odd tp: heads split 2+1+1
    ("ddp", dict(pp=2, tp=2), "ring", "sp"),            # stages pass split rows
    # 8 ranks (their own mpiexec -n 8 leg)
    ("zero3", dict(dp_replicate=2, dp_shard=2, tp=2), "ring", "sp"),
    ("zero2", dict(dp_replicate=2, dp_shard=2, tp=2), "ring"),
    ("ddp", dict(cp=2, tp=2, pp=2), "ring", "sp"),
    ("zero3", dict(cp=2, tp=2, pp=2), "all-to-all"),
]


def _size(sizes: dict) -> int:
    n = 1
    for v in sizes.values():
        n *= v
    return n


def _id(layout):
    strategy, sizes, mode, *sp = layout
    return "-".join([strategy, *(f"{a}{n}" for a, n in sizes.items()),
                     *([mode] if "cp" in sizes else []), *sp])


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
def test_layout_matches_one_process(layout, model):
    strategy, sizes, mode, *sp = layout
    size = _size(sizes)
    if MPI.COMM_WORLD.size < size:
        pytest.skip(f"needs {size} ranks")
    with sub_world(size) as comm:
        if comm is None:
            return
        check_layout(comm, model, strategy, sizes, mode, sp=bool(sp))


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sizes,mode", [(dict(cp=2), "ring"), (dict(cp=4), "all-to-all"),
                                        (dict(dp_replicate=2, dp_shard=1), "ring")],
                         ids=["cp2-ring", "cp4-a2a", "dp2"])
def test_uneven_valid_targets_are_normalised_globally(sizes, mode):
    """Ignored targets fall unevenly over ranks, chunks and micro-batches: the loss is
    still the mean over every valid target of the step (not a mean of means)."""
    size = _size(sizes)
    if MPI.COMM_WORLD.size < size:
        pytest.skip(f"needs {size} ranks")
    with sub_world(size) as comm:
        if comm is None:
            return
        check_layout(comm, "llama", "zero2", sizes, mode, ignored=True)


def test_a_sequence_that_does_not_split_is_refused():
    from mpishard.testing.fake_cupy import make_test_comm
    comm = make_test_comm("one")
    with pytest.raises(ValueError, match="unknown context-parallel mode 'zigzag'"):
        ParallelModel(GPT(MODELS["gpt"][1], materialize_now=False), Mesh(comm),
                      cp_mode="zigzag")
    comm.free()

"""Expert parallelism: experts split over ``ep`` ranks, tokens exchanged all-to-all-v.

Whole models train like one process in float64 (several AdamW steps, two
micro-batches, clipping active, different data per rank) at ep2/ep4, ep2 x dp2
under every strategy, hybrid sharding, ep x tp with sequence parallelism and
ep = cp. A single MoE layer at 2-4 ranks (ep3 included) gives, per rank, what
the whole layer gives on that rank's tokens: the same outputs, the same dropped
tokens under a capacity, and expert gradients equal to the sum over the ep group
of the whole layer's; with every token routed to one expert some ranks send and
receive nothing. The all-to-all-v moves exactly the rows the routing sends off
the rank, checkpoints reshard experts (ep4 -> ep2 and ep1), and the planner's
model state and group traffic are the run's.
"""
import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import Communicator, Mesh
from mpishard.models import GPT, GPTConfig, Llama, LlamaConfig
from parity import sub_world
import test_long_context as lc

lc.MODELS["gpt-moe4"] = (GPT, GPTConfig(vocab_size=37, block_size=lc.SEQ, n_layer=2, n_head=4,
                                        n_embd=12, moe_experts=4, moe_top_k=2, moe_every=1,
                                        moe_aux_coef=0.0, moe_router="sigmoid",
                                        moe_shared_expert=True))
LAYOUTS = [  # strategy, mesh sizes, sequence parallel
    ("ddp", dict(ep=2), False),                          # ep2 x edp2
    ("zero3", dict(ep=2), False),
    ("zero1", dict(ep=4), False),
    ("zero2", dict(dp_replicate=2, ep=2), False),        # hybrid: ep inside dp_shard
    ("zero3", dict(tp=2, ep=2), True),                   # ep2 x tp2, sequence parallel
    ("ddp", dict(cp=2, ep=2), False),                    # ep is the cp group
    ("zero3", dict(cp=2, ep=4), False),                  # ep over dp x cp
    ("zero3", dict(pp=2, ep=2), False),                  # experts on pipeline stages
]


def _id(layout):
    strategy, sizes, sp = layout
    return "-".join([strategy, *(f"{a}{n}" for a, n in sizes.items()), *(["sp"] if sp else [])])


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
@pytest.mark.parametrize("model", ["llama-moe", "gpt-moe4"])
def test_expert_parallel_layouts_train_like_one_process(layout, model):
    strategy, sizes, sp = layout
    if MPI.COMM_WORLD.size != 4:
        pytest.skip("written for 4 ranks")
    lc.check_layout(Communicator(MPI.COMM_WORLD), model, strategy, sizes, sp=sp)


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_mixed_precision_experts_train_at_ep2_as_at_ep1(strategy):
    """bfloat16 compute with float32 masters: ep2 reorders only the sums over rows."""
    from mpishard.parallel import ParallelModel
    from parity import make_optimizer
    if MPI.COMM_WORLD.size != 4:
        pytest.skip("written for 4 ranks")
    world = Communicator(MPI.COMM_WORLD)
    losses = {}
    for ep in (1, 2):
        mesh = Mesh(world, ep=ep)
        run = ParallelModel(Llama(lc.MODELS["llama-moe"][1], materialize_now=False), mesh,
                            strategy=strategy, precision="bfloat16")
        opt = make_optimizer(run.parameters(), run.ledger)
        losses[ep] = []
        for step in range(3):
            x, y = lc.data(step, mesh.dp_rank)
            buf = np.array([run.train_step(x, y)])
            run.step(opt, max_norm=lc.MAX_NORM)
            mesh.dp_cp.all_reduce(buf, op="avg")
            losses[ep].append(buf[0])
        mesh.free()
    assert losses[1][-1] < losses[1][0]
    assert np.max(np.abs(np.subtract(losses[2], losses[1])) / losses[1]) <= 2e-2


EIGHT = [("zero3", dict(dp_replicate=2, dp_shard=2, tp=2, ep=2), True),
         ("zero2", dict(cp=2, tp=2, pp=2, ep=2), False),
         ("ddp", dict(dp=4, tp=2, ep=4), False)]


@pytest.mark.mpi(min_size=8)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", EIGHT, ids=_id)
def test_eight_rank_expert_layouts_train_like_one_process(layout):
    strategy, sizes, sp = layout
    if MPI.COMM_WORLD.size != 8:
        pytest.skip("written for 8 ranks")
    lc.check_layout(Communicator(MPI.COMM_WORLD), "llama-moe", strategy, sizes, sp=sp)


def _layer(seed: int, experts: int, top_k: int, capacity, ep=None):
    from mpishard.models.moe import MoE
    from mpishard.nn import materialize
    from mpishard.parallel.expert.layers import apply_expert_plan
    moe = MoE(6, 5, experts, top_k, capacity, dtype="float64")
    if ep is not None:
        apply_expert_plan(moe, ep)
    materialize(moe, seed)
    return moe


def _run_layer(moe, x):
    from mpishard.autodiff import Tensor
    xt = Tensor(x, requires_grad=True)
    y = moe(xt)
    (y * y).sum().backward()
    grads = {n: p.grad for n, p in moe.named_parameters()}
    return y.data, xt.grad, grads


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("capacity,one_expert", [(None, False), (1.0, False), (0.5, False),
                                                 (None, True)],
                         ids=["dropless", "capacity1", "capacity0.5", "all-to-expert-0"])
def test_a_layer_over_ep_ranks_is_the_whole_layer_on_each_rank_s_tokens(size, capacity,
                                                                         one_expert):
    if MPI.COMM_WORLD.size < size:
        pytest.skip(f"needs {size} ranks")
    with sub_world(size) as comm:
        if comm is None:
            return
        E = 2 * size
        whole = _layer(3, E, 2, capacity)
        split = _layer(3, E, 2, capacity, ep=comm)
        rng = np.random.default_rng(10 + comm.rank)
        x = rng.standard_normal((7 + 3 * comm.rank, 6))      # a different count per rank
        if one_expert:        # every token's first pick is expert 0, its second expert 1
            x = np.abs(x) + 0.1
            for m in (whole, split):
                m.gate.weight.data[...] = 0.0
                m.gate.weight.data[0] = 1.0
                m.gate.weight.data[1] = 0.5
        want_y, want_gx, want_g = _run_layer(whole, x)
        got_y, got_gx, got_g = _run_layer(split, x)
        assert np.array_equal(split.route.kept, whole.route.kept)     # the same rows kept
        assert np.abs(got_y - want_y).max() <= 1e-12 * max(1.0, np.abs(want_y).max())
        assert np.abs(got_gx - want_gx).max() <= 1e-12 * max(1.0, np.abs(want_gx).max())
        lo, hi = comm.rank * 2, comm.rank * 2 + 2
        for name, g in want_g.items():
            if name.startswith("experts."):    # every rank's tokens reach the owner
                total = comm.all_reduce(np.ascontiguousarray(g), op="sum")[lo:hi]
                assert np.abs(got_g[name] - total).max() <= 1e-12 * max(
                    1.0, np.abs(total).max()), name
            else:
                assert np.abs(got_g[name] - g).max() <= 1e-12 * max(1.0, np.abs(g).max())
        sent, received = split.dispatch.last_counts
        if one_expert:   # experts 0 and 1 live on rank 0: the others get nothing
            assert sent[1:] == [0] * (size - 1)
            assert (sum(received) == 0) == (comm.rank > 0)


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(60)
def test_all_to_all_v_with_empty_sends_and_everything_to_one_rank():
    with sub_world(3) as comm:
        if comm is None:
            return
        r = comm.rank
        for counts in ([0, 0, 4 + r], [r, 0, 2 * r], [0, 0, 0]):
            send = np.concatenate([np.full((c, 2), 10 * r + j, np.float32)
                                   for j, c in enumerate(counts)]).reshape(-1, 2)
            everyone = comm.all_gather_obj(counts)
            recv = comm.all_to_all_v(send, counts)
            want = np.concatenate([np.full((everyone[j][r], 2), 10 * j + r, np.float32)
                                   for j in range(3)]).reshape(-1, 2)
            assert np.array_equal(recv, want)
            comm.stats.reset()
            comm.all_to_all_v(send.astype(np.float16), counts,
                              [everyone[j][r] for j in range(3)])
            off = sum(counts) - counts[r]
            assert comm.stats["all_to_all_v"].bus_bytes == off * 2 * 2    # rows x 2 x 2 B
        with pytest.raises(ValueError, match="send_counts add up to 2"):   # on every rank
            comm.all_to_all_v(np.zeros((3, 2)), [1, 1, 0], [1, 1, 1])


def test_all_to_all_v_on_one_rank_and_bad_counts():
    from mpishard.testing.fake_cupy import make_test_comm
    comm = make_test_comm("one")
    send = np.arange(6.0).reshape(3, 2)
    assert np.array_equal(comm.all_to_all_v(send, [3]), send)
    with pytest.raises(ValueError, match="1 non-negative row counts"):
        comm.all_to_all_v(send, [2, 1], [3])
    with pytest.raises(ValueError, match="2 counts for 1 ranks"):
        comm.all_to_all_v(send, [2, 1])
    with pytest.raises(ValueError, match="recv_counts need"):
        comm.all_to_all_v(send, [3], [3], recv=np.zeros((2, 2)))


def test_uneven_experts_and_an_ep_that_does_not_fit_are_refused():
    from mpishard.testing.fake_cupy import make_test_comm
    from mpishard.planning.layout import Layout
    from mpishard.parallel.expert.layers import check_experts_divide
    with pytest.raises(ValueError, match="use an ep that divides 4"):
        check_experts_divide(Llama(lc.MODELS["llama-moe"][1], materialize_now=False), 3)
    with pytest.raises(ValueError, match="ep=2 must be a positive int dividing dp_shard x cp"):
        Mesh(make_test_comm("one"), ep=2)
    with pytest.raises(ValueError, match="pass an ep that divides 2"):
        Layout(dp=2, tp=2, ep=4, seq_len=8)


MOE = LlamaConfig(vocab_size=37, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=16,
                  intermediate_size=12, moe_experts=4, moe_top_k=2, moe_aux_coef=0.0)


def _build(world, sizes, strategy, seed=0):
    from mpishard.parallel import ParallelModel
    from parity import make_optimizer
    run = ParallelModel(Llama(MOE, seed=seed, dtype="float64", materialize_now=False),
                        Mesh(world, **sizes), strategy=strategy, micro_batches=2)
    return run, make_optimizer(run.parameters())


def _step(run, opt, n: int):
    share = 4 // run.mesh.dp.size
    parts = [np.random.default_rng(100 * n + run.mesh.dp_rank * share + k).integers(
        0, 37, (2, 2, 16)) for k in range(share)]
    loss = run.train_step(np.concatenate([p[0] for p in parts]),
                          np.concatenate([p[1] for p in parts]))
    run.step(opt, max_norm=1.0)
    buf = np.array([loss])
    run.mesh.dp_cp.all_reduce(buf, op="avg")
    return buf[0]


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", [(dict(ep=2), "zero2"), (dict(), "ddp")],
                         ids=["ep2-zero2", "ep1-ddp"])
def test_experts_saved_at_ep4_load_at_ep2_and_ep1(target):
    from ckpt_scripts.common import full_tensors, shared_tmp
    from mpishard.checkpoint import load_checkpoint, read_manifest, save_checkpoint
    if MPI.COMM_WORLD.size != 4:
        pytest.skip("written for 4 ranks")
    world = Communicator(MPI.COMM_WORLD)
    with shared_tmp(world) as root:
        a, a_opt = _build(world, dict(ep=4), "zero3")
        assert a.module.model.layers["0"].mlp.experts.gate_up_proj.spec.ep_range == (
            world.rank, world.rank + 1)
        _step(a, a_opt, 0)
        saved = full_tensors(a.strategy, a_opt, world)
        save_checkpoint(root, 1, a.strategy, a_opt)
        assert read_manifest(root / "step-1").mesh["ep"] == 4
        b, b_opt = _build(world, *target, seed=7)
        load_checkpoint(root, b.strategy, b_opt)
        loaded = full_tensors(b.strategy, b_opt, world)
        assert saved.keys() == loaded.keys()
        for key in saved:
            assert np.array_equal(saved[key], loaded[key]), key
        ahead = [_step(a, a_opt, n) for n in (1, 2)]
        other = [_step(b, b_opt, n) for n in (1, 2)]
        assert max(abs(x - y) / x for x, y in zip(ahead, other)) <= 1e-10


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,sizes", [("zero3", dict(ep=2)), ("ddp", dict(ep=4)),
                                            ("zero1", dict(dp_replicate=2, ep=2))])
def test_the_plan_holds_the_run_s_model_state_and_the_exchange_moves_the_routed_rows(
        strategy, sizes):
    from mpishard.optim import AdamW
    from mpishard.parallel import ParallelModel
    from mpishard.planning.layout import Layout, estimate_layout
    if MPI.COMM_WORLD.size != 4:
        pytest.skip("written for 4 ranks")
    world = Communicator(MPI.COMM_WORLD)
    layout = Layout(dp=4, strategy=strategy, batch_size=2, seq_len=16, **sizes)
    plan = estimate_layout(Llama(MOE, materialize_now=False), layout).busiest
    mesh = Mesh(world, **sizes)
    run = ParallelModel(Llama(MOE, materialize_now=False), mesh, strategy)
    opt = AdamW(run.parameters(), lr=1e-3, ledger=run.ledger)
    opt.allocate_state()
    run.ledger.reset_peak()
    comms = mesh.active_axes()
    for comm in comms.values():
        comm.stats.reset()
    x = np.random.default_rng(mesh.dp_rank).integers(0, 37, (2, 16))
    run.train_step(x, x)
    run.step(opt)
    live, peak = run.ledger.bytes_by_category(), run.ledger.peak_by_category()
    for cat, want in plan.memory.steady.items():
        assert live[cat] == want, (cat, live[cat], want)
    for cat, want in plan.memory.peak.items():
        assert peak[cat] == want, (cat, peak[cat], want)
    exchanged = mesh.ep.stats["all_to_all_v"].bus_bytes
    moved = {name: c.stats.total_bus_bytes for name, c in comms.items()}
    moved[mesh.ep.name] -= exchanged + mesh.ep.stats["all_to_all"].bus_bytes
    for name, n in moved.items():      # the gradients' and parameters' collectives
        want = plan.bus_bytes.get(name, 0) - (plan.bus_bytes["ep"] if name == "ep" else 0)
        if name != mesh.ep.name:
            assert n == want, (name, n, want)
    rows = 0          # forward out and back, and both again in backward
    for block in run.module.model.layers.values():
        sent, received = block.mlp.dispatch.last_counts
        r = mesh.ep.rank
        rows += 2 * (sum(sent) - sent[r] + sum(received) - received[r])
    assert exchanged == rows * MOE.n_embd * 4                      # float32 rows


def test_ep_through_the_cli_trains_as_ep1_and_is_planned_and_refused(tmp_path):
    import json

    from ckpt_scripts.common import run_mpishard as mpishard
    common = ("train", "--model", "llama", "--preset", "llama-tiny", "--moe-experts", "4",
              "--dtype", "float64", "--steps", "3", "--max-bytes", "60000", "--eval-batches",
              "1", "--progress", "false")
    losses = {}
    for ep in (1, 2):
        metrics = tmp_path / f"ep{ep}.jsonl"
        out = mpishard(*common, "--ep", str(ep), "--metrics", str(metrics), n=4, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        losses[ep] = [r["loss"] for r in map(json.loads, metrics.read_text().splitlines())
                      if "loss" in r]
    assert len(losses[2]) == 3
    assert np.max(np.abs(np.subtract(losses[2], losses[1])) / np.abs(losses[1])) <= 1e-12
    dry = mpishard(*common, "--ep", "2", "--dry-run", n=4, timeout=200)
    assert dry.returncode == 0, dry.stderr
    assert "experts over ep=2" in dry.stdout and "edp" in dry.stdout
    bad = mpishard(*common, "--ep", "3", n=4, timeout=200)
    assert bad.returncode != 0 and "ep=3" in bad.stderr and "divid" in bad.stderr

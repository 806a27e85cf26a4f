"""Interleaved 1F1B: V model chunks per pipeline rank, against one process and its own plan.

The order each rank runs is checked on its own (Megatron's warm-up counts, every
message received is sent once under a tag of its own, no deadlock and the ideal
bubble (p - 1) / (V m) in an event simulation); then GPT layouts train 6 AdamW
steps in float64 with clipping active and different data per dp rank, and must
equal the single-process reference within 1e-10: pp2 x V2 (DDP and ZeRO-1),
pp4 x V2, pp2 x tp2 x V2 (ZeRO-2), dp2 x pp2 x V2 (ZeRO-1), cp2 x pp2 x V2
(ZeRO-2), and ZeRO-3 at pp2 x V2, dp2 x pp2 x V2, pp4 x V2 and pp2 x tp2 x V2.
Widths divide none of 2, 3, 4. The plan's in-flight chunks and pipeline bytes are
checked against the order by hand. Checkpoints go between interleaved and plain
pipelines.

    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi tests/parallel/test_pipeline_interleaved.py
"""
import dataclasses

import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import Mesh
from mpishard.config.sections import ConfigError, load_config
from mpishard.core.mesh_axes import MeshShape
from mpishard.models import GPT, GPTConfig
from mpishard.parallel import ParallelModel, bubble_fraction, build_stage
from mpishard.parallel.pipeline.chunks import chunk_blocks
from mpishard.parallel.pipeline.order import message_tag, schedule_order, warmup_forwards
from parity import batch, make_optimizer, max_rel_err, reference, sub_world

CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=4, n_head=4, n_embd=12)
DEEP = dataclasses.replace(CFG, n_layer=8)          # pp4 x V2: 8 chunks of one block
DATA_DP, STEPS, MAX_NORM, TOL = 2, 6, 0.5, 1e-10
_REF = {}


# -- the order ------------------------------------------------------------------------
def _simulate(p, m, v, forward=1.0, backward=2.0, schedule="interleaved"):
    """Run every rank's order with forwards and backwards of fixed times per chunk,
    sends that never wait and receives that wait for their message; returns each
    rank's idle time over its busy time (AssertionError on a deadlock)."""
    orders = [schedule_order(schedule, p, r, m, v) for r in range(p)]
    done, pos, free, busy = {}, [0] * p, [0.0] * p, [0.0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            if pos[r] == len(orders[r]):
                continue
            kind, c, i = orders[r][pos[r]]
            s = r + c * p                               # the chunk's stage of p x v
            if kind == "F":
                need, t = (("F", s - 1, i) if s > 0 else None), forward / v
            else:
                need, t = (("B", s + 1, i) if s < p * v - 1 else ("F", s, i)), backward / v
            if need is not None and need not in done:
                continue
            start = max(free[r], done[need] if need else 0.0)
            done[kind, s, i] = free[r] = start + t
            busy[r] += t
            pos[r] += 1
            progress = True
    assert pos == [len(o) for o in orders], f"deadlock at {pos}"
    return [(max(free) - b) / b for b in busy]


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 2), (2, 8, 4), (3, 6, 3), (4, 4, 2),
                                   (4, 8, 2), (4, 16, 4)])
def test_interleaved_order_is_megatrons(p, m, v):
    for r in range(p):
        order = schedule_order("interleaved", p, r, m, v)
        assert sorted(order) == sorted((k, c, i) for k in "BF" for c in range(v)
                                       for i in range(m))
        warmup = warmup_forwards("interleaved", p, r, m, v)
        assert warmup == min(2 * (p - r - 1) + (v - 1) * p, m * v)
        steady = [op[0] for op in order[warmup:]]      # F B F B ..., then the rest B
        n = m * v - warmup
        assert order[:warmup] == [op for op in order if op[0] == "F"][:warmup]
        assert steady == ["F", "B"] * n + ["B"] * warmup
        for c in range(v):       # each chunk takes the micro-batches in order, both ways
            for kind in "FB":
                assert [i for k, cc, i in order if (k, cc) == (kind, c)] == list(range(m))
        # virtual micro-batch k: groups of p micro-batches per chunk (Megatron's ids)
        forwards = [op for op in order if op[0] == "F"]
        assert forwards[:p] == [("F", 0, i) for i in range(p)]
        assert forwards[p:2 * p] == [("F", 1, i) for i in range(p)]
        backwards = [op for op in order if op[0] == "B"]
        assert backwards[0] == ("B", v - 1, 0)


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 2), (2, 8, 4), (3, 6, 3), (4, 8, 2),
                                   (4, 4, 4)])
@pytest.mark.parametrize("backward", [1.0, 2.0])
def test_interleaved_bubble_is_p_minus_1_over_v_m(p, m, v, backward):
    for ratio in _simulate(p, m, v, backward=backward):
        assert ratio == pytest.approx((p - 1) / (v * m), abs=1e-12)
    for ratio in _simulate(p, m, 1, backward=backward, schedule="1f1b"):
        assert ratio == pytest.approx((p - 1) / m, abs=1e-12)
    idle_share = bubble_fraction(p, m, v)
    assert idle_share / (1 - idle_share) == pytest.approx((p - 1) / (v * m))


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 3), (3, 3, 2), (4, 8, 2)])
def test_every_message_has_one_sender_and_a_tag_of_its_own(p, m, v):
    sent, received = [], []
    for r in range(p):
        for kind, c, i in schedule_order("interleaved", p, r, m, v):
            s = r + c * p
            first, last = s == 0, s == p * v - 1
            up, down = (r + 1) % p, (r - 1) % p
            if kind == "F":
                if not first:
                    received.append((down, r, message_tag(r, c, i, m, False, True)))
                if not last:
                    sent.append((r, up, message_tag(r, c, i, m, False, False)))
            else:
                if not last:
                    received.append((up, r, message_tag(r, c, i, m, True, False)))
                if not first:
                    sent.append((r, down, message_tag(r, c, i, m, True, True)))
    assert len(set(sent)) == len(sent) == 2 * (p * v - 1) * m
    assert sorted(sent) == sorted(received)


def test_chunks_and_refusals():
    assert chunk_blocks(8, 2, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match="n_layer = 6 blocks do not split into pp x "
                                         "virtual_stages = 2 x 2 = 4 equal chunks"):
        chunk_blocks(6, 2, 2)
    with pytest.raises(ValueError, match="not a multiple of 2"):
        schedule_order("interleaved", 2, 0, 3, 2)
    with pytest.raises(ValueError, match="need the 'interleaved' schedule"):
        schedule_order("1f1b", 2, 0, 4, 2)


@pytest.mark.parametrize("flags,message", [
    (dict(pp=2, pipeline_schedule="interleaved", virtual_stages=2, n_layer=6, micro_steps=2,
          strategy="zero1"),
     "n_layer = 6 blocks do not split into pp x virtual_stages = 2 x 2 = 4 equal model "
     "chunks of at least one block; use --virtual-stages 3"),
    (dict(pp=2, pipeline_schedule="interleaved", virtual_stages=2, n_layer=3, micro_steps=2,
          strategy="zero1"), "use an n_layer that is a multiple of pp x virtual_stages"),
    (dict(pp=2, virtual_stages=2, n_layer=4, micro_steps=2),
     "virtual_stages = 2: model chunks need --pipeline-schedule interleaved"),
    (dict(pp=2, pipeline_schedule="interleaved", n_layer=4, micro_steps=2, strategy="ddp"),
     "needs --pp and --virtual-stages of 2 or more"),
    (dict(pp=2, pipeline_schedule="interleaved", virtual_stages=2, n_layer=4, micro_steps=3,
          strategy="ddp"), "micro_steps = 3: .* use --micro-steps 4"),
])
def test_config_refuses_what_cannot_interleave(flags, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, {"n_head": 2, "n_embd": 8, **flags})


def test_interleaved_config_is_accepted():
    for strategy in ("zero2", "zero3"):
        cfg = load_config(None, {"pp": 2, "pipeline_schedule": "interleaved",
                                 "virtual_stages": 2, "n_layer": 4, "n_head": 2, "n_embd": 8,
                                 "micro_steps": 4, "strategy": strategy})
        assert (cfg.parallel.pipeline_schedule, cfg.parallel.virtual_stages) == \
            ("interleaved", 2)


def test_a_global_batch_decides_the_micro_steps_the_schedule_is_checked_with():
    """``--global-batch`` sets the micro-steps once the dp size is known: the configuration
    does not refuse the default micro-steps meanwhile (it did, asking for a --micro-steps
    that the global batch then overrides), and the trainer's check names the global batch."""
    from mpishard.config.support import check_supported
    from mpishard.run.train import resolve_global_batch

    flags = {"pp": 2, "pipeline_schedule": "interleaved", "virtual_stages": 2, "n_layer": 4,
             "n_head": 2, "n_embd": 8, "strategy": "zero1", "batch_size": 4}
    cfg = load_config(None, {**flags, "global_batch": 16})
    resolve_global_batch(cfg, 1)
    assert cfg.optim.micro_steps == 4 and check_supported(cfg, resolved=True) == []
    cfg = load_config(None, {**flags, "global_batch": 12})
    resolve_global_batch(cfg, 1)
    with pytest.raises(ConfigError, match=r"global_batch = 12 gives micro_steps = 3: .* use "
                                          r"--global-batch 16 \(4 micro-steps"):
        check_supported(cfg, resolved=True)


def test_chunks_keep_the_global_names():
    whole = {n for n, _ in GPT(CFG, materialize_now=False).named_parameters()}
    held, replicas = set(), set()
    for r in range(2):
        chunks = build_stage(GPT(CFG, materialize_now=False), MeshShape(pp=2, world_rank=r),
                             virtual_stages=2)
        names = dict(chunks.named_parameters())
        assert [b for b in chunks.transformer.h] == [str(r), str(r + 2)]   # stages r, r + 2
        assert [u for u in chunks.parallel_plan().units] == [f"transformer.h.{r}",
                                                             f"transformer.h.{r + 2}"]
        for c, chunk in enumerate(chunks.chunks):   # each chunk's names, its own stage
            for name, p in chunk.named_parameters():
                assert names[name] is p and p.spec.pp_stage == r + 2 * c
        held |= set(names)
        replicas |= {n for n, p in names.items() if p.spec.replica}
        assert chunks.first_stage == (r == 0) and chunks.last_stage == (r == 1)
    assert held == whole and replicas == {"transformer.wte.weight"}


def test_bad_arguments_raise_before_building():
    model = GPT(CFG, materialize_now=False)
    with pytest.raises(ValueError, match="virtual_stages = 2 needs the interleaved"):
        ParallelModel(model, MeshShape(pp=2), "ddp", micro_batches=2, virtual_stages=2)
    with pytest.raises(ValueError, match="micro_batches = 3 is not a multiple of 2"):
        ParallelModel(model, MeshShape(pp=2), "ddp", micro_batches=3, schedule="interleaved",
                      virtual_stages=2)


# -- against one process --------------------------------------------------------------
def _reference(cfg):
    key = cfg.n_layer
    if key not in _REF:
        _REF[key] = reference(DATA_DP, STEPS, 1, "float64", MAX_NORM, cfg)
    return _REF[key]


def _batch(step, dp_rank, dp, cfg):
    share = DATA_DP // dp          # data of `share` reference ranks per dp rank
    parts = [batch(step, 0, dp_rank * share + k, cfg) for k in range(share)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _build(comm, dp, tp, pp, strategy, micro, v, cfg, schedule="interleaved", cp=1):
    mesh = Mesh(comm, dp=dp, tp=tp, pp=pp, cp=cp)
    run = ParallelModel(GPT(cfg, dtype="float64", materialize_now=False), mesh,
                        strategy=strategy, micro_batches=micro, schedule=schedule,
                        virtual_stages=v)
    return mesh, run, make_optimizer(run.parameters(), run.ledger)


def _train(mesh, run, opt, steps, cfg, dp, first=0):
    losses = []
    for step in range(first, first + steps):
        loss = run.train_step(*_batch(step, mesh.dp.rank, dp, cfg))
        result = run.step(opt, max_norm=MAX_NORM)
        assert not result.skipped and result.grad_norm > MAX_NORM   # clipping is active
        buf = np.array([loss])
        mesh.dp_cp.all_reduce(buf, op="avg")
        losses.append(buf[0])
    return np.array(losses)


LAYOUTS = [  # (dp, tp, pp, cp, strategy, micro-batches, V, config)
    (1, 1, 2, 1, "ddp", 2, 2, CFG),
    (1, 1, 2, 1, "zero1", 4, 2, CFG),
    (1, 1, 4, 1, "ddp", 4, 2, DEEP),
    (1, 2, 2, 1, "zero2", 2, 2, CFG),
    (2, 1, 2, 1, "zero1", 2, 2, CFG),
    (1, 1, 2, 2, "zero2", 2, 2, CFG),   # context parallel: each chunk's attention over cp
    (1, 1, 2, 1, "zero3", 4, 2, CFG),   # ZeRO-3: the root gathered across chunk calls
    (2, 1, 2, 1, "zero3", 2, 2, CFG),
    (1, 1, 4, 1, "zero3", 4, 2, DEEP),
    (1, 2, 2, 1, "zero3", 2, 2, CFG),
]


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS,
                         ids=lambda l: "dp{}-tp{}-pp{}-cp{}-{}-m{}-V{}".format(*l[:7]))
def test_interleaved_matches_single_process(layout):
    dp, tp, pp, cp, strategy, micro, v, cfg = layout
    size = dp * tp * pp * cp
    if MPI.COMM_WORLD.size < size:
        pytest.skip(f"needs {size} ranks")
    with sub_world(size) as comm:
        if comm is None:
            return
        ref_losses, ref_params = _reference(cfg)
        mesh, run, opt = _build(comm, dp, tp, pp, strategy, micro, v, cfg, cp=cp)
        assert len(run.module.chunks) == v
        losses = _train(mesh, run, opt, STEPS, cfg, dp)
        assert float(np.max(np.abs(losses - ref_losses) / ref_losses)) <= TOL
        params = run.gather_full_params()
        assert set(params) == set(ref_params)
        assert max_rel_err(params, ref_params) <= TOL
        # evaluation runs the same forwards without a graph: the loss of the next batch
        x, y = _batch(STEPS, mesh.dp.rank, dp, cfg)
        loss = np.array([run.eval_step(x, y)])
        mesh.dp_cp.all_reduce(loss, op="avg")
        model = GPT(cfg, dtype="float64")
        model.load_state_dict(params, strict=False)
        _, want = model(*_batch(STEPS, 0, 1, cfg))          # the whole batch, one process
        assert abs(loss[0] - want.item()) <= TOL * want.item()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_checkpoints_go_between_interleaved_and_plain_pipelines(tmp_path_factory):
    from mpishard.checkpoint import load_checkpoint, save_checkpoint

    with sub_world(2) as comm:
        if comm is None:
            return
        root = comm.broadcast_obj(str(tmp_path_factory.mktemp("vpp")) if comm.rank == 0
                                  else None)
        # interleaved: 3 steps, save, 3 more; a plain 1F1B pipeline resumes the save
        mesh, run, opt = _build(comm, 1, 1, 2, "zero1", 2, 2, CFG)
        _train(mesh, run, opt, 3, CFG, 1)
        save_checkpoint(root, 3, run.strategy, opt, world=comm)
        want = _train(mesh, run, opt, 3, CFG, 1, first=3)
        mesh, plain, opt = _build(comm, 1, 1, 2, "ddp", 2, 1, CFG, schedule="1f1b")
        load_checkpoint(root, plain.strategy, opt, world=comm)
        got = _train(mesh, plain, opt, 3, CFG, 1, first=3)
        assert float(np.max(np.abs(got - want) / want)) <= TOL
        # ... and the plain pipeline's save loads into the interleaved one, value for value
        save_checkpoint(root, 6, plain.strategy, opt, world=comm)
        mesh, run, opt = _build(comm, 1, 1, 2, "zero2", 2, 2, CFG)
        load_checkpoint(root, run.strategy, opt, world=comm)
        a, b = plain.gather_full_params(), run.gather_full_params()
        assert set(a) == set(b) and all(np.array_equal(a[n], b[n]) for n in a)
        # ... whose own save loads without a pipeline (pp = 1, dp = 2) too
        save_checkpoint(root, 7, run.strategy, opt, world=comm)
        mesh, flat, opt = _build(comm, 2, 1, 1, "zero1", 1, 1, CFG, schedule="1f1b")
        load_checkpoint(root, flat.strategy, opt, world=comm)
        c = flat.gather_full_params()
        assert set(c) == set(b) and all(np.array_equal(c[n], b[n]) for n in b)


def test_plan_counts_each_chunk_while_its_forward_waits_for_its_backward():
    from mpishard.planning.layout import Layout, estimate_layout, mesh_shape

    layout = Layout(pp=2, strategy="zero1", batch_size=2, seq_len=8, micro_batches=4,
                    schedule="interleaved", virtual_stages=2)
    plan = estimate_layout(GPT(CFG, materialize_now=False), layout)
    plain = estimate_layout(GPT(CFG, materialize_now=False),
                            dataclasses.replace(layout, schedule="1f1b", virtual_stages=1))
    # warm-up 2 (p - s - 1) + (V - 1) p forwards, then one more before the first backward
    assert [s.micro_batches_alive for s in plan.stages] == [5, 3]
    assert [s.micro_batches_alive for s in plain.stages] == [2, 1]
    for s, stage in enumerate(plan.stages):
        chunks = build_stage(GPT(CFG, materialize_now=False), mesh_shape(layout, s),
                             virtual_stages=2).chunks
        kept = [c.activation_bytes(2, 8, np.dtype("float32")) for c in chunks]
        # by hand, from the orders: rank 0 F00 F01 F10 F11 F02 B10 F03 B11 F12 B00 F13 ...
        # holds 3 + 2 then 4 + 1 forwards of chunks 0 + 1; rank 1 F00 F01 F10 B10 F11 B11
        # F02 B00 F03 ... holds 2 + 1, then 3 + 0
        want = max(3 * kept[0] + 2 * kept[1], 4 * kept[0] + kept[1]) if s == 0 else \
            max(2 * kept[0] + kept[1], 3 * kept[0])
        assert stage.activation_bytes == want
        # every chunk boundary a rank touches, each way, for each of the m = 4
        # micro-batches: 1 + 2 on rank 0 (the first chunk has no stage before it), 2 + 1
        # on rank 1 (the last none after it); plus the loss broadcast
        one = 2 * 8 * CFG.n_embd * 4
        assert stage.bus_bytes["pp"] == 2 * 3 * one * 4 + 8

"""Optimizer offload (``offload="optimizer"``, ``--offload optimizer``): float32 masters and
optimizer state in host memory, updated there.

On NumPy the host's arithmetic is the device's, so a run with offload must give the
same bits as one without: losses, gradient norms, skip decisions, loss scale and
parameters, over clipping, accumulation, skipped float16 steps and checkpoints saved
with offload and loaded without (and back), at 1-4 ranks (sub-communicators of the
world, so the 4-rank leg covers 3) with different data on every rank. On the
CuPy-strict module (device and host memory apart) the device's ledger loses the
optimizer state and the separate float32 masters, and the host's holds them.
"""
import math

import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import Communicator, Mesh
from mpishard.core.backend import Backend, to_numpy
from mpishard.models import GPT
from mpishard.parallel import DataParallel, ParallelModel, Precision, ZeRO
from mpishard.parallel.strategy import Strategy

import parity

STEPS, ACCUM, MAX_NORM = 4, 2, 0.05      # every step clips (gradient norms are ~1)
KINDS = ["ddp", "zero1", "zero2", "zero3"]


def build(kind: str, comm, offload=None, dtype="float64", precision=None, backend=None):
    mesh = Mesh(comm, dp=comm.size)
    if kind == "ddp":
        model = GPT(parity.UNEVEN, seed=0, dtype=dtype, backend=backend)
        return DataParallel(model, mesh, precision=precision, offload=offload)
    stage = int(kind[-1])
    model = GPT(parity.UNEVEN, seed=0, dtype=dtype, backend=backend,
                materialize_now=stage != 3)
    return ZeRO(model, mesh, stage=stage, precision=precision, offload=offload)


def train(strategy, opt, dp_rank: int, steps: int, first: int = 0, poison=None):
    """``steps`` steps from step ``first``, this rank's data: per step (mean loss over dp,
    gradient norm, skipped, loss scale after). ``poison``: step -> rank whose loss
    becomes inf there."""
    record = []
    for step in range(first, first + steps):
        total = 0.0
        for micro, ctx in enumerate(strategy.accumulation(ACCUM)):
            with ctx:
                _, loss = strategy(*parity.batch(step, micro, dp_rank))
                if poison and poison.get(step) == strategy.dp.rank and micro == 0:
                    loss = loss * float("inf")
                (strategy.scale_loss(loss) * (1.0 / ACCUM)).backward()
                total += loss.item() / ACCUM
        result = strategy.step(opt, max_norm=MAX_NORM)
        buf = np.array([total])
        strategy.dp.all_reduce(buf, op="avg")
        record.append((buf[0], result.grad_norm, result.skipped, strategy.scaler.scale))
    return record


def assert_same_run(a, b, params_a, params_b):
    assert len(a) == len(b)
    for (la, na, sa, ka), (lb, nb, sb, kb) in zip(a, b):
        assert (sa, ka) == (sb, kb)
        assert la == lb or (math.isnan(la) and math.isnan(lb))
        assert na == nb or not (math.isfinite(na) or math.isfinite(nb))
    assert params_a.keys() == params_b.keys()
    for name in params_a:
        np.testing.assert_array_equal(params_a[name], params_b[name], err_msg=name)


def assert_offloaded(strategy, opt):
    """The optimizer's targets and state are host arrays the ledger counts as host
    memory; the model computes with device arrays (NumPy here) that are other arrays."""
    ledger = strategy.ledger
    assert opt.state and all(isinstance(t.data, np.ndarray) and ledger.on_host(t.data)
                             for t in opt.params)
    assert all(ledger.on_host(a) for slot in opt.state for a in slot.values())
    assert ledger.bytes_by_category()["optim"] == 0
    model_arrays = {id(p.data) for p in strategy.module.parameters()}
    assert not any(id(t.data) in model_arrays for t in opt.params)


def on_and_off(size: int, kind: str, offload_mode: str = "optimizer", **options):
    """``kind`` trained on ``size`` ranks without and with offload (``offload_mode``):
    ``[(record, params, strategy, optimizer)]`` for each, on the ranks of the sub-world
    (``None`` elsewhere)."""
    if size > MPI.COMM_WORLD.size:
        pytest.skip(f"needs {size} ranks")
    with parity.sub_world(size) as comm:
        if comm is None:
            return None
        runs = []
        for offload in (None, offload_mode):
            strategy = build(kind, comm, offload, **options)
            opt = parity.make_optimizer(strategy.parameters(), strategy.ledger)
            record = train(strategy, opt, comm.rank, STEPS)
            runs.append((record, strategy.gather_full_params(), strategy, opt))
        return runs


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_float64_with_offload_is_bit_identical(size, kind):
    runs = on_and_off(size, kind)
    if runs is None:
        return
    (plain, plain_params, _, _), (offloaded, offloaded_params, strategy, opt) = runs
    assert_offloaded(strategy, opt)
    assert all(norm > MAX_NORM for _, norm, _, _ in plain)     # clipping was on
    assert_same_run(plain, offloaded, plain_params, offloaded_params)


def assert_params_offloaded(strategy):
    """Parameter offload: every unit's gathered shard is a host array, released from the
    device between uses (no unit is left gathered after a step)."""
    ledger = strategy.ledger
    for unit in strategy.units:
        assert unit.offloaded and ledger.on_host(unit.compute_shard), unit.label
        assert unit.full is None, unit.label


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_float64_with_parameter_offload_is_bit_identical(size):
    runs = on_and_off(size, "zero3", "params")
    if runs is None:
        return
    (plain, plain_params, _, _), (offloaded, offloaded_params, strategy, opt) = runs
    assert_offloaded(strategy, opt)
    assert_params_offloaded(strategy)
    assert all(norm > MAX_NORM for _, norm, _, _ in plain)     # clipping was on
    assert_same_run(plain, offloaded, plain_params, offloaded_params)


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,mode", [("ddp", "optimizer"), ("zero1", "optimizer"),
                                       ("zero3", "optimizer"), ("zero3", "params")])
@pytest.mark.parametrize("size", [2, 4])
def test_bfloat16_with_offload_is_bit_identical(size, kind, mode):
    runs = on_and_off(size, kind, mode, dtype="float32", precision="bfloat16")
    if runs is None:
        return
    (plain, plain_params, _, _), (offloaded, offloaded_params, strategy, _) = runs
    assert {p.data.dtype.name for p in strategy.module.parameters()} == {"bfloat16"}
    assert_same_run(plain, offloaded, plain_params, offloaded_params)


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("kind,mode", [("ddp", "optimizer"), ("zero1", "optimizer"),
                                       ("zero3", "optimizer"), ("zero3", "params")])
def test_float16_skipped_steps_are_the_same_with_offload(kind, mode):
    """A dynamic scale that starts far too high (the first steps overflow and are
    skipped on every rank), then an inf on one rank: the same skips, scales and bits."""
    world = Communicator(MPI.COMM_WORLD)
    policy = Precision("float16", loss_scale="dynamic", init_scale=2.0 ** 22, growth_interval=2)
    runs = []
    for offload in (None, mode):
        strategy = build(kind, world, offload, dtype="float32", precision=policy)
        opt = parity.make_optimizer(strategy.parameters(), strategy.ledger)
        record = train(strategy, opt, world.rank, 8, poison={6: world.size - 1})
        runs.append((record, strategy.gather_full_params()))
        skipped = [s for _, _, s, _ in record]
        assert skipped[0] and skipped[6] and not all(skipped), skipped
    assert_same_run(runs[0][0], runs[1][0], runs[0][1], runs[1][1])


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,mode", [("ddp", "optimizer"), ("zero1", "optimizer"),
                                       ("zero3", "optimizer"), ("zero3", "params")])
def test_a_checkpoint_moves_between_offload_on_and_off(kind, mode, tmp_path_factory):
    """Two steps, a save, a load into a fresh strategy and optimizer with offload the
    other way, two more steps: the four steps of an uninterrupted run, bit for bit."""
    from mpishard.checkpoint import load_checkpoint, save_checkpoint

    world = Communicator(MPI.COMM_WORLD)
    root = world.broadcast_obj(str(tmp_path_factory.mktemp("offload"))
                               if world.rank == 0 else None)
    whole = build(kind, world)
    opt = parity.make_optimizer(whole.parameters(), whole.ledger)
    want = train(whole, opt, world.rank, 4)
    want_params = whole.gather_full_params()
    for first, then in ((None, mode), (mode, None)):
        folder = f"{root}/{first or 'none'}"
        saved = build(kind, world, first)
        opt = parity.make_optimizer(saved.parameters(), saved.ledger)
        record = train(saved, opt, world.rank, 2)
        save_checkpoint(folder, 2, saved, opt, world=world)
        loaded = build(kind, world, then)
        opt = parity.make_optimizer(loaded.parameters(), loaded.ledger)
        load_checkpoint(folder, loaded, opt, world=world)
        assert opt.step_count == 2
        record += train(loaded, opt, world.rank, 2, first=2)
        assert_same_run(want, record, want_params, loaded.gather_full_params())


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", [None, "float16"])
@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero3"])
def test_device_bytes_fall_on_the_strict_module(kind, precision):
    """The device keeps no optimizer state and no separate float32 master; the host
    holds the masters, their state and a gradient copy; training still tracks the run
    without offload (the strict module's device Adam sums in another order: rounding)."""
    world = Communicator(MPI.COMM_WORLD)
    runs = {}
    for offload in (None, "optimizer"):
        strategy = build(kind, world, offload, dtype="float32", precision=precision,
                         backend=Backend.resolve("strict"))
        opt = parity.make_optimizer(strategy.parameters(), strategy.ledger)
        opt.allocate_state()
        record = train(strategy, opt, world.rank, 2)
        runs[offload] = (strategy, opt, record, strategy.gather_full_params())
    plain, offloaded = runs[None][0].ledger, runs["optimizer"][0].ledger
    masters = sum(t.data.size for t in runs["optimizer"][1].params)   # this rank's elements
    before, after = plain.bytes_by_category(), offloaded.bytes_by_category()
    assert before["optim"] == 8 * masters and after["optim"] == 0
    assert before["params"] - after["params"] == (4 * masters if precision else 0)
    # a ZeRO unit's reduced gradient shard lands in host memory; DDP's buckets stay on the
    # device, and so does stage 1's full buffer, which without offload is all it keeps
    # between steps (its shard exists at the step alone; on one rank it *is* the buffer)
    moved = sum(4 * u.layout.shard_size for u in getattr(runs[None][0], "units", ())
                if not u.aliased and not u.shard_at_step)
    assert before["grads"] - after["grads"] == moved
    assert offloaded.host_bytes_by_category() == {**{c: 0 for c in after},
                                                  "params": 4 * masters,
                                                  "grads": 4 * masters, "optim": 8 * masters}
    assert not any(plain.host_bytes_by_category().values())
    assert all(isinstance(t.data, np.ndarray) for t in runs["optimizer"][1].params)
    assert all(not isinstance(p.data, np.ndarray)
               for p in runs["optimizer"][0].module.parameters())
    (_, _, want, want_params), (_, _, got, got_params) = runs[None], runs["optimizer"]
    assert [r[2:] for r in got] == [r[2:] for r in want]
    np.testing.assert_allclose([r[0] for r in got], [r[0] for r in want], rtol=1e-5)
    tol = 1e-5 if precision is None else 3 * 2.0 ** -11
    assert parity.max_rel_err(got_params, want_params, norm="2") <= tol
    for name, value in got_params.items():
        assert np.isfinite(to_numpy(value)).all(), name


@pytest.mark.parametrize("precision", [None, "bfloat16"])
def test_ddp_offload_builds_within_its_model_state(precision):
    """Building DDP with offload never holds more device bytes than its model state
    afterwards, the plan's device rows: a budget of those bytes is enough (the gradient
    buffer came before the materialised parameters were released: 1.5x in float32)."""
    strategy = build("ddp", Communicator(MPI.COMM_SELF), "optimizer", dtype="float32",
                     precision=precision)
    ledger = strategy.ledger
    assert ledger.peak_total == ledger.total == sum(ledger.bytes_by_category().values())


def test_bad_offload_values_and_strategies_are_refused_with_the_fix():
    comm = Communicator(MPI.COMM_SELF)
    with pytest.raises(ValueError, match=r"offload='cpu' is not one of none, optimizer, "
                                         r"params"):
        build("ddp", comm, "cpu")
    for kind in ("ddp", "zero1", "zero2"):
        with pytest.raises(ValueError, match=r"cannot offload its parameters \(offload="
                                             r"'params'\): only ZeRO-3 .* use --strategy "
                                             r"zero3, or offload='optimizer'"):
            build(kind, comm, "params")

    class Plain(Strategy):        # a strategy that does not offload
        pass

    from mpishard.parallel.offload import check_offload
    with pytest.raises(ValueError, match=r"Plain cannot offload its optimizer \(offload="
                                         r"'optimizer'\); use DataParallel or ZeRO"):
        check_offload("optimizer", Plain)
    assert not check_offload("none", Plain) and not check_offload(None, Plain)
    run = ParallelModel(GPT(parity.UNEVEN, materialize_now=False), Mesh(comm, dp=1),
                        strategy="zero2", offload="optimizer")
    assert run.strategy.offload and all(run.ledger.on_host(t.data) for t in run.parameters())


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dims,kind", [(dict(dp=2, tp=2, pp=1), "zero3"),
                                       (dict(dp=2, tp=1, pp=2), "zero1"),
                                       (dict(dp=1, tp=2, pp=2), "ddp")])
def test_offload_composes_with_tensor_and_pipeline_parallelism(dims, kind):
    """ParallelModel on 4 ranks, float64, 2 micro-batches: bit-identical with and
    without offload."""
    world = Communicator(MPI.COMM_WORLD)
    if world.size != 4:
        pytest.skip("needs 4 ranks")
    runs = []
    for offload in (None, "optimizer"):
        mesh = Mesh(world, **dims)
        run = ParallelModel(GPT(parity.UNEVEN, dtype="float64", materialize_now=False), mesh,
                            strategy=kind, micro_batches=2, offload=offload)
        opt = parity.make_optimizer(run.parameters(), run.ledger)
        record = []
        for step in range(3):
            loss = run.train_step(*parity.batch(step, 0, mesh.dp.rank, size=4))
            result = run.step(opt, max_norm=MAX_NORM)
            record.append((loss, result.grad_norm, result.skipped, 1.0))
        runs.append((record, run.gather_full_params()))
    assert_same_run(runs[0][0], runs[1][0], runs[0][1], runs[1][1])


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", [None, "bfloat16"])
def test_parameter_offload_leaves_the_device_no_model_state(precision):
    """ZeRO-3 on the CuPy-strict module: with ``offload="params"`` the device holds no
    model state between steps (the gathered units are released, the shards are host
    arrays, and so are the gradient shards each reduction lands in); the host holds the
    master (4 bytes per element of this rank's shard), the 16-bit copy that is gathered
    (2, mixed precision only), the gradient shard (4) and AdamW's state (8). Training
    tracks the run without offload (the strict module's device Adam sums in another
    order: rounding)."""
    world = Communicator(MPI.COMM_WORLD)
    runs = {}
    for offload in (None, "params"):
        strategy = build("zero3", world, offload, dtype="float32", precision=precision,
                         backend=Backend.resolve("strict"))
        opt = parity.make_optimizer(strategy.parameters(), strategy.ledger)
        opt.allocate_state()
        record = train(strategy, opt, world.rank, 2)
        runs[offload] = (strategy, opt, record, strategy.gather_full_params())
    offloaded, opt = runs["params"][0], runs["params"][1]
    assert_params_offloaded(offloaded)
    shard = sum(t.data.size for t in opt.params)        # this rank's elements
    device, host = offloaded.ledger.bytes_by_category(), offloaded.ledger.host_bytes_by_category()
    assert device["params"] == device["grads"] == device["optim"] == 0
    assert runs[None][0].ledger.bytes_by_category()["params"] == (6 if precision else 4) * shard
    assert host == {**{c: 0 for c in host}, "params": (6 if precision else 4) * shard,
                    "grads": 4 * shard, "optim": 8 * shard}
    (_, _, want, want_params), (_, _, got, got_params) = runs[None], runs["params"]
    assert [r[2:] for r in got] == [r[2:] for r in want]
    np.testing.assert_allclose([r[0] for r in got], [r[0] for r in want], rtol=1e-5)
    tol = 1e-5 if precision is None else 3 * 2.0 ** -8
    assert parity.max_rel_err(got_params, want_params, norm="2") <= tol


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_zero1_bfloat16_with_offload_keeps_four_bytes_per_parameter_on_the_device():
    """ZeRO-1, bfloat16 weights and gradients (``reduce_dtype="bfloat16"``), optimizer
    offload, on the CuPy-strict module: the device's model state is the 16-bit
    parameters and the 16-bit full gradients, 2 + 2 bytes per (padded) parameter; the
    float32 masters, the reduced gradient shards and AdamW's state are host arrays."""
    world = Communicator(MPI.COMM_WORLD)
    policy = Precision("bfloat16", reduce_dtype="bfloat16")
    strategy = build("zero1", world, "optimizer", dtype="float32", precision=policy,
                     backend=Backend.resolve("strict"))
    opt = parity.make_optimizer(strategy.parameters(), strategy.ledger)
    record = train(strategy, opt, world.rank, 2)
    assert all(math.isfinite(loss) for loss, _, _, _ in record)
    padded = sum(u.layout.padded for u in strategy.units)     # the model, padded per unit
    device = strategy.ledger.bytes_by_category()
    assert device["params"] == device["grads"] == 2 * padded
    assert device["optim"] == 0
    shard = sum(t.data.size for t in opt.params)
    host = strategy.ledger.host_bytes_by_category()
    assert (host["params"], host["grads"], host["optim"]) == (4 * shard, 4 * shard, 8 * shard)

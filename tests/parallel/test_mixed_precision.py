"""Mixed precision: 16-bit compute, float32 masters, loss scaling.

The reference applies the same casts by hand in one process: float32 masters,
a 16-bit copy that each dp rank's micro-batches run forward and backward on
(loss times the scale), each micro-batch's 16-bit gradients added to float32
sums, averaged over ranks, unscaled and clipped, and AdamW on the
masters. At dp 1 and 2 the strategies agree with it to float32 rounding, judged per
tensor in the 2-norm as in tests/parity.py. At dp 3 and 4 MPI adds the ranks'
gradients in its own order, so the float32 masters differ from the reference
by an ulp after the first step, and an ulp of float32 is enough to round a
16-bit copy the other way: one 16-bit ulp (2**-11 for float16, 2**-8 for
bfloat16). From then on the two runs agree to 16-bit rounding, which is the
bound used there (3 ulps). That the reduction itself runs in float32 is
checked by bytes, in test_parallel_memory.py.
"""
import math

import numpy as np
import pytest
from mpi4py import MPI

from mpishard.core.backend import to_numpy, xp_of
from mpishard.comm import Communicator, Mesh
from mpishard.core.dtypes import resolve_dtype
from mpishard.models import GPT
from mpishard.optim.clip import clip_coefficient
from mpishard.parallel import DataParallel, LossScaler, Precision, ZeRO
from mpishard.planning.memory import estimate_memory

import parity

STEPS, ACCUM, MAX_NORM = 4, 2, 0.5


def reference(precision: str, dp_size: int, backend=None):
    """Losses and float32 masters after STEPS steps, with the strategies' casts done by hand."""
    policy = Precision.of(precision)
    low = resolve_dtype(policy.param_dtype)
    scaler = LossScaler(policy)
    model = GPT(parity.UNEVEN, seed=0, backend=backend)
    named = list(model.named_parameters())
    masters = {n: p.data.copy() for n, p in named}
    for _, p in named:  # every gradient contribution is added in float32
        p.grad_dtype = np.dtype(np.float32)
    targets = [_Target(masters[n], p.decay_ranges) for n, p in named]
    opt = parity.make_optimizer(targets)
    losses = []
    for step in range(STEPS):
        for n, p in named:
            p.data = masters[n].astype(low)
        total = {n: xp_of(masters[n]).zeros_like(masters[n]) for n, _ in named}
        loss_sum = 0.0
        for rank in range(dp_size):
            model.zero_grad()
            for micro in range(ACCUM):
                _, loss = model(*parity.batch(step, micro, rank))
                (loss * scaler.scale * (1.0 / ACCUM)).backward()
                loss_sum += loss.item() / ACCUM
            for n, p in named:
                total[n] += p.grad.astype(np.float32)
        grads = {n: g * (1.0 / dp_size) for n, g in total.items()}
        sq = sum(float(xp_of(g).dot(g.reshape(-1).astype(np.float64), g.reshape(-1)))
                 for g in grads.values())
        norm = math.sqrt(sq) / scaler.scale
        if math.isfinite(norm):
            factor = clip_coefficient(norm, MAX_NORM) / scaler.scale
            for t, (n, _) in zip(targets, named):
                t.grad = (grads[n] * factor).reshape(-1)
            opt.step()
        scaler.update(not math.isfinite(norm))
        losses.append(loss_sum / dp_size)
    return np.array(losses), {n: to_numpy(m) for n, m in masters.items()}


class _Target:
    def __init__(self, array, decay_ranges):
        self.data, self.grad, self.decay_ranges = array.reshape(-1), None, decay_ranges


def wrap(kind: str, mesh, precision, backend=None):
    if kind == "ddp":
        return DataParallel(GPT(parity.UNEVEN, seed=0, backend=backend), mesh,
                            precision=precision)
    stage = int(kind[-1])
    return ZeRO(GPT(parity.UNEVEN, seed=0, backend=backend, materialize_now=stage != 3), mesh,
                stage=stage, precision=precision)


def train(strategy, dp_rank: int):
    opt = parity.make_optimizer(strategy.parameters(), strategy.ledger)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro, ctx in enumerate(strategy.accumulation(ACCUM)):
            with ctx:
                _, loss = strategy(*parity.batch(step, micro, dp_rank))
                (strategy.scale_loss(loss) * (1.0 / ACCUM)).backward()
                total += loss.item() / ACCUM
        strategy.step(opt, max_norm=MAX_NORM)
        buf = np.array([total])
        strategy.dp.all_reduce(buf, op="avg")
        losses.append(buf[0])
    return np.array(losses), strategy.gather_full_params(), opt


_REFERENCES: dict = {}


def cached_reference(precision, dp_size, backend):
    key = (precision, dp_size, backend.name)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(precision, dp_size, backend)
    return _REFERENCES[key]


# -- the policy ------------------------------------------------------------------

def test_precision_names_and_errors():
    assert Precision.of("float32") == Precision() and not Precision.of(None).mixed
    fp16 = Precision.of("float16")
    assert fp16.mixed and fp16.loss_scale == "dynamic" and fp16.reduce_dtype == "float32"
    assert Precision.of("bfloat16").loss_scale is None
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        Precision.of("fp8")
    assert Precision("bfloat16", reduce_dtype="bfloat16").reduce_dtype == "bfloat16"
    assert fp16.reducing_in("float16") == Precision("float16", "float16", "dynamic")
    assert Precision().reducing_in("bfloat16") == Precision()      # nothing cast
    with pytest.raises(ValueError, match="without a loss scale"):
        Precision.of("bfloat16").reducing_in("float16")
    with pytest.raises(ValueError, match="loss_scale must be"):
        Precision("float16", loss_scale=-1.0)
    with pytest.raises(ValueError, match="param_dtype 'float32' is not one of float16"):
        Precision("float32")
    with pytest.raises(ValueError, match="without a loss scale"):
        Precision("bfloat16", reduce_dtype="float16")
    with pytest.raises(ValueError, match="wrap it with precision='float16' or 'bfloat16'"):
        GPT(parity.UNEVEN, dtype="float16")


def test_dynamic_loss_scale_backs_off_and_grows():
    scaler = LossScaler(Precision("float16", loss_scale="dynamic", growth_interval=3))
    assert scaler.scale == 2.0 ** 16
    scaler.update(overflow=True)
    assert scaler.scale == 2.0 ** 15
    for _ in range(2):
        scaler.update(overflow=False)
    assert scaler.scale == 2.0 ** 15
    scaler.update(overflow=False)
    assert scaler.scale == 2.0 ** 16 and scaler.clean_steps == 0
    fixed = LossScaler(Precision("float16", loss_scale=128.0))
    fixed.update(overflow=True)
    assert fixed.scale == 128.0


def test_bfloat16_on_cupy_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="use precision 'float16'"):
        resolve_dtype("bfloat16", xp=object())


def test_sixteen_bit_ops_run_in_float32_inside():
    """float16 forward and backward track float32 closely; grads come back 16-bit."""
    x, y = parity.batch(0, 0, 0)
    ref = GPT(parity.UNEVEN, seed=0)
    _, ref_loss = ref(x, y)
    ref_loss.backward()
    for name in ("float16", "bfloat16"):
        low = resolve_dtype(name)
        model = GPT(parity.UNEVEN, seed=0)
        for p in model.parameters():
            p.data = p.data.astype(low)
        logits, loss = model(x, y)
        assert logits.dtype == low and loss.dtype == np.float32
        assert abs(loss.item() - ref_loss.item()) < 1e-2
        (loss * 1024.0).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert p.grad.dtype == low
            err = np.linalg.norm(p.grad.astype(np.float32) / 1024.0 - q.grad)
            assert err <= 0.05 * np.linalg.norm(q.grad) + 1e-6


# -- strategies against the reference --------------------------------------------

CASES = [("float16", k) for k in ("ddp", "zero1", "zero2", "zero3")] + \
    [("bfloat16", k) for k in ("ddp", "zero3")]


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision,kind", CASES)
@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
def test_mixed_precision_matches_same_casts_reference(precision, kind, dp_size, array_backend):
    if MPI.COMM_WORLD.size < dp_size:
        pytest.skip(f"needs {dp_size} ranks")
    ref_losses, ref_params = cached_reference(precision, dp_size, array_backend)
    with parity.sub_world(dp_size) as comm:
        if comm is None:
            return
        strategy = wrap(kind, Mesh(comm, dp=dp_size), precision, array_backend)
        losses, params, opt = train(strategy, comm.rank)
        assert strategy.skipped_steps == 0
        tol = 1e-5 if dp_size <= 2 else 3 * 2.0 ** -(11 if precision == "float16" else 8)
        np.testing.assert_allclose(losses, ref_losses, rtol=tol)
        assert parity.max_rel_err(params, ref_params, norm="2") <= tol
        for state in opt.state:                      # float32 optimizer state
            assert {a.dtype.name for a in state.values()} <= {"float32"}


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
def test_bfloat16_gradients_reduced_in_bfloat16(dp_size):
    """``reduce_dtype="bfloat16"`` (FSDP2's 16-bit reduce): every strategy keeps its
    gradient buffers in bfloat16 (DDP's take half the bytes of float32 ones), the four
    give the same losses and masters (bit for bit at 1 and 2 ranks, where MPI adds in
    one order; to bfloat16 rounding beyond), and they track the float32 reduction to
    bfloat16 rounding of the gradients."""
    if MPI.COMM_WORLD.size < dp_size:
        pytest.skip(f"needs {dp_size} ranks")
    with parity.sub_world(dp_size) as comm:
        if comm is None:
            return
        runs = {}
        for kind in ("ddp", "zero1", "zero2", "zero3"):
            for reduce in ("float32", "bfloat16"):
                strategy = wrap(kind, Mesh(comm, dp=dp_size),
                                Precision("bfloat16", reduce_dtype=reduce))
                losses, params, _ = train(strategy, comm.rank)
                runs[kind, reduce] = (losses, params, strategy.ledger.peak_by_category())
        want_losses, want_params, _ = runs["ddp", "bfloat16"]
        for kind in ("zero1", "zero2", "zero3"):
            losses, params, _ = runs[kind, "bfloat16"]
            if dp_size <= 2:
                np.testing.assert_array_equal(losses, want_losses)
                assert all(np.array_equal(params[n], want_params[n]) for n in want_params)
            else:
                np.testing.assert_allclose(losses, want_losses, rtol=2.0 ** -8)
        np.testing.assert_allclose(want_losses, runs["ddp", "float32"][0], rtol=2.0 ** -8)
        assert runs["ddp", "bfloat16"][2]["grads"] * 2 == runs["ddp", "float32"][2]["grads"]


# -- loss scaling: an inf on one rank --------------------------------------------

@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["ddp", "zero2", "zero3"])
def test_inf_on_one_rank_makes_every_rank_skip(kind, array_backend):
    world = Communicator(MPI.COMM_WORLD)
    strategy = wrap(kind, Mesh(world, dp=world.size),
                    Precision("float16", loss_scale="dynamic", growth_interval=2), array_backend)
    opt = parity.make_optimizer(strategy.parameters(), strategy.ledger)
    bad_rank = world.size - 1

    def step(poison: bool):
        _, loss = strategy(*parity.batch(strategy.steps, 0, world.rank))
        if poison and world.rank == bad_rank:
            loss = loss * float("inf")
        strategy.scale_loss(loss).backward()
        return strategy.step(opt, max_norm=1.0)

    step(False)
    before = strategy.gather_full_params()
    state_before = [{k: to_numpy(v).copy() for k, v in s.items()} for s in opt.state]
    scale = strategy.scaler.scale
    result = step(True)
    assert result.skipped and not math.isfinite(result.grad_norm)
    assert strategy.skipped_steps == 1 and strategy.scaler.scale == scale / 2
    after = strategy.gather_full_params()
    assert all(np.array_equal(before[n], after[n]) for n in before)
    assert all(np.array_equal(a[k], to_numpy(b[k])) for a, b in zip(state_before, opt.state)
               for k in a)
    # every rank made the same decision and holds the same scale
    assert world.all_gather_obj((result.skipped, strategy.scaler.scale)) == \
        [(True, scale / 2)] * world.size
    # training goes on: two clean steps change the parameters and grow the scale back
    assert not step(False).skipped and not step(False).skipped
    assert strategy.scaler.scale == scale
    changed = strategy.gather_full_params()
    assert any(not np.array_equal(after[n], changed[n]) for n in after)


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_too_large_initial_scale_backs_off_until_steps_succeed():
    world = Communicator(MPI.COMM_WORLD)
    strategy = wrap("zero3", Mesh(world, dp=world.size),
                    Precision("float16", loss_scale="dynamic", init_scale=2.0 ** 40))
    opt = parity.make_optimizer(strategy.parameters(), strategy.ledger)
    results = []
    for step in range(30):
        _, loss = strategy(*parity.batch(step, 0, world.rank))
        strategy.scale_loss(loss).backward()
        results.append(strategy.step(opt).skipped)
        if not results[-1]:
            break
    assert results[0] and not results[-1]              # overflowed, then recovered
    assert strategy.scaler.scale == 2.0 ** (40 - strategy.skipped_steps)
    assert strategy.scaler.scale * 65504 < 2.0 ** 40   # well inside float16 now


# -- communication and checkpoints in 16 bits --------------------------------------

@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_bfloat16_moves_and_reduces_in_float32():
    world = Communicator(MPI.COMM_WORLD)
    bf16 = resolve_dtype("bfloat16")
    mine = np.full(3, world.rank + 0.5, dtype=np.float32).astype(bf16)
    everyone = world.all_gather(mine)
    assert everyone.dtype == bf16
    assert everyone.astype(np.float32).tolist() == [r + 0.5 for r in range(world.size)
                                                    for _ in range(3)]
    buf = mine.copy()
    world.broadcast(buf, root=0)
    assert buf.astype(np.float32).tolist() == [0.5] * 3
    world.all_reduce(mine)                          # as float32, rounded once
    assert mine.astype(np.float32).tolist() == [world.size ** 2 / 2] * 3


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_checkpoint_keeps_float32_masters_and_loss_scale(tmp_path_factory):
    from mpishard.checkpoint import load_checkpoint, save_checkpoint

    world = Communicator(MPI.COMM_WORLD)
    root = world.broadcast_obj(str(tmp_path_factory.mktemp("mp")) if world.rank == 0 else None)
    mesh = Mesh(world, dp=world.size)
    saved = wrap("zero3", mesh, "float16")
    opt = parity.make_optimizer(saved.parameters(), saved.ledger)
    saved.scaler.scale = 1024.0
    for step in range(2):
        _, loss = saved(*parity.batch(step, 0, world.rank))
        saved.scale_loss(loss).backward()
        saved.step(opt)
    save_checkpoint(root, 2, saved, opt, world=world)
    masters = saved.gather_full_params()
    assert {a.dtype.name for a in masters.values()} == {"float32"}
    loaded = wrap("ddp", mesh, "float16")
    opt2 = parity.make_optimizer(loaded.parameters(), loaded.ledger)
    load_checkpoint(root, loaded, opt2, world=world)
    assert loaded.scaler.scale == 1024.0
    again = loaded.gather_full_params()
    assert all(np.array_equal(masters[n], again[n]) for n in masters)
    low = {n: p.data for n, p in loaded.module.named_parameters()}
    assert all(np.array_equal(low[n], masters[n].astype(np.float16)) for n in low)
    plain = wrap("ddp", mesh, None)                   # a float32 run reads it too
    load_checkpoint(root, plain, None, world=world)
    full = plain.gather_full_params()
    assert all(np.array_equal(masters[n], full[n]) for n in masters)
    # ... and a float16 run fine-tuning a float32 checkpoint keeps its own initial scale
    save_checkpoint(root, 3, plain, None, world=world)
    tuned = wrap("zero3", mesh, "float16")
    load_checkpoint(root, tuned, None, world=world)
    assert tuned.scaler.scale == 2.0 ** 16


def test_planner_counts_masters_and_sixteen_bit_copies():
    model = GPT(parity.UNEVEN, materialize_now=False)
    n = sum(p.size for p in model.parameters())
    ddp = estimate_memory(model, "ddp", 2, precision="float16")
    assert ddp.steady == {"params": 6 * n, "grads": 4 * n, "optim": 8 * n}
    z3 = estimate_memory(GPT(parity.UNEVEN, materialize_now=False), "zero3", 2,
                     precision="float16")
    plain = estimate_memory(GPT(parity.UNEVEN, materialize_now=False), "zero3", 2)
    assert z3.steady["params"] == plain.steady["params"] * 3 // 2
    assert z3.steady["optim"] == plain.steady["optim"]


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_tensor_and_pipeline_parallel_in_sixteen_bits(precision):
    """tp x pp, dp x tp and dp x pp train in 16 bits and track their float32 runs."""
    from mpishard.parallel import ParallelModel

    world = Communicator(MPI.COMM_WORLD)
    if world.size != 4:
        pytest.skip("needs 4 ranks")
    for dims in (dict(dp=1, tp=2, pp=2), dict(dp=2, tp=2, pp=1), dict(dp=2, tp=1, pp=2)):
        runs = {}
        for prec in (None, precision):
            mesh = Mesh(world, **dims)
            run = ParallelModel(GPT(parity.UNEVEN, materialize_now=False), mesh,
                                strategy="zero3" if dims["pp"] == 1 else "zero1",
                                micro_batches=2, precision=prec)
            opt = parity.make_optimizer(run.parameters(), run.ledger)
            losses = []
            for step in range(3):
                losses.append(run.train_step(*parity.batch(step, 0, mesh.dp.rank, size=4)))
                assert not run.step(opt, max_norm=1.0).skipped
            runs[prec] = (np.array(losses), run.gather_full_params())
        (ref_losses, ref), (losses, params) = runs[None], runs[precision]
        np.testing.assert_allclose(losses, ref_losses, rtol=5e-3)
        # Over the whole model: per tensor, Adam blows 16-bit noise in near-zero
        # gradients (the key bias's is exactly 0) up to full +-lr steps.
        diff = math.sqrt(sum(float(np.sum((params[n] - ref[n]) ** 2)) for n in ref))
        size = math.sqrt(sum(float(np.sum(ref[n] ** 2)) for n in ref))
        ulp = 2.0 ** -(11 if precision == "float16" else 8)
        assert diff <= 10 * ulp * size, (dims, diff / size)


def test_an_optimizer_built_before_wrapping_is_refused():
    """Mixed-precision DDP updates float32 masters: the model's own parameters are not targets."""
    from mpishard.optim import AdamW

    model = GPT(parity.UNEVEN, seed=0)
    opt = AdamW(model.parameters())
    strategy = DataParallel(model, Mesh(Communicator(MPI.COMM_SELF), dp=1), precision="float16")
    _, loss = strategy(*parity.batch(0, 0, 0))
    strategy.scale_loss(loss).backward()
    with pytest.raises(ValueError, match=r"target 0 is not one of DataParallel.parameters\(\)"):
        strategy.step(opt)

"""Activation checkpointing (``recompute``, ``GPT.set_activation_checkpointing``): whole
blocks ("full"), attention's core ("selective") and whole blocks keeping every second
product's output ("op").

    python -m pytest -q tests/autodiff/test_activation_checkpointing.py
    OMP_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py -m pytest -q --with-mpi \
        tests/autodiff/test_activation_checkpointing.py

Checkpointing must not change a single bit: losses, gradients and trained
parameters are compared with ``np.array_equal`` against the same run without
it, with dropout on (the recompute must replay the masks), in float64 and
float32, alone and under ZeRO-3, tensor, pipeline and context parallelism,
sequence parallelism and bfloat16. The memory ledger's measurement must show at
least 2x fewer activation bytes (full), none of the T x T weights (selective).
"""
import numpy as np
import pytest
from mpi4py import MPI

from mpishard.autodiff import Tensor, gradcheck, nn_ops, no_grad, ops, recompute
from mpishard.core.backend import MemoryLedger, to_numpy
from mpishard.comm import Mesh
from mpishard.testing.fake_cupy import make_test_comm
from mpishard.models import GPT, GPTConfig, Llama, LlamaConfig
from mpishard.nn import Parameter
from mpishard.optim import AdamW
from mpishard.parallel import ParallelModel, ZeRO
from parity import batch, make_optimizer, sub_world

TINY = GPTConfig(vocab_size=37, block_size=8, n_layer=3, n_head=2, n_embd=12, dropout=0.1)


def _mlp(x, w):
    h = ops.tanh(ops.matmul(x, w))
    return ops.sum(h * x, axis=1) + ops.mean(h)        # x used twice


# -- recompute on its own -----------------------------------------------------------

def test_recompute_passes_gradcheck(rng):
    x, w = rng.standard_normal((4, 3)), rng.standard_normal((3, 3))
    assert gradcheck(lambda a, b: recompute(_mlp, a, b), [x, w]) < 1e-6


def test_recompute_gives_the_same_bits_as_no_recompute(rng):
    x, w = rng.standard_normal((4, 3)), rng.standard_normal((3, 3))
    grads = []
    for fn in (_mlp, lambda a, b: recompute(_mlp, a, b)):
        a, b = Tensor(x.copy(), requires_grad=True), Tensor(w.copy(), requires_grad=True)
        out = fn(a, b)
        out.backward(np.ones(out.shape))
        grads.append((out.data, a.grad, b.grad))
    for plain, again in zip(*grads):
        assert np.array_equal(plain, again)


def test_parameters_read_inside_get_grads_and_hooks_once(rng):
    w = Parameter((3, 3), dtype="float64")
    w.data = rng.standard_normal((3, 3))
    fired = []
    w.register_grad_ready_hook(lambda t: fired.append(t.grad.copy()))
    x = Tensor(rng.standard_normal((4, 3)))                 # no input requires grad
    out = recompute(lambda a: _mlp(a, w), x)
    assert out.requires_grad and not x.requires_grad
    out.backward(np.ones(4))
    expected = Tensor(x.data)
    w2 = Tensor(w.data, requires_grad=True)
    _mlp(expected, w2).backward(np.ones(4))
    assert len(fired) == 1 and np.array_equal(fired[0], w2.grad)
    assert np.array_equal(w.grad, w2.grad)


def test_same_tensor_twice_counts_once(rng):
    x = rng.standard_normal((4, 3))
    a, b = Tensor(x.copy(), requires_grad=True), Tensor(x.copy(), requires_grad=True)
    (a * a).sum().backward()
    recompute(lambda p, q: (p * q).sum(), b, b).backward()
    assert np.array_equal(a.grad, b.grad)


def test_dropout_masks_replayed_and_generator_left_as_it_was(rng):
    """Forwards and backwards interleaved as in a 1F1B pipeline: F0 F1 B0 F2 B1 B2."""
    def dropped(a, gen):
        return nn_ops.dropout(nn_ops.gelu(a), 0.5, gen) * 2.0

    x = rng.standard_normal((5, 6))
    results = []
    for use_recompute in (False, True):
        gen = np.random.default_rng(7)
        inputs = [Tensor(x + k, requires_grad=True) for k in range(3)]
        outs = {}

        def forward(k):
            outs[k] = recompute(dropped, inputs[k], gen, rngs=[gen]) if use_recompute \
                else dropped(inputs[k], gen)

        def backward(k):
            outs[k].backward(np.ones(outs[k].shape))

        for run, k in ((forward, 0), (forward, 1), (backward, 0), (forward, 2),
                       (backward, 1), (backward, 2)):
            run(k)
        results.append([outs[k].data for k in range(3)] + [a.grad for a in inputs]
                       + [gen.random(4)])                   # backward drew nothing for good
    for plain, again in zip(*results):
        assert np.array_equal(plain, again)


def test_no_graph_under_no_grad(rng):
    with no_grad():
        out = recompute(_mlp, Tensor(rng.standard_normal((2, 3)), requires_grad=True),
                        Tensor(rng.standard_normal((3, 3)), requires_grad=True))
    assert not out.requires_grad and out.is_leaf


def test_clear_errors():
    x = Tensor(np.ones(3), requires_grad=True)
    with pytest.raises(TypeError, match="returned ndarray, expected one Tensor"):
        recompute(lambda a: a.data, x)
    with pytest.raises(TypeError, match="cannot save the state of a builtins.object"):
        recompute(lambda a: a * 2.0, x, rngs=[object()])


def test_kept_products_are_taken_not_computed_again():
    """Under ``keep=every_second`` the 1st, 3rd and 5th products are kept from the first
    run; the recompute computes the 2nd and 4th alone, and the gradient is the same."""
    from mpishard.autodiff.graph import make_result
    from mpishard.autodiff.recompute import every_second, kept_product
    made = []

    def scale(t, k):
        data = kept_product(lambda: (made.append(k), t.data * k)[1])
        return make_result(data, (t,), lambda g: (g * k,), "scale")

    def chain(t):
        for k in (2.0, 3.0, 5.0, 7.0, 11.0):
            t = scale(t, k)
        return t
    x = Tensor(np.arange(1.0, 4.0), requires_grad=True)
    out = recompute(chain, x, keep=every_second)
    assert made == [2.0, 3.0, 5.0, 7.0, 11.0]
    ops.sum(out).backward()
    assert made[5:] == [3.0, 7.0]
    np.testing.assert_array_equal(x.grad, np.full(3, 2.0 * 3 * 5 * 7 * 11))
    made.clear()                       # outside a recomputed call nothing is kept
    again = Tensor(np.arange(1.0, 4.0), requires_grad=True)
    ops.sum(chain(again)).backward()
    assert made == [2.0, 3.0, 5.0, 7.0, 11.0]
    np.testing.assert_array_equal(again.grad, x.grad)


def test_a_recompute_meeting_other_products_raises():
    """A recomputed function that runs other products the second time (here one fewer)
    is stopped at the first that differs, not handed another product's output."""
    from mpishard.autodiff.graph import make_result
    from mpishard.autodiff.recompute import every_second, kept_product
    runs = []

    def chain(t):
        runs.append(1)
        factors = (2.0, 3.0, 5.0) if len(runs) == 1 else (3.0, 5.0)
        for k in factors:
            data = kept_product(lambda t=t, k=k: t.data * k, ("scale", k))
            t = make_result(data, (t,), lambda g, k=k: (g * k,), "scale")
        return t
    x = Tensor(np.ones(3), requires_grad=True)
    out = recompute(chain, x, keep=every_second)
    with pytest.raises(RuntimeError, match=r"product 0 of the recompute is not the one the "
                                           r"first run made \(\('scale', 3.0\) against "
                                           r"\('scale', 2.0\)\)"):
        ops.sum(out).backward()


# -- the GPT --------------------------------------------------------------------------

def _train_gpt(checkpointing: bool, dtype: str, steps: int = 3, micro: int = 2):
    """Steps of AdamW with two micro-batches, both forwards before both backwards."""
    model = GPT(TINY, seed=0, dtype=dtype).set_activation_checkpointing(checkpointing)
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    record = []
    for step in range(steps):
        losses = [model(*batch(step, m, 0, TINY))[1] for m in range(micro)]
        for loss in losses:
            (loss * (1.0 / micro)).backward()
        record.append([loss.data for loss in losses])
        record.append([p.grad.copy() for p in model.parameters()])
        opt.step()
        model.zero_grad()
    return record + [[p.data for p in model.parameters()]]


@pytest.mark.parametrize("mode", ["full", "selective", "op"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gpt_bit_identical_with_and_without(dtype, mode):
    plain, again = _train_gpt(False, dtype), _train_gpt(mode, dtype)
    for a, b in zip(plain, again):
        assert all(np.array_equal(u, v) for u, v in zip(a, b))


LLAMA = LlamaConfig(vocab_size=37, block_size=8, n_layer=2, n_head=4, n_kv_head=2, n_embd=16)


def _train_llama(checkpointing, per_projection: bool = False) -> list:
    """Two steps of a float64 Llama: losses and gradients; ``per_projection``: its
    attention's per-projection path (q/k/v products of their own) in every mode."""
    model = Llama(LLAMA, seed=0, dtype="float64").set_activation_checkpointing(checkpointing)
    for block in model.model.layers.values():
        block.self_attn.per_projection |= per_projection
        assert block.self_attn.takes_one_op_path(model.backend.xp) != (
            per_projection or checkpointing == "op")
    opt = AdamW(model.parameters(), lr=1e-2)
    record = []
    for step in range(2):
        _, loss = model(*batch(step, 0, 0, LLAMA))
        loss.backward()
        record += [loss.data] + [p.grad.copy() for p in model.parameters()]
        opt.step()
        model.zero_grad()
    return record


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_llama_bit_identical_with_and_without(mode):
    """Llama's fused attention op (projections, rotations, grouped-query attention) is
    recomputed whole under selective: the same bits."""
    runs = [_train_llama("none"), _train_llama(mode)]
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


def test_llama_by_op_bit_identical_to_its_per_projection_path():
    """Recomputed by op, a Llama's attention takes its per-projection path (q, k and v
    products of their own: q and v kept, k computed again): the same bits as that path
    without recomputation."""
    runs = [_train_llama("none", per_projection=True), _train_llama("op")]
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


def test_by_op_is_refused_for_a_mixture_of_experts():
    moe = GPTConfig(**{**TINY.__dict__, "moe_experts": 4, "moe_top_k": 2, "moe_aux_coef": 0.0,
                       "moe_z_coef": 0.0})
    with pytest.raises(ValueError, match="'op' keeps the products of dense blocks; this "
                                         "model has moe_experts = 4: use 'full' or"):
        GPT(moe, seed=0).set_activation_checkpointing("op")


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="'some' is not one of none, full, selective"):
        GPT(TINY, seed=0).set_activation_checkpointing("some")


@pytest.mark.parametrize("mode", [True, "selective", "op"])
def test_pipeline_stages_bit_identical(mode):
    """Two stages of one GPT in one process, activations handed over by hand."""
    x, y = batch(0, 0, 0, TINY)
    grads = []
    for checkpointing in (False, mode):
        first = GPT(TINY, seed=0, blocks=[0, 1], last_stage=False)
        last = GPT(TINY, seed=0, blocks=[2], first_stage=False)
        for stage in (first, last):
            stage.set_activation_checkpointing(checkpointing)
        out = first(x)
        handed = Tensor(out.data, requires_grad=True)
        _, loss = last(handed, y, batch_size=len(x))
        loss.backward()
        out.backward(handed.grad)
        grads.append([p.grad for s in (first, last) for p in s.parameters()])
    assert all(np.array_equal(a, b) for a, b in zip(*grads))


def test_block_hooks_run_once_per_forward():
    model = GPT(TINY, seed=0).set_activation_checkpointing(True)
    calls = []
    for i, block in model.transformer.h.items():
        block.register_forward_pre_hook(lambda m, a, i=i: calls.append(("pre", i)))
        block.register_forward_hook(lambda m, a, out, i=i: calls.append(("post", i)))
    _, loss = model(*batch(0, 0, 0, TINY))
    loss.backward()
    assert calls == [(kind, str(i)) for i in range(TINY.n_layer) for kind in ("pre", "post")]


def test_eval_and_no_grad_run_the_block_directly():
    model = GPT(TINY, seed=0).set_activation_checkpointing(True)
    model.eval()
    with no_grad():
        logits, _ = model(batch(0, 0, 0, TINY)[0])
    plain = GPT(TINY, seed=0).eval()
    with no_grad():
        assert np.array_equal(logits.data, plain(batch(0, 0, 0, TINY)[0])[0].data)
    assert model.generate(np.zeros((1, 1), dtype=np.int64), 3).shape == (1, 4)


# -- the measurement ------------------------------------------------------------------

def test_measure_activations_counts_what_stays_alive():
    ledger = MemoryLedger()
    kept = []
    with ledger.measure_activations() as m:
        kept.append(np.ones(100_000))                       # 800,000 bytes stay
        np.ones(50_000).sum()                               # freed inside
        kept.append(ledger.zeros("gathered", (10_000,), "float64"))  # the ledger's own
    assert 800_000 <= m.nbytes < 800_000 + 20_000
    assert ledger.bytes_by_category()["activations"] == m.nbytes
    with ledger.measure_activations() as small:
        kept.append(np.ones(1_000))
    assert ledger.bytes_by_category()["activations"] == small.nbytes < 20_000
    assert ledger.peak_by_category()["activations"] == m.nbytes
    ledger.release_activations()
    assert ledger.bytes_by_category()["activations"] == 0
    assert ledger.total == 80_000                           # the gathered array only


SMALL = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=64, dropout=0.1)


def _activation_bytes(checkpointing: bool, zero3: bool = False) -> tuple[int, int]:
    """(measured activation bytes, the ledger's "gathered" bytes after forward)."""
    model = GPT(SMALL, seed=0, materialize_now=not zero3)
    model.set_activation_checkpointing(checkpointing)
    ledger, comm = model.backend.ledger, None
    if zero3:  # one rank: the gathered units stay in the ledger's "gathered" bytes
        comm = make_test_comm("self")
        model = ZeRO(model, Mesh(comm, dp=1), stage=3, ledger=ledger)
    x, y = batch(0, 0, 0, SMALL, size=8)
    x, y = np.tile(x, (1, 4)), np.tile(y, (1, 4))           # T = 32
    with ledger.measure_activations() as m:
        _, loss = model(x, y)
    gathered = ledger.bytes_by_category()["gathered"]
    loss.backward()
    if comm is not None:
        comm.free()
    return m.nbytes, gathered


def test_checkpointing_at_least_halves_activation_bytes():
    (without, _), (with_, _) = _activation_bytes(False), _activation_bytes(True)
    assert without >= 2 * with_, f"{without:,} bytes without, {with_:,} with"


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_selective_keeps_no_attention_weights_and_the_plan_counts_it(family):
    """Selective recomputation keeps none of the T x T weights (nor, for GPT with dropout,
    their masks): at least n_layer * B * h * T^2 * 4 bytes fewer, measured; and the
    activation plan follows the measurement to 1%, as it does without."""
    from mpishard.models.gpt.activations import gpt_activation_bytes
    from mpishard.models.llama.activations import llama_activation_bytes

    B, T = 8, 32
    if family == "gpt":
        cfg, build, plan = SMALL, GPT, gpt_activation_bytes
    else:
        cfg = LlamaConfig(vocab_size=256, block_size=T, n_layer=3, n_head=4, n_kv_head=2,
                          n_embd=64)
        build, plan = Llama, llama_activation_bytes
    measured = {}
    for mode in ("none", "selective"):
        model = build(cfg, seed=0).set_activation_checkpointing(mode)
        x, y = [np.tile(a, (1, 4)) for a in batch(0, 0, 0, cfg, size=B)]
        with model.backend.ledger.measure_activations() as m:
            _, loss = model(x, y)
        planned = plan(model, B, T, "float32")
        loss.backward()
        assert abs(m.nbytes - planned) <= 0.01 * planned, (mode, m.nbytes, planned)
        measured[mode] = m.nbytes
    weights = cfg.n_layer * B * cfg.n_head * T * T * 4
    assert measured["none"] - measured["selective"] >= weights, (measured, weights)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_measurement_leaves_out_zero3_gathered_parameters(checkpointing):
    (plain, _), (zero3, gathered) = _activation_bytes(checkpointing), \
        _activation_bytes(checkpointing, zero3=True)
    assert gathered > 0                                     # the root unit stays gathered
    assert abs(zero3 - plain) < gathered / 2, f"{zero3:,} bytes under ZeRO-3, {plain:,} plain"


# -- on every array module (NumPy; CuPy where a GPU is visible) ---------------------

def test_every_array_module_bit_identical_and_halved(array_backend):
    """Dropout on the module's own generators (CuPy: device states saved and restored)."""
    # No dropout for the bytes: a CuPy generator's saved state alone is ~13 MB.
    cfg = GPTConfig(**{**SMALL.__dict__, "dropout": 0.0})
    runs = []
    for checkpointing in (False, True):
        model = GPT(TINY, seed=0, backend=array_backend)
        model.set_activation_checkpointing(checkpointing)
        for step in range(2):
            _, loss = model(*[array_backend.asarray(a) for a in batch(step, 0, 0, TINY)])
            loss.backward()
        runs.append([to_numpy(p.grad) for p in model.parameters()])
        measured = GPT(cfg, seed=0, backend=array_backend)
        measured.set_activation_checkpointing(checkpointing)
        x, y = [array_backend.asarray(np.tile(a, (1, 4))) for a in batch(0, 0, 0, cfg, size=8)]
        with array_backend.ledger.measure_activations() as m:
            _, loss = measured(x, y)
        loss.backward()
        runs[-1].append(m.nbytes)
    (*plain, plain_bytes), (*again, again_bytes) = runs
    assert all(np.array_equal(a, b) for a, b in zip(plain, again))
    assert plain_bytes >= 2 * again_bytes, f"{plain_bytes:,} bytes without, {again_bytes:,} with"


# -- under MPI ------------------------------------------------------------------------

def _zero3_params(comm, checkpointing, steps: int = 3, accum: int = 2):
    model = GPT(TINY, seed=0, dtype="float32", materialize_now=False)
    strategy = ZeRO(model.set_activation_checkpointing(checkpointing), Mesh(comm, dp=comm.size),
                    stage=3)
    opt = make_optimizer(strategy.parameters(), strategy.ledger)
    for step in range(steps):
        for micro in range(accum):
            with strategy.no_sync(micro < accum - 1):
                _, loss = strategy(*batch(step, micro, comm.rank, TINY))
                (loss * (1.0 / accum)).backward()
        strategy.step(opt, max_norm=0.5)
    return strategy.gather_full_params()


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["full", "selective", "op"])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_zero3_bit_identical_with_and_without(size, mode):
    if size > MPI.COMM_WORLD.size:
        pytest.skip(f"needs {size} ranks")
    with sub_world(size) as comm:
        if comm is None:
            return
        plain, again = _zero3_params(comm, False), _zero3_params(comm, mode)
        for name in plain:
            assert np.array_equal(plain[name], again[name]), name


def _parallel_run(comm, checkpointing, family: str = "gpt", steps: int = 3, sp: bool = False,
                  precision: str = "float32", **sizes):
    mesh = Mesh(comm, **sizes)
    if family == "llama":
        cfg, model = LLAMA, Llama(LLAMA, dtype="float32", materialize_now=False)
    else:
        cfg = TINY if mesh.cp.size == 1 else GPTConfig(**{**TINY.__dict__, "dropout": 0.0})
        model = GPT(cfg, dtype="float32", materialize_now=False)
    run = ParallelModel(model, mesh, strategy="zero3", micro_batches=2, sequence_parallel=sp,
                        precision=precision)
    run.module.set_activation_checkpointing(checkpointing)
    opt = make_optimizer(run.parameters(), run.ledger)
    losses = []
    for step in range(steps):
        x, y = batch(step, 0, mesh.dp.rank, cfg, size=4)
        losses.append(run.train_step(x, y))
        run.step(opt, max_norm=0.5)
    return losses, run.gather_full_params()


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["full", "selective", "op"])
@pytest.mark.parametrize("dp,tp,pp,cp,sp,precision", [
    (2, 2, 1, 1, False, "float32"), (1, 2, 2, 1, False, "float32"),
    (2, 1, 1, 2, False, "float32"),                   # context parallel (ring)
    (2, 2, 1, 1, True, "bfloat16")])                  # sequence parallel, mixed precision
def test_tensor_and_pipeline_parallel_bit_identical(dp, tp, pp, cp, sp, precision, mode):
    with sub_world(4) as comm:
        sizes = dict(dp=dp, tp=tp, pp=pp, cp=cp, sp=sp, precision=precision)
        plain_losses, plain = _parallel_run(comm, False, **sizes)
        losses, again = _parallel_run(comm, mode, **sizes)
        assert plain_losses == losses
        for name in plain:
            assert np.array_equal(plain[name], again[name]), name


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sp", [False, True])
def test_llama_by_op_under_zero3_and_tensor_parallel_bit_identical(sp):
    """tp 2 (the per-projection path either way), with and without sequence
    parallelism: the kept q, v and gate products, and down's partial sums."""
    with sub_world(4) as comm:
        plain_losses, plain = _parallel_run(comm, "none", "llama", dp=2, tp=2, sp=sp)
        losses, again = _parallel_run(comm, "op", "llama", dp=2, tp=2, sp=sp)
        assert plain_losses == losses
        for name in plain:
            assert np.array_equal(plain[name], again[name]), name


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [1, 2])
def test_llama_selective_under_zero3_and_tensor_parallel_bit_identical(tp):
    """tp 1: the fused op recomputed whole under ZeRO-3 (its weights gathered for the
    recompute); tp 2: the per-projection path's core."""
    with sub_world(4) as comm:
        plain_losses, plain = _parallel_run(comm, "none", "llama", dp=4 // tp, tp=tp)
        losses, again = _parallel_run(comm, "selective", "llama", dp=4 // tp, tp=tp)
        assert plain_losses == losses
        for name in plain:
            assert np.array_equal(plain[name], again[name]), name

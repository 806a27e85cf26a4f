"""The core paths on every array module: NumPy and the CuPy-strict module always, CuPy
where a GPU is visible.

    pytest tests/testing/test_array_modules.py                        # NumPy, strict (+ CuPy with a GPU)
    MPISHARD_TEST_BACKENDS=cupy pytest tests/testing/test_array_modules.py
    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi tests/testing/test_array_modules.py

The strict module (mpishard.testing.strict) computes with NumPy but refuses what CuPy
refuses (``np.asarray`` of a device array, NumPy arrays as operands) and draws
its own random stream, so these tests find NumPy assumptions on the device path
without a GPU.

Every test takes the ``array_backend`` fixture (tests/conftest.py), builds its
arrays there and checks two things: the results stay on that module (no
silent trip through host memory), and they equal NumPy's, the reference.

* every autodiff op: float64 central differences computed on the module, and
  values and gradients equal to NumPy's (the case table is
  test_autodiff_gradcheck.CASES);
* GPT forward and backward, and AdamW/SGD steps, against NumPy;
* float16 and bfloat16 mixed precision training against float32;
* a ZeRO-3 checkpoint saved from the module (synchronously and in the background) and
  loaded on it and on NumPy;
* DDP and ZeRO-3 with models on the module against the single-process NumPy
  reference (parity.reference), at every world size the run has.
"""
import zlib

import numpy as np
import pytest
from mpi4py import MPI

from ckpt_scripts.common import full_tensors, shared_tmp
from mpishard.autodiff import Tensor, nn_ops, ops, rms_rope_swiglu, softmax_ops
from mpishard.core.backend import to_numpy, xp_of
from mpishard.checkpoint import load_checkpoint, save_checkpoint
from mpishard.comm import Mesh
from mpishard.models import GPT
from mpishard.optim import SGD, AdamW
from mpishard.parallel import DataParallel, ZeRO
from parity import UNEVEN, batch, make_optimizer, max_rel_err, reference, sub_world, train
from test_autodiff_gradcheck import CASES, TOL

# -- every op ---------------------------------------------------------------

# Cases whose function holds an index, mask or generator: on CuPy those must
# live on the device too, so here they are rebuilt on the module under test
# (same values as in CASES; the inputs still come from CASES).
_WITH_ARRAYS = {
    ("getitem", 1): lambda xp: lambda a: a[xp.asarray([0, 2, 0])],
    ("where", 0): lambda xp: lambda a, b: ops.where(xp.asarray([[True, False, True]]), a, b),
    ("masked_fill", 0): lambda xp: lambda a: ops.masked_fill(
        a, xp.triu(xp.ones((3, 3), bool), 1), -3.0),
    ("cross_entropy", 0): lambda xp: lambda x: softmax_ops.cross_entropy(
        x, xp.asarray([[1, 0, 4], [2, 3, 3]])),
    ("cross_entropy", 1): lambda xp: lambda x: softmax_ops.cross_entropy(
        x, xp.asarray([1, -100, 0, 2])),
    ("embedding", 0): lambda xp: lambda w: nn_ops.embedding(
        xp.asarray([[0, 3, 3], [1, 0, 4]]), w),
    # the mask drawn once, on the host, and used on every module: CuPy's generators
    # draw another stream than NumPy's (so do the strict module's)
    ("dropout", 0): lambda xp: lambda a: nn_ops.dropout(a, 0.4, _Drawn(xp.asarray(_UNIFORMS))),
    # rotary tables on the module, as the Llama model builds them
    ("rope", 0): lambda xp: lambda x: rms_rope_swiglu.rope(x, *rms_rope_swiglu.rope_tables(
        3, 4, 10000.0, dtype="float64", xp=xp)),
    ("rope", 1): lambda xp: lambda x: rms_rope_swiglu.rope(x, *rms_rope_swiglu.rope_tables(
        5, 6, 500000.0, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 4}, dtype="float64", xp=xp)),
    ("rope_qkv", 0): lambda xp: lambda q, k, v: rms_rope_swiglu.rope_qkv(
        q, k, v, *rms_rope_swiglu.rope_tables(3, 4, dtype="float64", xp=xp), [0, 0, 1, 1]),
    ("rope_qkv", 1): lambda xp: lambda q, k, v: rms_rope_swiglu.rope_qkv(
        q, k, v, *rms_rope_swiglu.rope_tables(2, 2, dtype="float64", xp=xp), [1, 2, 2]),
    ("rope_qkv", 2): lambda xp: lambda q, k, v: rms_rope_swiglu.rope_qkv(
        q, k, v, *rms_rope_swiglu.rope_tables(2, 4, dtype="float64", xp=xp), [0]),
    ("rope_qkv", 3): lambda xp: lambda q, k, v: rms_rope_swiglu.rope_qkv(
        q, k, v, *rms_rope_swiglu.rope_tables(2, 2, dtype="float64", xp=xp), [1, 1]),
}
_UNIFORMS = np.random.default_rng(7).random((4, 5), dtype=np.float32)


class _Drawn:
    """A generator that draws the same uniforms at every call (the same mask in every
    evaluation of the finite differences)."""

    def __init__(self, uniforms):
        self.uniforms = uniforms

    def random(self, shape, dtype=np.float32):
        assert tuple(shape) == self.uniforms.shape and np.dtype(dtype) == np.float32
        return self.uniforms
OP_CASES = [(n, i) for n, cases in CASES.items() for i in range(len(cases))]


def _case(name, index, xp):
    rng = np.random.default_rng(zlib.crc32(name.encode()) + index)
    fn, inputs = CASES[name][index](rng)
    if (name, index) in _WITH_ARRAYS:
        fn = _WITH_ARRAYS[name, index](xp)
    return fn, inputs


def _outputs(fn, tensors):
    out = fn(*tensors)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _run_op(fn, inputs, xp, projection=None):
    """Outputs, and gradients of ``sum(outputs * projection)``, with arrays on ``xp``."""
    tensors = [Tensor(xp.asarray(a, dtype=xp.float64), requires_grad=True) for a in inputs]
    outs = _outputs(fn, tensors)
    if projection is None:
        r = np.random.default_rng(0)
        projection = [r.standard_normal(o.shape) for o in outs]
    total = None
    for o, p in zip(outs, projection):
        term = (o * Tensor(xp.asarray(p))).sum()
        total = term if total is None else total + term
    total.backward()
    return outs, tensors, projection


def _numerical_grads(fn, inputs, projection, xp, eps=1e-6):
    """Central differences of ``sum(fn(inputs) * projection)``, evaluated on ``xp``."""
    arrays = [xp.asarray(a, dtype=xp.float64) for a in inputs]
    proj = [xp.asarray(p) for p in projection]

    def objective():
        outs = _outputs(fn, [Tensor(a) for a in arrays])
        return sum(float((o.data * p).sum()) for o, p in zip(outs, proj))

    grads = []
    for a in arrays:
        flat = a.reshape(-1)  # a view: writes reach ``a``
        g = np.zeros(flat.size)
        for j in range(flat.size):
            saved = float(flat[j])
            flat[j] = saved + eps
            plus = objective()
            flat[j] = saved - eps
            minus = objective()
            flat[j] = saved
            g[j] = (plus - minus) / (2 * eps)
        grads.append(g.reshape(a.shape))
    return grads


@pytest.mark.parametrize("name,index", OP_CASES)
def test_op_gradcheck_and_numpy_agreement(array_backend, name, index):
    xp = array_backend.xp
    fn, inputs = _case(name, index, xp)
    outs, tensors, projection = _run_op(fn, inputs, xp)
    for o in outs:
        assert xp_of(o.data) is xp, f"{name}[{index}]: output left {xp.__name__}"
    for t in tensors:
        assert t.grad is None or xp_of(t.grad) is xp, f"{name}[{index}]: grad left {xp.__name__}"
    numeric = _numerical_grads(fn, inputs, projection, xp)
    for t, n in zip(tensors, numeric):
        a = to_numpy(t.grad) if t.grad is not None else np.zeros_like(n)
        err = np.linalg.norm(a - n) / max(np.linalg.norm(a), np.linalg.norm(n), 1e-12)
        assert err <= TOL, f"{name}[{index}] on {xp.__name__}: gradcheck error {err:.2e}"
    ref_fn, _ = _case(name, index, np)
    ref_outs, ref_tensors, _ = _run_op(ref_fn, inputs, np, projection)
    for got, want in zip(outs, ref_outs):
        np.testing.assert_allclose(to_numpy(got.data), want.data, rtol=1e-10, atol=1e-12)
    for got, want in zip(tensors, ref_tensors):
        if want.grad is not None:
            np.testing.assert_allclose(to_numpy(got.grad), want.grad, rtol=1e-10, atol=1e-12)


# -- a GPT and its optimizers -------------------------------------------------

def _on(backend, *arrays):
    return [backend.asarray(a) for a in arrays]


@pytest.fixture
def comm_self():
    from mpishard.comm import Communicator

    with Communicator(MPI.COMM_SELF.Dup(), "self", _owned=True) as comm:
        yield comm


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gpt_forward_backward_matches_numpy(array_backend, dtype):
    xp, norm, tol = array_backend.xp, ("max" if dtype == "float64" else "2"), TOLERANCE[dtype]
    model = GPT(UNEVEN, seed=0, dtype=dtype, backend=array_backend)
    ref = GPT(UNEVEN, seed=0, dtype=dtype)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert xp_of(p.data) is xp, f"{name} is not on {xp.__name__}"
        # init is drawn on the host from (seed, name): bit-identical on any module
        assert np.array_equal(to_numpy(p.data), q.data), name
    x, y = batch(0, 0, 0)
    logits, loss = model(*_on(array_backend, x, y))
    loss.backward()
    ref_logits, ref_loss = ref(x, y)
    ref_loss.backward()
    assert xp_of(logits.data) is xp and xp_of(loss.data) is xp
    assert abs(loss.item() - ref_loss.item()) <= tol * abs(ref_loss.item())
    assert max_rel_err({"logits": to_numpy(logits.data)}, {"logits": ref_logits.data}, norm) <= tol
    grads = {n: to_numpy(p.grad) for n, p in model.named_parameters()}
    assert all(xp_of(p.grad) is xp for p in model.parameters())
    assert max_rel_err(grads, {n: p.grad for n, p in ref.named_parameters()}, norm) <= tol


@pytest.mark.parametrize("make_opt", [
    lambda ps: AdamW(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1),
    lambda ps: SGD(ps, lr=0.1, momentum=0.9),
], ids=["adamw", "sgd-momentum"])
def test_optimizer_steps_match_numpy(array_backend, make_opt):
    model = GPT(UNEVEN, seed=0, dtype="float64", backend=array_backend)
    ref = GPT(UNEVEN, seed=0, dtype="float64")
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    for step in range(3):
        x, y = batch(step, 0, 0)
        for m, o, data in ((model, opt, _on(array_backend, x, y)), (ref, ref_opt, (x, y))):
            _, loss = m(*data)
            loss.backward()
            o.step()
            m.zero_grad()
    params = {n: to_numpy(p.data) for n, p in model.named_parameters()}
    assert all(xp_of(p.data) is array_backend.xp for p in model.parameters())
    assert max_rel_err(params, {n: p.data for n, p in ref.named_parameters()}) <= 1e-10


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("low", ["float16", "bfloat16"])
def test_16bit_training_tracks_float32(array_backend, comm_self, low):
    """DDP at size 1 with precision="float16" or "bfloat16" follows float32; under
    float16 an overflow skips.

    The float32 masters stay float32 on the module and the model computes in ``low``
    there (bfloat16: CuPy 14's ``ml_dtypes.bfloat16``); a float16 step whose gradients
    hold an inf leaves them unchanged and halves the dynamic loss scale.
    """
    losses = {}
    for precision in ("float32", low):
        model = DataParallel(GPT(UNEVEN, seed=0, backend=array_backend),
                             Mesh(comm_self, dp=1), precision=precision)
        opt = make_optimizer(model.parameters(), model.ledger)
        losses[precision] = []
        for step in range(6):
            logits, loss = model(*_on(array_backend, *batch(step, 0, 0)))
            model.scale_loss(loss).backward()
            model.step(opt, max_norm=1.0)
            losses[precision].append(loss.item())
        assert all(xp_of(p.data) is array_backend.xp and p.data.dtype == np.float32
                   for p in model.parameters())
    assert xp_of(logits.data) is array_backend.xp and logits.data.dtype.name == low
    if low == "float16":
        assert model.skipped_steps == 0 and model.scaler.scale == 2.0 ** 16
        before = [to_numpy(p.data).copy() for p in model.parameters()]
        _, loss = model(*_on(array_backend, *batch(6, 0, 0)))
        (model.scale_loss(loss) * float("inf")).backward()
        assert model.step(opt, max_norm=1.0).skipped and model.scaler.scale == 2.0 ** 15
        assert all(np.array_equal(to_numpy(p.data), b)
                   for p, b in zip(model.parameters(), before))
    f32, f16 = np.array(losses["float32"]), np.array(losses[low])
    # 16-bit rounding of weights and activations (bfloat16 keeps 8 bits: up to 2**-8
    # relative), float32 reduction and update
    assert np.max(np.abs(f16 - f32) / f32) <= 5e-3, (f16, f32)


# -- checkpoints -----------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("background", [False, True], ids=["synchronous", "background"])
def test_checkpoint_round_trip_on_the_module(array_backend, background):
    """ZeRO-3 saved with the model on the module; loaded there and on NumPy, bit-identical.
    In the background (BackgroundSaver) the run trains another step, with its collectives,
    while the writer thread writes and agrees: the checkpoint holds the values of step 2."""
    from mpishard.checkpoint import BackgroundSaver
    from mpishard.core.backend import Backend

    with sub_world(MPI.COMM_WORLD.size) as comm, shared_tmp(comm) as root:
        def build(backend, seed):
            model = GPT(UNEVEN, seed=seed, dtype="float32", backend=backend,
                        materialize_now=False)
            strategy = ZeRO(model, Mesh(comm, dp=comm.size), stage=3)
            return strategy, make_optimizer(strategy.parameters(), strategy.ledger)

        strategy, opt = build(array_backend, 0)
        for step in range(2):
            _, loss = strategy(*_on(array_backend, *batch(step, 0, comm.rank)))
            loss.backward()
            strategy.step(opt)
        saved = full_tensors(strategy, opt, comm)
        if background:
            saver = BackgroundSaver(comm)
            saver.save(root, 2, strategy, opt)
            _, loss = strategy(*_on(array_backend, *batch(2, 0, comm.rank)))
            loss.backward()
            strategy.step(opt)                       # overwrites what is being written
            assert saver.close().path.name == "step-2"
            after = full_tensors(strategy, opt, comm)
            assert any(not np.array_equal(after[key], saved[key]) for key in saved)
        else:
            save_checkpoint(root, 2, strategy, opt)
        for backend in (array_backend, Backend.resolve("numpy")):
            fresh, fresh_opt = build(backend, 1)
            load_checkpoint(root, fresh, fresh_opt)
            assert all(xp_of(p.data) is backend.xp for p in fresh.parameters())
            loaded = full_tensors(fresh, fresh_opt, comm)
            assert saved.keys() == loaded.keys()
            for key in saved:
                assert np.array_equal(saved[key], loaded[key]), (backend.name, key)


# -- strategies against the single-process reference -------------------------

STEPS, ACCUM, MAX_NORM = 5, 2, 0.5
# float64 in the max norm, float32 per tensor in the 2-norm (see parity.max_rel_err);
# a little looser than test_parallel_parity: another library's rounding (cuBLAS).
TOLERANCE = {"float64": 1e-9, "float32": 1e-4}
_REFERENCE = {}


def _reference(size, dtype):
    if (size, dtype) not in _REFERENCE:
        _REFERENCE[size, dtype] = reference(size, STEPS, ACCUM, dtype, MAX_NORM)
    return _REFERENCE[size, dtype]


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", ["ddp", "zero3"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_strategy_on_the_module_matches_numpy_reference(array_backend, size, kind, dtype):
    if size > MPI.COMM_WORLD.size:
        pytest.skip(f"needs {size} ranks")
    with sub_world(size) as comm:
        if comm is None:
            return
        model = GPT(UNEVEN, seed=0, dtype=dtype, backend=array_backend,
                    materialize_now=kind != "zero3")
        mesh = Mesh(comm, dp=size)
        strategy = DataParallel(model, mesh) if kind == "ddp" else ZeRO(model, mesh, stage=3)
        assert all(xp_of(p.data) is array_backend.xp for p in strategy.parameters())
        # host batches: the model moves token ids onto its device itself
        losses, params = train(strategy, comm.rank, STEPS, ACCUM, MAX_NORM)
        ref_losses, ref_params = _reference(size, dtype)
        tol, norm = TOLERANCE[dtype], "max" if dtype == "float64" else "2"
        loss_err = float(np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)))
        param_err = max_rel_err(params, ref_params, norm)
        where = f"{kind} dp={size} {dtype} on {array_backend.name}"
        assert loss_err <= tol, f"{where}: loss error {loss_err:.2e}"
        assert param_err <= tol, f"{where}: parameter error {param_err:.2e}"
        assert strategy.skipped_steps == 0


# -- bfloat16 typed as on NumPy ---------------------------------------------

def _bf16_models():
    from mpishard.models import GPTConfig, LlamaConfig
    from mpishard.models.qwen2.spec import Qwen2Config
    common = dict(vocab_size=37, block_size=8, n_layer=2, n_head=4, n_embd=16)
    llama = dict(common, n_kv_head=2, intermediate_size=24, rope_theta=500.0)
    return {"gpt_dropout": GPTConfig(**common, dropout=0.1),
            "llama": LlamaConfig(**llama),
            "llama_moe": LlamaConfig(**llama, moe_experts=4, moe_top_k=2),
            "llama_moe_sigmoid": LlamaConfig(**llama, moe_experts=4, moe_top_k=2,
                                             moe_router="sigmoid", moe_z_coef=1e-3),
            "qwen2": Qwen2Config(**llama)}


def _graph_dtypes(loss) -> list:
    """Each op of the graph behind ``loss`` as ``(op, output dtype, parents' dtypes)``,
    depth first from the loss (the same order for the same model and batch)."""
    seen, order, stack = set(), [], [loss]
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        parents = [p for p in t._parents if p is not None]
        order.append((getattr(t, "_op", None), t.data.dtype.name,
                      tuple(p.data.dtype.name for p in parents)))
        stack.extend(parents)
    return order


@pytest.mark.parametrize("family", ["gpt_dropout", "llama", "llama_moe", "llama_moe_sigmoid",
                                    "qwen2"])
def test_bfloat16_ops_are_typed_as_on_numpy(array_backend, comm_self, family):
    """Every op of a bfloat16 step types its output and its gradients as on NumPy.

    CuPy 14 makes float32 of ``where`` on bfloat16 and of a bfloat16 array times a Python
    float (seen on an H100, where the first bfloat16 step stopped at a float32 input
    meeting a bfloat16 weight); the strict module types both the same way.
    """
    from mpishard.models import Llama

    if array_backend.name == "numpy":
        pytest.skip("NumPy is the reference this test holds the device modules to")
    cfg = _bf16_models()[family]
    family_class = GPT if family.startswith("gpt") else Llama

    def step(backend):
        model = DataParallel(family_class(cfg, seed=0, backend=backend),
                             Mesh(comm_self, dp=1), precision="bfloat16")
        x, y = (backend.asarray(a) for a in batch(0, 0, 0, cfg))
        logits, loss = model(x, y)
        loss.backward()
        grads = [None if p.grad is None else p.grad.dtype.name for p in model.parameters()]
        return _graph_dtypes(loss), grads, logits.data.dtype.name

    from mpishard.core.backend import Backend
    want = step(Backend.resolve("numpy"))
    got = step(array_backend)
    assert got[2] == want[2] == "bfloat16"
    differ = [(w, g) for w, g in zip(want[0], got[0]) if w != g]
    assert not differ and len(got[0]) == len(want[0]), differ[:5]
    assert got[1] == want[1]

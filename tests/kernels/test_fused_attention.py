"""Fused causal attention (``MPISHARD_ATTENTION=fused``): flash-style kernels that keep
no T x T weights.

* the reference math of the fused kernels (what the strict module runs, and what
  the kernels must compute) against attention as the models have always run it;
* the CUDA kernels themselves, compiled for the host (tests/cuda_host.py), against
  that reference: float64, float32, float16 rows; sequence lengths on and off the
  tiles (32 rows in single precision, 16 in double), head sizes 1 to 24 (float16 at
  16 runs the tensor-core kernels, tests/kernels/test_tensor_core_attention.py);
* a GPT trained on the CuPy-strict module with the fused kernels against the
  batched path, in float64, the launches they save per block, and the activation
  bytes they keep against the plan; a Llama likewise (there the fused choice moves
  its attention off the one grouped-query op, which keeps the weights, onto the
  per-projection path).
"""
from __future__ import annotations

import numpy as np
import pytest

from cuda_host import use_host_kernels
from mpishard import kernels
from mpishard.testing import strict
from mpishard.autodiff import Tensor
from mpishard.autodiff.softmax_ops import causal_self_attention
from mpishard.core.backend import Backend
from mpishard.kernels import reference
from mpishard.kernels.cuda import attention as gpu_attention
from mpishard.models import GPT, GPTConfig, Llama, LlamaConfig
from mpishard.models.llama.activations import _OBJECTS_PER_PROJECTION_PATH
from mpishard.optim import AdamW

SHAPES = [(1, 1, 1, 1), (2, 3, 5, 7), (1, 2, 33, 8), (2, 1, 70, 16), (1, 2, 17, 24)]


def _head_major(qkv, B, nh):
    N, width = qkv.shape
    T, hs = N // B, width // (3 * nh)
    return np.ascontiguousarray(qkv.reshape(B, T, 3, nh, hs).transpose(2, 0, 3, 1, 4))


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("B,nh,T,hs", SHAPES, ids=str)
def test_the_fused_math_is_attention(B, nh, T, hs, dtype, tol):
    """Output and q, k, v gradients of the fused reference against the attention op
    (softmax of the masked scores, products, its own backward) on NumPy."""
    r = np.random.default_rng(0)
    qkv = r.standard_normal((B * T, 3 * nh * hs)).astype(dtype)
    g = r.standard_normal((B * T, nh * hs)).astype(dtype)
    x = Tensor(qkv.copy(), requires_grad=True)
    out = causal_self_attention(x, nh, B)
    out.backward(g)
    scale = 1.0 / np.sqrt(hs)
    hm = _head_major(qkv, B, nh)
    y, lse = reference.flash_attention_forward(hm, scale)
    assert y.dtype == dtype and lse.shape == (B, nh, T)
    np.testing.assert_allclose(y.transpose(0, 2, 1, 3).reshape(B * T, -1), out.data,
                               rtol=tol, atol=tol)
    gy = np.ascontiguousarray(g.reshape(B, T, nh, hs).transpose(0, 2, 1, 3))
    dh = reference.flash_attention_backward(hm, y, gy, lse, scale)
    rows, _ = reference.unpack_heads(dh)
    np.testing.assert_allclose(rows, x.grad, rtol=tol, atol=tol)


@pytest.fixture
def host_flash(monkeypatch):
    """The kernel set's flash kernels compiled for the host (same source and names)."""
    use_host_kernels(monkeypatch)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 3e-5),
                                       (np.float16, 4e-3)])
@pytest.mark.parametrize("B,nh,T,hs", SHAPES, ids=str)
def test_the_cuda_kernels_compute_the_fused_math(host_flash, B, nh, T, hs, dtype, tol):
    r = np.random.default_rng(1)
    hm = r.standard_normal((3, B, nh, T, hs)).astype(dtype)
    gy = r.standard_normal((B, nh, T, hs)).astype(dtype)
    scale = 1.0 / np.sqrt(hs)
    y, lse = gpu_attention.flash_attention_forward(hm, scale)
    want_y, want_lse = reference.flash_attention_forward(hm, scale)
    assert y.dtype == want_y.dtype and lse.dtype == want_lse.dtype
    np.testing.assert_allclose(y.astype(np.float64), want_y.astype(np.float64), rtol=tol,
                               atol=tol)
    np.testing.assert_allclose(lse, want_lse, rtol=tol, atol=tol)
    dh = gpu_attention.flash_attention_backward(hm, y, gy, lse, scale)
    want = reference.flash_attention_backward(hm, y, gy, want_lse, scale)
    assert dh.dtype == want.dtype and dh.shape == hm.shape
    np.testing.assert_allclose(dh.astype(np.float64), want.astype(np.float64),
                               rtol=4 * tol, atol=4 * tol)


def test_inputs_the_kernels_do_not_take_run_the_reference(host_flash):
    """A head size over 128, or rows that are not C-contiguous, fall back."""
    hm = np.random.default_rng(2).standard_normal((3, 1, 1, 4, 130))
    y, lse = gpu_attention.flash_attention_forward(hm, 0.1)
    want_y, want_lse = reference.flash_attention_forward(hm, 0.1)
    np.testing.assert_array_equal(y, want_y)
    strided = np.random.default_rng(3).standard_normal((3, 1, 2, 5, 8))[..., ::2]
    y, lse = gpu_attention.flash_attention_forward(strided, 0.3)
    np.testing.assert_array_equal(y, reference.flash_attention_forward(strided, 0.3)[0])


def _train(monkeypatch, choice, dropout=0.0, steps=3, dtype="float64"):
    monkeypatch.setenv("MPISHARD_ATTENTION", choice)
    cfg = GPTConfig(vocab_size=32, block_size=12, n_layer=2, n_head=2, n_embd=16,
                    dropout=dropout)
    model = GPT(cfg, seed=0, dtype=dtype, backend=Backend.resolve("strict"))
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        x, y = (rng.integers(0, cfg.vocab_size, (3, cfg.block_size)) for _ in range(2))
        _, loss = model(x, y)
        model.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return losses, {n: np.asarray(p.data.get()) for n, p in model.named_parameters()}


def test_a_gpt_trains_the_same_with_fused_attention(monkeypatch):
    """Three AdamW steps on the strict module in float64: losses and every parameter as
    with the batched products and kept weights, to 1e-10."""
    fused_losses, fused = _train(monkeypatch, "fused")
    losses, params = _train(monkeypatch, "batched")
    np.testing.assert_allclose(fused_losses, losses, rtol=1e-10)
    assert losses[-1] < losses[0]
    for name, value in params.items():
        np.testing.assert_allclose(fused[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


def test_dropout_of_the_weights_keeps_the_batched_path(monkeypatch):
    """With dropout the fused choice changes nothing: the draws are a T x T array."""
    assert _train(monkeypatch, "fused", 0.1, 2)[0] == _train(monkeypatch, "batched", 0.1, 2)[0]


def _block_launches_by_op(monkeypatch, choice):
    from test_strict_launches import _block_launches
    monkeypatch.setenv("MPISHARD_ATTENTION", choice)
    return _block_launches("ddp", dropout=0.0)


def test_fused_attention_takes_five_launches_fewer_per_block(monkeypatch):
    """Forward: one kernel for two products and the softmax; backward: two for four
    products and the softmax's backward."""
    fused, fused_ops = _block_launches_by_op(monkeypatch, "fused")
    batched, batched_ops = _block_launches_by_op(monkeypatch, "batched")
    assert fused == batched - 5, (fused_ops, batched_ops)
    for kernel in ("mpishard_flash_forward", "mpishard_flash_dq", "mpishard_flash_dkv"):
        assert fused_ops.get(kernel) == 2 and kernel not in batched_ops, (kernel, fused_ops)
    assert "mpishard_causal_softmax" not in fused_ops


def _kept_by_choice(monkeypatch, cls, cfg, B: int, T: int, precision) -> dict:
    """``{choice: (measured, planned)}``: the activation bytes a second training step
    keeps on the strict module (tracemalloc) and the model's plan of them, with batched
    and with fused attention. The first step is not measured: what a process builds
    once (caches) is not an activation, and once made a first step 2.1% over the plan."""
    from mpishard.comm import Mesh
    from mpishard.parallel import ParallelModel
    from mpishard.testing.fake_cupy import make_test_comm
    figures = {}
    for choice in ("batched", "fused"):
        monkeypatch.setenv("MPISHARD_ATTENTION", choice)
        model = cls(cfg, seed=0, backend=Backend.resolve("strict"), materialize_now=False)
        comm = make_test_comm("self")
        try:
            run = ParallelModel(model, Mesh(comm, dp=1), strategy="ddp", precision=precision)
            r = np.random.default_rng(0)
            x, y = (r.integers(0, cfg.vocab_size, (B, T)) for _ in range(2))
            run.train_step(x, y)
            run.zero_grad()
            run.pipeline.measure_activations = True
            run.train_step(x, y)
            figures[choice] = (run.pipeline.activation_bytes,
                               model.activation_bytes(B, T, precision or "float32"))
        finally:
            comm.free()
    return figures


@pytest.mark.parametrize("precision", [None, "float16"])
def test_fused_attention_keeps_what_the_plan_says(monkeypatch, precision):
    """Activation bytes of a training step on the strict module (its memory is NumPy's,
    measured by tracemalloc) against the plan, and the T x T weights no longer kept."""
    B, T = 4, 64
    cfg = GPTConfig(vocab_size=64, block_size=T, n_layer=2, n_head=2, n_embd=32)
    dtype = precision or "float32"
    figures = _kept_by_choice(monkeypatch, GPT, cfg, B, T, precision)
    for choice, (measured, planned) in figures.items():
        assert abs(planned - measured) <= 0.02 * measured, (choice, measured, planned)
    c = np.dtype(dtype).itemsize
    heads, hs = cfg.n_head, cfg.n_embd // cfg.n_head
    saved = cfg.n_layer * (B * heads * T * T * 4 - B * T * heads * hs * c - B * heads * T * 4)
    assert figures["batched"][1] - figures["fused"][1] == saved
    assert figures["batched"][0] - figures["fused"][0] >= 0.9 * saved


def test_the_choice_is_checked(monkeypatch):
    monkeypatch.setenv("MPISHARD_ATTENTION", "flash")
    with pytest.raises(ValueError, match="MPISHARD_ATTENTION='flash': use one of batched, fused"):
        kernels.check_settings()
    monkeypatch.setenv("MPISHARD_ATTENTION", "fused")
    assert kernels.fused_attention(strict, 64, dropout=False)
    assert not kernels.fused_attention(np, 64, dropout=False)       # NumPy's own loop
    assert not kernels.fused_attention(strict, 64, dropout=True)
    assert not kernels.fused_attention(strict, 256, dropout=False)  # over the head size


@pytest.mark.parametrize("dtype,tol", [(np.float32, 3e-5), (np.float16, 4e-3)])
def test_fused_kernels_on_each_array_module(array_backend, dtype, tol):
    """The kernel set of each array module (on CuPy the compiled kernels, at a head size
    of 64 and rows across two tiles) against the reference on NumPy."""
    xp = array_backend.xp
    k = kernels.kernels_for(xp)
    r = np.random.default_rng(4)
    hm = r.standard_normal((3, 2, 3, 70, 64)).astype(dtype)
    gy = r.standard_normal((2, 3, 70, 64)).astype(dtype)
    y, lse = k.flash_attention_forward(xp.asarray(hm), 0.125)
    dh = k.flash_attention_backward(xp.asarray(hm), y, xp.asarray(gy), lse, 0.125)
    want_y, want_lse = reference.flash_attention_forward(hm, 0.125)
    want = reference.flash_attention_backward(hm, want_y, gy, want_lse, 0.125)

    def host(a):
        return np.asarray(a.get() if hasattr(a, "get") else a, dtype=np.float64)
    np.testing.assert_allclose(host(y), want_y.astype(np.float64), rtol=tol, atol=tol)
    np.testing.assert_allclose(host(lse), want_lse, rtol=tol, atol=tol)
    np.testing.assert_allclose(host(dh), want.astype(np.float64), rtol=4 * tol, atol=4 * tol)


LLAMA = LlamaConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                    intermediate_size=48)


def _train_llama(monkeypatch, choice, steps=3):
    monkeypatch.setenv("MPISHARD_ATTENTION", choice)
    model = Llama(LLAMA, seed=0, dtype="float64", backend=Backend.resolve("strict"))
    one_op = model.model.layers["0"].self_attn.takes_one_op_path(model.backend.xp)
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, LLAMA.vocab_size, (3, LLAMA.block_size)) for _ in range(2))
    losses = []
    for _ in range(steps):          # one batch, so that the loss must come down
        _, loss = model(x, y)
        model.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return one_op, losses, {n: np.asarray(p.data.get()) for n, p in model.named_parameters()}


def test_a_llama_trains_the_same_with_fused_attention(monkeypatch):
    """The fused choice takes a Llama's attention off the one grouped-query op (which
    keeps the softmax weights) onto the flash kernels; three AdamW steps in float64 give
    the losses and parameters of the batched choice, to 1e-10."""
    one_op_fused, fused_losses, fused = _train_llama(monkeypatch, "fused")
    one_op, losses, params = _train_llama(monkeypatch, "batched")
    assert one_op and not one_op_fused
    np.testing.assert_allclose(fused_losses, losses, rtol=1e-10)
    assert losses[-1] < losses[0]
    for name, value in params.items():
        np.testing.assert_allclose(fused[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("precision", [None, "bfloat16", "float16"])
def test_a_llama_with_fused_attention_keeps_what_the_plan_says(monkeypatch, precision):
    """A Llama's training step on the strict module: measured activation bytes against the
    plan with either choice, and the fused one without the T x T weights."""
    B, T = 2, 64
    cfg = LlamaConfig(vocab_size=64, block_size=T, n_layer=2, n_head=4, n_kv_head=2,
                      n_embd=32, intermediate_size=48)
    figures = _kept_by_choice(monkeypatch, Llama, cfg, B, T, precision)
    for choice, (measured, planned) in figures.items():     # the layouts' tolerance
        assert abs(planned - measured) <= 0.05 * measured, (choice, measured, planned)
    # the one op's float32 softmax weights go, its rotations' conjugates and its rotated
    # q, k and v (in the rows' dtype on a device; the per-projection path lets go of
    # the projections' outputs once packed); the per-projection path's packed copy of
    # q and of k, v per query head (its kernels keep no rotation tables: they read the
    # model's), the flash output, the log-sum-exp and the graph objects of three
    # products and a packing come
    c = np.dtype(precision or "float32").itemsize
    f = 4 if c == 2 else c
    N, h, h_kv, hs = B * T, cfg.n_head, cfg.n_kv_head, cfg.n_embd // cfg.n_head
    saved = cfg.n_layer * (B * h * T * T * 4 + T * hs * (h + h_kv) * f
                           + N * hs * (h + 2 * h_kv) * c - 3 * N * h * hs * c
                           - N * h * hs * c - B * h * T * 4 - _OBJECTS_PER_PROJECTION_PATH)
    assert saved > 0
    assert figures["batched"][1] - figures["fused"][1] == saved
    assert figures["batched"][0] - figures["fused"][0] >= 0.7 * saved   # each within 5%

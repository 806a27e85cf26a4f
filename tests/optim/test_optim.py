"""Optimizers against independent float64 references (and torch when installed)."""
import math

import numpy as np
import pytest

from mpishard.core.backend import MemoryLedger
from mpishard.nn import Constant, Normal, Parameter
from mpishard.optim import (SGD, Adam, AdamW, CosineSchedule, clip_grad_norm,
                            global_grad_norm)


def _params(seed=0):
    r = np.random.default_rng(seed)
    w = Parameter((3, 4), Normal(), decay=True, dtype="float64")
    b = Parameter((4,), Constant(), decay=False, dtype="float64")
    w.data, b.data = r.standard_normal((3, 4)), r.standard_normal(4)
    return [w, b]


def _grads(step, shapes):
    r = np.random.default_rng(100 + step)
    return [r.standard_normal(s) for s in shapes]


def _reference_adam(p0, grads, lr, b1, b2, eps, wd, decoupled, decays):
    ps = [p.copy() for p in p0]
    m = [np.zeros_like(p) for p in ps]
    v = [np.zeros_like(p) for p in ps]
    for t, gs in enumerate(grads, start=1):
        for i, g in enumerate(gs):
            if wd and decays[i]:
                if decoupled:
                    ps[i] = ps[i] * (1 - lr * wd)
                else:
                    g = g + wd * ps[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            mhat, vhat = m[i] / (1 - b1 ** t), v[i] / (1 - b2 ** t)
            ps[i] = ps[i] - lr * mhat / (np.sqrt(vhat) + eps)
    return ps


@pytest.mark.parametrize("cls,decoupled", [(Adam, False), (AdamW, True)])
def test_adam_family_matches_reference(cls, decoupled):
    params = _params()
    p0 = [p.data.copy() for p in params]
    opt = cls(params, lr=0.01, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1)
    all_grads = []
    for step in range(5):
        gs = _grads(step, [p.shape for p in params])
        all_grads.append(gs)
        for p, g in zip(params, gs):
            p.grad = g
        opt.step()
    ref = _reference_adam(p0, all_grads, 0.01, 0.8, 0.95, 1e-8, 0.1, decoupled, [True, False])
    for p, r in zip(params, ref):
        assert np.allclose(p.data, r, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_matches_reference(nesterov):
    params = _params()
    ps = [p.data.copy() for p in params]
    bufs = [None, None]
    opt = SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=nesterov)
    for step in range(4):
        gs = _grads(step, [p.shape for p in params])
        for i, (p, g) in enumerate(zip(params, gs)):
            p.grad = g
            d = g + (0.01 * ps[i] if i == 0 else 0)
            bufs[i] = d.copy() if bufs[i] is None else 0.9 * bufs[i] + d
            d = d + 0.9 * bufs[i] if nesterov else bufs[i]
            ps[i] = ps[i] - 0.1 * d
        opt.step()
    for p, r in zip(params, ps):
        assert np.allclose(p.data, r, rtol=1e-13)


def test_adamw_matches_torch():
    torch = pytest.importorskip("torch")
    params = _params()
    tparams = [torch.nn.Parameter(torch.from_numpy(p.data.copy())) for p in params]
    ours = AdamW(params, lr=0.01, weight_decay=0.1)
    theirs = torch.optim.AdamW([{"params": [tparams[0]], "weight_decay": 0.1},
                                {"params": [tparams[1]], "weight_decay": 0.0}], lr=0.01)
    for step in range(5):
        for p, tp, g in zip(params, tparams, _grads(step, [p.shape for p in params])):
            p.grad, tp.grad = g, torch.from_numpy(g.copy())
        ours.step()
        theirs.step()
    for p, tp in zip(params, tparams):
        assert np.allclose(p.data, tp.detach().numpy(), rtol=1e-12, atol=1e-14)


def test_flat_target_with_decay_ranges_equals_separate_parameters():
    """What a ZeRO shard does: one flat array spanning parameters."""
    params = _params()
    flat = type("Flat", (), {})()
    flat.data = np.concatenate([p.data.ravel() for p in params])
    flat.decay_ranges = ((0, 12),)
    a, b = AdamW(params, lr=0.01, weight_decay=0.1), AdamW([flat], lr=0.01, weight_decay=0.1)
    for step in range(3):
        gs = _grads(step, [p.shape for p in params])
        for p, g in zip(params, gs):
            p.grad = g
        flat.grad = np.concatenate([g.ravel() for g in gs])
        a.step()
        b.step()
    assert np.array_equal(flat.data, np.concatenate([p.data.ravel() for p in params]))


def test_state_is_counted_and_round_trips():
    ledger = MemoryLedger()
    params = _params()
    opt = AdamW(params, lr=0.01, ledger=ledger)
    opt.allocate_state()
    assert ledger.bytes_by_category()["optim"] == 2 * 16 * 8
    for p, g in zip(params, _grads(0, [p.shape for p in params])):
        p.grad = g
    opt.step()
    other = AdamW(_params(), lr=0.01)
    other.load_state_dict(opt.state_dict())
    assert other.step_count == 1
    assert np.array_equal(other.state[0]["exp_avg"], opt.state[0]["exp_avg"])


def test_cosine_schedule():
    s = CosineSchedule(lr=1.0, warmup_steps=4, decay_steps=14, min_lr=0.1)
    assert s(0) == pytest.approx(0.2) and s(3) == pytest.approx(0.8)
    assert s(4) == pytest.approx(1.0)
    assert s(9) == pytest.approx(0.1 + 0.9 * 0.5)
    assert s(14) == s(100) == 0.1
    with pytest.raises(ValueError, match="warmup_steps"):
        CosineSchedule(1.0, 10, 5)


def test_clip_grad_norm():
    params = _params()
    params[0].grad = np.full((3, 4), 1.0)
    params[1].grad = np.full(4, 2.0)
    norm = clip_grad_norm(params, 1.0)
    assert norm == pytest.approx(math.sqrt(12 + 16))
    assert global_grad_norm(params) == pytest.approx(1.0, rel=1e-5)
    params[1].grad[0] = np.inf
    before = params[0].grad.copy()
    assert not math.isfinite(clip_grad_norm(params, 1.0))
    assert np.array_equal(params[0].grad, before)


def test_bad_arguments():
    with pytest.raises(ValueError, match="empty parameter list"):
        AdamW([], lr=0.1)
    with pytest.raises(ValueError, match="betas"):
        Adam(_params(), betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="nesterov"):
        SGD(_params(), nesterov=True)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_the_device_norm_is_two_kernels_for_all_gradients_and_no_read(dtype):
    """On a device (the CuPy-strict module) all the gradients' sums of squares are two
    multi-tensor kernels (the chunks' sums, then each gradient's) into their slots,
    added in order by one cumulative sum into a 0-d device array that is not read
    back (a step decides on it there); the sum is NumPy's to rounding, with non-finite
    gradients, empty ones and Nones among them. 16-bit gradients: one by one (a copy,
    a product, a set)."""
    from mpishard.testing import strict
    from mpishard.optim.clip import grad_sq_sum

    rng = np.random.default_rng(0)
    host = [rng.standard_normal(s).astype(dtype) for s in ((3, 5), (7,), (0,), (2, 3, 4))]
    want = grad_sq_sum(host + [None])
    device = [strict.asarray(h) for h in host] + [None]
    strict.syncs.reset()
    got = grad_sq_sum(device)
    assert strict.syncs.count == 0 and got.shape == ()
    fused = 1 if dtype != np.float16 else 0         # 16-bit: the copy, the product, the set
    assert strict.syncs.launches_by_op.get("mpishard_multi_sq_sum", 0) == fused
    assert strict.syncs.launches_by_op.get("mpishard_multi_sq_total", 0) == fused
    # the slots' zeros, the two kernels, the cumulative sum
    assert strict.syncs.launches == 4 or dtype == np.float16
    assert float(got) == pytest.approx(want, rel=1e-12)
    device[1][2] = np.inf
    assert float(grad_sq_sum(device)) == math.inf


def test_an_optimizer_whose_step_takes_no_grad_scale_still_gets_clipped_gradients():
    """A strategy hands its unscale-and-clip factor to ``step(grad_scale=...)``; an
    optimizer with its own ``step()`` gets its gradients scaled in place first, the same
    update either way."""
    from mpishard.comm import Mesh
    from mpishard.testing.fake_cupy import make_test_comm
    from mpishard.models import GPT, GPTConfig
    from mpishard.parallel import ParallelModel

    class OwnStep(AdamW):
        def step(self):                       # an optimizer written before grad_scale
            super().step()

    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    results = []
    for cls in (AdamW, OwnStep):
        comm = make_test_comm("self")
        try:
            run = ParallelModel(GPT(cfg, seed=0, dtype="float64", materialize_now=False),
                                Mesh(comm, dp=1), strategy="ddp")
            opt = cls(run.parameters(), lr=1e-2)
            x = np.random.default_rng(0).integers(0, 32, (2, 8))
            run.train_step(x, x)
            assert run.step(opt, max_norm=1e-3).grad_norm > 1e-3     # clipping applied
            results.append([p.data.copy() for p in run.module.parameters()])
        finally:
            comm.free()
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)

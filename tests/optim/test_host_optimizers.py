"""The host's optimizers: AdamW (mpishard/kernels/cpu/adam.py) is PyTorch's AdamW update to
float32 rounding and the same bits whatever the threads, compiled (numba) or as NumPy
passes; SGD's blocks over threads are PyTorch's SGD and the same bits whatever the threads."""
import math

import numpy as np
import pytest

from mpishard.kernels.cpu import adam
from mpishard.optim import SGD, AdamW
from mpishard.parallel.flat import FlatShard

# a size that divides by nothing useful, above the threads' minimum (threads.MIN_PARALLEL_ELEMS)
N = 3 * 65_536 + 1_001
ARGS = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _arrays(n: int, dtype, seed: int = 0):
    r = np.random.default_rng(seed)
    p, g, m = (r.standard_normal(n).astype(dtype) for _ in range(3))
    return [p, g, m, np.abs(r.standard_normal(n)).astype(dtype)]


def _step_args(t: int, grad_scale=0.37, decay=1.0 - 1e-3):
    b1, b2 = ARGS["betas"]
    return (b1, b2, ARGS["lr"] / (1.0 - b1 ** t), 1.0 / math.sqrt(1.0 - b2 ** t), ARGS["eps"],
            grad_scale, decay)


def _run(kernel, targets, steps: int = 3) -> list:
    """``steps`` updates of copies of ``targets`` by ``kernel``; the arrays after."""
    mine = [([a.copy() for a in t[:4]], t[4]) for t in targets]
    for t in range(1, steps + 1):
        kernel([(*arrays, ranges) for arrays, ranges in mine], *_step_args(t))
    return [a for arrays, _ in mine for a in arrays]


def _targets(dtype):
    """Two targets: one with two decay ranges (a ZeRO shard over several parameters),
    one undecayed and too small for threads."""
    big, small = _arrays(N, dtype), _arrays(777, dtype, seed=1)
    return [(*big, ((5, 40_000), (65_536, 2 * 65_536 + 3))), (*small, ())]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_passes_give_the_same_bits_at_any_thread_count(dtype, monkeypatch):
    results = []
    for threads in (1, 2, 3):
        monkeypatch.setenv("MPISHARD_THREADS", str(threads))
        results.append(_run(adam.numpy_multi_adam_update, _targets(dtype)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_compiled_loop_is_the_numpy_passes_bit_for_bit_at_any_thread_count(dtype,
                                                                               monkeypatch):
    pytest.importorskip("numba")
    assert adam.compiled_adam() is not None
    monkeypatch.setenv("MPISHARD_THREADS", "1")
    want = _run(adam.numpy_multi_adam_update, _targets(dtype))
    assert not np.array_equal(want[0], _targets(dtype)[0][0])     # something was updated
    for threads in (1, 2, 3):
        monkeypatch.setenv("MPISHARD_THREADS", str(threads))
        got = _run(adam.compiled_multi_adam_update, _targets(dtype))
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


def test_targets_the_loop_does_not_take_go_to_the_numpy_passes(monkeypatch):
    """Strided views and 16-bit arrays are updated by the NumPy passes, beside compiled
    targets in the same call, each as it would be alone."""
    base = _arrays(2 * 1_000, np.float32)
    strided = [a[::2] for a in base]
    half = _arrays(500, np.float16, seed=3)
    plain = _arrays(1_000, np.float32, seed=4)
    want = _run(adam.numpy_multi_adam_update, [(*[a.copy() for a in strided], ()),
                                               (*half, ()), (*plain, ((0, 10),))])
    monkeypatch.setattr(adam, "COMPILED_MIN_ELEMS", 0)
    got = _run(adam.multi_adam_update, [(*strided, ()), (*half, ()), (*plain, ((0, 10),))])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert not adam._compilable((*strided, ())) and not adam._compilable((*half, ()))
    assert not adam._compilable((*plain, ((10, 20), (0, 5))))      # unsorted ranges


def test_without_numba_the_optimizer_runs_the_numpy_passes(monkeypatch):
    """The fallback: the kernel set's step with no compiled loop is the NumPy passes."""
    monkeypatch.setattr(adam, "compiled_adam", lambda: None)
    want = _run(adam.numpy_multi_adam_update, _targets(np.float32))
    got = _run(adam.multi_adam_update, _targets(np.float32))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("numba", [True, False], ids=["compiled", "numpy"])
def test_adamw_over_flat_float32_buffers_is_torchs_adamw(threads, numba, monkeypatch):
    """mpishard's AdamW on flat float32 targets (one decayed, one not, one decayed in
    part), 5 steps with the same gradients as torch.optim.AdamW: the same parameters and
    state to float32 rounding."""
    torch = pytest.importorskip("torch")
    if numba:
        pytest.importorskip("numba")
        monkeypatch.setattr(adam, "COMPILED_MIN_ELEMS", 0)    # the loop at this small size
    else:
        monkeypatch.setattr(adam, "compiled_adam", lambda: None)
    monkeypatch.setenv("MPISHARD_THREADS", str(threads))
    torch.set_num_threads(threads)
    r = np.random.default_rng(7)
    sizes = (N, 999, 4_096)
    start = [r.standard_normal(n).astype(np.float32) for n in sizes]
    ranges = [((0, N),), (), ((0, 1_000),)]
    targets = [FlatShard(p.copy(), rg, f"t{i}") for i, (p, rg) in enumerate(zip(start, ranges))]
    ours = AdamW(targets, **ARGS)
    params = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in start[:2]]
    parts = [torch.nn.Parameter(torch.from_numpy(start[2][:1_000].copy())),
             torch.nn.Parameter(torch.from_numpy(start[2][1_000:].copy()))]
    theirs = torch.optim.AdamW([{"params": [params[0], parts[0]]},
                                {"params": [params[1], parts[1]], "weight_decay": 0.0}],
                               **ARGS, fused=True)
    for _ in range(5):
        grads = [r.standard_normal(n).astype(np.float32) for n in sizes]
        for t, g in zip(targets, grads):
            t.grad = g
        for p, g in zip(params, grads):
            p.grad = torch.from_numpy(g.copy())
        parts[0].grad = torch.from_numpy(grads[2][:1_000].copy())
        parts[1].grad = torch.from_numpy(grads[2][1_000:].copy())
        ours.step()
        theirs.step()
    want = [p.detach().numpy() for p in params] + \
        [np.concatenate([parts[0].detach().numpy(), parts[1].detach().numpy()])]
    for t, w, p0 in zip(targets, want, start):
        assert t.data.dtype == np.float32
        assert not np.array_equal(t.data, p0)
        # each element moved by about lr per step; float32 rounding of values ~1: 6e-8
        np.testing.assert_allclose(t.data, w, rtol=0, atol=4e-7)
    state = theirs.state[params[0]]
    np.testing.assert_allclose(ours.state[0]["exp_avg"], state["exp_avg"].numpy(),
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ours.state[0]["exp_avg_sq"], state["exp_avg_sq"].numpy(),
                               rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_over_threads_is_torchs_sgd_and_the_same_bits(nesterov, monkeypatch):
    """SGD with momentum and weight decay on a target decayed in part, gradients scaled
    by the strategy's factor: the same bits at 1-3 threads, torch's SGD to rounding."""
    torch = pytest.importorskip("torch")
    r = np.random.default_rng(3)
    start = r.standard_normal(N).astype(np.float32)
    grads = [r.standard_normal(N).astype(np.float32) for _ in range(4)]
    cut = 70_001
    results = []
    for threads in (1, 2, 3):
        monkeypatch.setenv("MPISHARD_THREADS", str(threads))
        target = FlatShard(start.copy(), ((0, cut),), "t")
        opt = SGD([target], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=nesterov)
        for g in grads:
            target.grad = g * 2.0                 # unscaled by the step's factor below
            opt.step(grad_scale=0.5)
        results.append(target.data)
    for other in results[1:]:
        np.testing.assert_array_equal(results[0], other)
    parts = [torch.nn.Parameter(torch.from_numpy(start[:cut].copy())),
             torch.nn.Parameter(torch.from_numpy(start[cut:].copy()))]
    theirs = torch.optim.SGD([{"params": [parts[0]]}, {"params": [parts[1]], "weight_decay": 0.0}],
                             lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=nesterov)
    for g in grads:
        parts[0].grad = torch.from_numpy(g[:cut].copy())
        parts[1].grad = torch.from_numpy(g[cut:].copy())
        theirs.step()
    want = np.concatenate([p.detach().numpy() for p in parts])
    assert not np.array_equal(results[0], start)
    np.testing.assert_allclose(results[0], want, rtol=0, atol=2e-6)


def test_small_steps_never_import_the_compiled_loop(monkeypatch):
    """Below COMPILED_MIN_ELEMS the NumPy passes run without asking for numba (whose
    import and load cost about a second a process); at or above it, the compiled loop."""
    asked = []
    monkeypatch.setattr(adam, "compiled_adam", lambda: asked.append(1))   # None: no numba
    targets = _targets(np.float32)
    monkeypatch.setattr(adam, "COMPILED_MIN_ELEMS", sum(t[0].size for t in targets) + 1)
    want = _run(adam.numpy_multi_adam_update, _targets(np.float32))
    got = _run(adam.multi_adam_update, targets)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert not asked
    monkeypatch.setattr(adam, "COMPILED_MIN_ELEMS", 0)
    _run(adam.multi_adam_update, _targets(np.float32))
    assert asked

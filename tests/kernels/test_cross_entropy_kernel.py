"""Cross-entropy as a kernel of each set (mpishard/kernels/: reference, cpu, cuda/loss.py).

* the GPU's two RawKernels, their CUDA C run on the host (tests/cuda_host.py) through
  the kernel set's own launch code, equal the reference: float32, float64, float16 and
  bfloat16 logits (16-bit ones read as they lie, to their rounding), ignored targets, rows
  narrower and wider than a block, widths off the warps, no row counted; the grid's
  last block sums the loss and hands its ticket back;
* on NumPy the op's loss and gradient are, bit for bit, the row-block operations
  cross-entropy has always run;
* on the CuPy-strict module the op is one launch each way, with no host sync;
* on each array module (CuPy where there is a GPU: the GPU check runs this) the op
  equals a float64 reference.
"""
from __future__ import annotations

import numpy as np
import pytest

from cuda_host import use_host_kernels
from mpishard.autodiff import Tensor
from mpishard.autodiff.softmax_ops import cross_entropy
from mpishard.core.backend import to_numpy
from mpishard.core.dtypes import resolve_dtype
from mpishard.kernels import reference
from mpishard.kernels.cpu import ops as cpu
from mpishard.kernels.cuda import loss as gpu_loss
from mpishard.kernels.cuda.launch import block_tickets
from mpishard.kernels.rows import row_max, row_sum
from mpishard.testing import strict

IGNORE = -100
BFLOAT16 = resolve_dtype("bfloat16")


def _logits_and_targets(N, V, dtype, seed=0, every=4):
    r = np.random.default_rng(seed + N + V)
    x = (3 * r.standard_normal((N, V))).astype(dtype)
    t = r.integers(0, V, N)
    if every:
        t[1::every] = IGNORE
    return x, t


@pytest.fixture
def host_loss_kernels(monkeypatch):
    use_host_kernels(monkeypatch)


def _assert_within_rounding(got, want, dtype):
    """Equal to ``dtype``'s rounding: a unit in the last place of ``want`` (float16), or a
    few float32 / float64 units in a row's sum."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if np.dtype(dtype).itemsize == 2:
        if np.dtype(dtype) == np.float16:
            ulp = np.spacing(np.abs(want.astype(np.float32)).astype(np.float16)).astype(
                np.float32)
        else:          # bfloat16 keeps 16 fewer mantissa bits than float32
            ulp = np.spacing(np.abs(want.astype(np.float32))) * np.float32(2 ** 16)
        err = np.abs(got.astype(np.float32) - want.astype(np.float32))
        assert (err <= ulp).all(), float((err / ulp).max())
    else:
        tol = 1e-12 if np.dtype(dtype) == np.float64 else 2e-6
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16, np.float64])
@pytest.mark.parametrize("N,V,threads", [(5, 33, 256), (3, 300, 256), (4, 769, 64),
                                         (1, 1, 256), (7, 50, 32)], ids=str)
def test_host_cuda_kernels_equal_the_reference(host_loss_kernels, monkeypatch, N, V, threads,
                                               dtype):
    """Widths below a block, above it (several passes), off the warps, one class; 16-bit
    logits read as they lie and the gradient written in their dtype."""
    monkeypatch.setattr(gpu_loss, "ROW_THREADS", threads)
    x, t = _logits_and_targets(N, V, dtype)
    got = gpu_loss.cross_entropy_forward(x, t, IGNORE)
    want = reference.cross_entropy_forward(x, t, IGNORE)
    fd = np.float64 if dtype == np.float64 else np.float32
    assert all(a.dtype == fd for a in got)
    assert not block_tickets(np, 1).any()                 # handed back for the next launch
    tol = 1e-12 if dtype == np.float64 else 2e-6
    for a, b in zip(got, want):                            # loss, maxima, sums, count
        np.testing.assert_allclose(a, b, rtol=tol, atol=0)
    g = np.asarray(0.75, dtype=fd)                         # the loss's gradient
    grad = gpu_loss.cross_entropy_backward(x, t, IGNORE, *got[1:], g)
    _assert_within_rounding(grad, reference.cross_entropy_backward(x, t, IGNORE, *want[1:], g),
                            dtype)
    assert not grad[t == IGNORE].any()


def test_host_cuda_kernels_count_only_what_they_should(host_loss_kernels, monkeypatch):
    """No row counted: a nan loss and a zero gradient; int32 targets; a target out of
    range: a nan loss (nothing read back to check it); many rows in the last block's sum."""
    x, t = _logits_and_targets(3, 40, np.float32, every=0)
    loss, m, s, count = gpu_loss.cross_entropy_forward(x, np.full(3, IGNORE), IGNORE)
    assert np.isnan(loss) and count == 0
    grad = gpu_loss.cross_entropy_backward(x, np.full(3, IGNORE), IGNORE, m, s, count,
                                           np.asarray(1.0, np.float32))
    assert not grad.any()
    got = gpu_loss.cross_entropy_forward(x, t.astype(np.int32), IGNORE)
    np.testing.assert_allclose(got[0], reference.cross_entropy_forward(x, t, IGNORE)[0],
                               rtol=2e-6)
    bad = t.copy()
    bad[1] = 40
    assert np.isnan(gpu_loss.cross_entropy_forward(x, bad, IGNORE)[0])
    monkeypatch.setattr(gpu_loss, "ROW_THREADS", 32)
    x, t = _logits_and_targets(150, 3, np.float32, every=7)  # 150 rows over 32 threads
    np.testing.assert_allclose(gpu_loss.cross_entropy_forward(x, t, IGNORE)[0],
                               reference.cross_entropy_forward(x, t, IGNORE)[0], rtol=2e-6)
    assert not block_tickets(np, 1).any()


def _as_cross_entropy_ran(x, t, g):
    """The row-block operations cross-entropy ran before it became a kernel, written out
    on the whole array (the block size changes no bit: tests/autodiff/test_cross_entropy.py)."""
    up = x.astype(np.float32) if x.dtype.itemsize < 4 else x
    valid = t != IGNORE
    safe = np.where(valid, t, 0)
    m = row_max(up)
    e = up - m[:, None]
    picked = e[np.arange(len(t)), safe]
    np.exp(e, out=e)
    s = row_sum(e)
    per_row = np.log(s) - picked
    n = int(valid.sum())
    total = per_row.sum() if n == valid.size else (per_row * valid).sum()
    loss = np.asarray(total / n if n else total * float("nan"), dtype=up.dtype)
    p = up - m[:, None]
    np.exp(p, out=p)
    p *= (1.0 / s)[:, None]
    p[np.arange(len(t)), safe] -= 1.0
    if n != valid.size:
        p *= valid[:, None]
    p *= g / max(n, 1)
    return loss, p.astype(x.dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("N,V,every", [(37, 53, 4), (300, 1000, 0), (129, 4096, 3)], ids=str)
def test_numpy_loss_and_gradient_are_unchanged_bit_for_bit(N, V, every, dtype):
    x, t = _logits_and_targets(N, V, dtype, every=every)
    lt = Tensor(x, requires_grad=True)
    loss = cross_entropy(lt, t)
    loss.backward()
    want_loss, want_grad = _as_cross_entropy_ran(x, t, np.ones((), loss.data.dtype))
    assert loss.data.dtype == want_loss.dtype and loss.data.tobytes() == want_loss.tobytes()
    assert lt.grad.dtype == x.dtype and lt.grad.tobytes() == want_grad.tobytes()
    got = cpu.cross_entropy_forward(x, t, IGNORE)          # the CPU set's entries, directly
    assert got[0].tobytes() == want_loss.tobytes() and got[3] == int((t != IGNORE).sum())


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_one_launch_each_way_on_the_strict_module(dtype):
    x, t = _logits_and_targets(24, 70, dtype)
    lx = Tensor(strict.asarray(x), requires_grad=True)
    targets = strict.asarray(t)
    g = strict.ones((), dtype=np.float32)
    strict.syncs.reset()
    with strict.syncs.refused():                           # and no host sync
        loss = cross_entropy(lx, targets)
    assert dict(strict.syncs.launches_by_op) == {"mpishard_cross_entropy_forward": 1}
    strict.syncs.reset()
    with strict.syncs.refused():
        (grad,) = loss._backward(g)
    assert dict(strict.syncs.launches_by_op) == {"mpishard_cross_entropy_backward": 1}
    strict.syncs.reset()
    assert grad.dtype == x.dtype
    want = Tensor(x, requires_grad=True)
    want_loss = cross_entropy(want, t)
    want_loss.backward()
    tol = 2e-3 if dtype == np.float16 else 1e-6
    np.testing.assert_allclose(loss.item(), float(want_loss.data), rtol=tol)
    np.testing.assert_allclose(to_numpy(grad).astype(np.float32),
                               want.grad.astype(np.float32), rtol=tol, atol=tol / 24)


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float16, 2e-3)])
def test_cross_entropy_on_each_array_module(array_backend, dtype, tol):
    """The op against the loss and gradient in float64 (on CuPy: the RawKernels, 200
    rows of 3,000 classes, a quarter of them ignored)."""
    x, t = _logits_and_targets(200, 3000, dtype)
    lx = Tensor(array_backend.asarray(x), requires_grad=True)
    loss = cross_entropy(lx, array_backend.asarray(t))
    loss.backward()
    assert type(lx.grad) is type(lx.data) and lx.grad.dtype == x.dtype    # on the module
    x64 = x.astype(np.float64)
    lse = np.log(np.exp(x64 - x64.max(1, keepdims=True)).sum(1)) + x64.max(1)
    valid = t != IGNORE
    picked = x64[np.arange(len(t)), np.where(valid, t, 0)]
    want = ((lse - picked) * valid).sum() / valid.sum()
    p = np.exp(x64 - lse[:, None])
    p[np.arange(len(t)), np.where(valid, t, 0)] -= 1
    p *= valid[:, None] / valid.sum()
    np.testing.assert_allclose(float(to_numpy(loss.data)), want, rtol=tol)
    np.testing.assert_allclose(to_numpy(lx.grad).astype(np.float64), p, rtol=tol,
                               atol=tol / valid.sum())

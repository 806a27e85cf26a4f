"""The column-sum RawKernels over many row groups, run as CUDA C on the host
(tests/cuda_host.py): a bias's gradient with GELU's or dropout's backward, attention's
q, k and v gradients unpacked with their column sums, the norms' weight and bias
gradients (mpishard/kernels/cuda/ops_src.py, norms_src.py; see [Note: column sums]).

A launch has a grid of 32-column blocks by row groups; each block writes its partial
sums, and the last block of a column adds them in row-group order. Checked here:

* the launch geometry: enough blocks to fill a 132-SM device at a GPT's widths, row
  groups covering every row once;
* the sums are the kernel's order of additions, bit for bit (a NumPy model of that
  order, from the element gradients the kernel wrote), and within rounding of the
  references; the element outputs are bit for bit those of a one-group launch;
* bit-identical results with the blocks run in other orders (so whichever block
  arrives last), and the tickets back at zero after every launch;
* rows not a multiple of the group, widths not a multiple of 32, more groups than a
  block has row threads, float32, float64, float16 and bfloat16 rows.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cuda_host
from cuda_host import host_compiler, use_host_kernels
from mpishard.kernels import reference
from mpishard.kernels.cuda import launch
from mpishard.kernels.cuda import norms as gpu_norms
from mpishard.kernels.cuda import ops as gpu

pytestmark = pytest.mark.skipif(host_compiler() is None,
                                reason="no g++ to compile CUDA C for the host")

THREADS = launch.PARAM_ROW_THREADS


@pytest.fixture(autouse=True)
def host_kernels(monkeypatch):
    """The RawKernels on the host, each launch's workspace filled with NaN first (on a
    GPU it holds whatever was there: a block that read a partial sum before it was
    written would go unnoticed if a previous launch had left the same sums there)."""
    use_host_kernels(monkeypatch)
    launch._tickets.clear()

    def column_launch(xp, rows, n, sums, dtype):
        grid, block, (group, partial, counters) = launch.column_launch(xp, rows, n, sums,
                                                                       dtype)
        if partial is not counters:
            partial.fill(np.nan)
        return grid, block, (group, partial, counters)
    monkeypatch.setattr(gpu, "column_launch", column_launch)
    monkeypatch.setattr(gpu_norms, "column_launch", column_launch)
    yield
    launch._tickets.clear()


def _rand(shape, dtype, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _groups(rows, n) -> tuple:
    group = launch.column_groups(rows, n)
    return group, max(1, -(-rows // group))


def _in_kernel_order(v, group):
    """The column sums of ``v`` (rows x n, the compute dtype) added as the kernels add
    them: per group, row thread t sums rows t, t + 32, ... of it, the row threads'
    sums added in order; then row thread t sums groups t, t + 32, ..., and those in
    order (see [Note: column sums])."""
    def block_sum(rows_of):                         # rows_of(t): thread t's terms
        per_thread = []
        for t in range(THREADS):
            s = np.zeros(v.shape[1], dtype=v.dtype)
            for term in rows_of(t):
                s = s + term
            per_thread.append(s)
        total = per_thread[0]
        for s in per_thread[1:]:
            total = total + s
        return total
    rows = v.shape[0]
    groups = max(1, -(-rows // group))
    partial = [block_sum(lambda t, g=g: v[g * group:min(rows, (g + 1) * group)][t::THREADS])
               for g in range(groups)]
    if groups == 1:
        return partial[0]
    return block_sum(lambda t: partial[t::THREADS])


def _counters_are_zero():
    return all(not c.any() for c in launch._tickets.values())


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("rows,n", [(1024, 768), (1024, 3072), (8192, 768), (8192, 2304),
                                    (16384, 768), (65536, 3072), (3, 768)])
def test_a_launch_fills_the_device_and_its_groups_cover_the_rows(rows, n):
    grid, block, (group, partial, counters) = launch.column_launch(np, rows, n, 2,
                                                                   np.float32)
    assert block == (32, THREADS) and grid[0] == -(-n // 32)
    assert grid[1] * group >= rows > (grid[1] - 1) * group and group % THREADS == 0
    if rows >= 1024:                                # a GPT's B T: 2 to 4 blocks an SM
        assert grid[0] * grid[1] >= 2 * 132
    assert counters.dtype == np.uint32 and counters.size >= grid[0] and not counters.any()
    assert partial.size == (2 * grid[1] * n if grid[1] > 1 else counters.size)


# rows x n: one group; groups of 64 rows with a short last one and widths off 32; more
# groups than a block's 32 row threads (so a row thread adds several groups' sums)
SHAPES = [(37, 53), (1000, 70), (2100, 45)]


def _many_groups(rows, n):
    """The rows per group of the launch over ``rows x n``, checked to be the case the
    shape stands for."""
    group, groups = _groups(rows, n)
    assert groups == 1 if rows <= launch.MIN_GROUP_ROWS else groups > 1
    if rows == 2100:
        assert groups > THREADS and rows % group
    return group


def _one_group(monkeypatch):
    monkeypatch.setattr(launch, "MIN_GROUP_ROWS", 1 << 40)


def _orders(run):
    """``run()``'s results with the blocks in grid order and in two shuffles: the same
    bits each time, the tickets back at zero after each launch."""
    results = []
    for order in (0, 7, 12345):
        cuda_host.BLOCK_ORDER = order
        try:
            results.append(run())
        finally:
            cuda_host.BLOCK_ORDER = 0
        assert _counters_are_zero()
    for other in results[1:]:
        for a, b in zip(results[0], other):
            _same_bits(a, b)
    return results[0]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows,n", SHAPES, ids=str)
def test_bias_gelu_and_dropout_backward_over_row_groups(rows, n, dtype, monkeypatch):
    a, g = _rand((rows, n), dtype), _rand((rows, n), dtype, 2)
    t = np.tanh(_rand((rows, n), dtype, 1))
    bias, u = _rand(n, dtype, 3), np.random.default_rng(4).random((rows, n), dtype=np.float32)
    group = _many_groups(rows, n)
    gx, gb = _orders(lambda: gpu.bias_gelu_backward(a, bias, t, g))
    _same_bits(gb, _in_kernel_order(gx, group))
    wx, wb = reference.bias_gelu_backward(a, bias, t, g)
    tol = 1e-12 if dtype == np.float64 else 3e-5
    np.testing.assert_allclose(gx, wx, rtol=tol, atol=tol)
    np.testing.assert_allclose(gb, wb, rtol=tol * 30, atol=tol * 30)
    dropped = {}
    for draws in (u, None):
        gy, db = _orders(lambda: gpu.bias_dropout_backward(g, draws, 0.3))
        _same_bits(db, _in_kernel_order(gy, group))
        wy, wdb = reference.bias_dropout_backward(g, draws, 0.3)
        np.testing.assert_allclose(gy, wy, rtol=tol, atol=tol)
        np.testing.assert_allclose(db, wdb, rtol=tol * 30, atol=tol * 30)
        dropped[draws is None] = gy
    _one_group(monkeypatch)                         # the element outputs: as one group's
    _same_bits(gpu.bias_gelu_backward(a, bias, t, g)[0], gx)
    _same_bits(gpu.bias_dropout_backward(g, u, 0.3)[0], dropped[False])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_unpack_heads_over_row_groups(dtype, monkeypatch):
    """B T = 2 x 1050 rows of 3 x 3 heads x 5 (n = 45), with and without the sums; the
    sums into a given buffer."""
    h = _rand((3, 2, 3, 1050, 5), dtype)
    group = _many_groups(2100, 45)
    into = np.full(45, np.nan, dtype=dtype)
    rows, sums = _orders(lambda: gpu.unpack_heads(h, need_sum=True, out_sum=into))
    assert sums is into
    want_rows, want_sums = reference.unpack_heads(h, True)
    _same_bits(rows, want_rows)
    _same_bits(sums, _in_kernel_order(rows, group))
    np.testing.assert_allclose(sums, want_sums, rtol=1e-4 if dtype == np.float32 else 1e-12)
    rows, none = gpu.unpack_heads(h)
    assert none is None
    _same_bits(rows, want_rows)


ROWS = [(np.float32, np.float32), (np.float64, np.float64), (np.float16, np.float32),
        (ml_dtypes.bfloat16, np.float32)]


@pytest.mark.parametrize("row_dtype,dtype", ROWS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("rows,n", SHAPES, ids=str)
def test_norm_param_grads_over_row_groups(rows, n, row_dtype, dtype, monkeypatch):
    """The weight's and bias's gradients together, each alone; 16-bit rows summed in
    float32."""
    g, xhat = _rand((rows, n), row_dtype), _rand((rows, n), dtype, 1)
    group = _many_groups(rows, n)
    g_up = g.astype(dtype)
    want_w, want_b = _in_kernel_order(g_up * xhat, group), _in_kernel_order(g_up, group)
    for need in ((True, True), (True, False), (False, True)):
        got = _orders(lambda: [a for a in gpu.norm_param_grads(g, xhat, *need)
                               if a is not None])
        want = [w for w, needed in zip((want_w, want_b), need) if needed]
        assert len(got) == len(want)
        for a, w in zip(got, want):
            _same_bits(a, w)
    ref_w, ref_b = reference.norm_param_grads(g_up, xhat, True, True)
    tol = 1e-11 if dtype == np.float64 else 1e-3
    np.testing.assert_allclose(want_w, ref_w, rtol=tol, atol=tol)
    np.testing.assert_allclose(want_b, ref_b, rtol=tol, atol=tol)
    out_w, out_b = np.full(n, np.nan, dtype), np.full(n, np.nan, dtype)      # given buffers
    got_w, got_b = gpu.norm_param_grads(g, xhat, True, True, out_w, out_b)
    assert got_w is out_w and got_b is out_b
    _same_bits(out_w, want_w), _same_bits(out_b, want_b)


def test_a_launch_without_rows_writes_zero_sums():
    g = np.zeros((0, 40), np.float32)
    _, gb = gpu.bias_dropout_backward(g, None, 0.3, np.full(40, np.nan, np.float32))
    gw, gb2 = gpu.norm_param_grads(g, g, True, True)
    for sums in (gb, gw, gb2):
        _same_bits(sums, np.zeros(40, np.float32))

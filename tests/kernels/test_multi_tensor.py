"""Multi-tensor kernels: an optimizer step and the gradients' sums of squares over all
targets in one launch (mpishard/kernels/cuda/multi.py, multi_src.py).

The chunk table covers every element once and never crosses a weight-decay
boundary; the CUDA kernels, compiled for the host (tests/cuda_host.py) and
launched by the kernel set's own code on NumPy arrays, compute the reference
(float32 and float64, several targets of odd sizes, an empty one, decay ranges,
a gradient scale, chunks made small so that targets span several).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuda_host import use_host_kernels
from mpishard.kernels import reference
from mpishard.kernels.cuda import launch
from mpishard.kernels.cuda import multi as gpu_multi


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=5), st.integers(1, 9), st.data())
def test_the_chunk_table_covers_each_element_once(sizes, chunk, data):
    ranges = []
    for size in sizes:
        cuts = sorted(set(data.draw(st.lists(st.integers(0, size), max_size=4))))
        ranges.append(tuple(zip(cuts[::2], cuts[1::2])))
    gpu_multi.CHUNK, saved = chunk, gpu_multi.CHUNK
    try:
        table, first = gpu_multi.chunk_table(sizes, ranges)
    finally:
        gpu_multi.CHUNK = saved
    assert first[0] == 0 and first[-1] == len(table) and list(first) == sorted(first)
    for t, size in enumerate(sizes):
        rows = table[first[t]:first[t + 1]]
        assert (rows[:, 0] == t).all()
        covered = [e for _, a, b, _ in rows for e in range(a, b)]
        assert covered == list(range(size))                    # in order, once each
        assert all(0 < b - a <= chunk for _, a, b, _ in rows)
        decayed = {e for a, b in ranges[t] for e in range(a, b)}
        for _, a, b, flag in rows:
            assert {e in decayed for e in range(a, b)} == {bool(flag)}


@pytest.fixture
def host_multi(monkeypatch):
    use_host_kernels(monkeypatch)
    monkeypatch.setattr(gpu_multi, "CHUNK", 512)        # several chunks per target
    gpu_multi._tables.clear()
    yield
    gpu_multi._tables.clear()


def _targets(dtype, seed=0):
    r = np.random.default_rng(seed)
    sizes = [1300, 7, 0, 513, 2048]
    ranges = [((0, 1024),), (), ((0, 0),), ((1, 5), (100, 513)), ((0, 2048),)]
    return [(r.standard_normal(n).astype(dtype), r.standard_normal(n).astype(dtype),
             r.standard_normal(n).astype(dtype), np.abs(r.standard_normal(n)).astype(dtype),
             rg) for n, rg in zip(sizes, ranges)]


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-14), (np.float32, 2e-6)])
@pytest.mark.parametrize("grad_scale,decay", [(1.0, 1.0), (0.37, 0.999)])
def test_the_adam_kernel_is_the_reference(host_multi, dtype, tol, grad_scale, decay):
    got, want = _targets(dtype), _targets(dtype)
    for step in range(2):                # the second step reuses the cached tables
        gpu_multi.multi_adam_update(got, 0.9, 0.95, 1e-2, 1.3, 1e-8, grad_scale, decay)
        reference.multi_adam_update(want, 0.9, 0.95, 1e-2, 1.3, 1e-8, grad_scale, decay)
        for g, w in zip(got, want):
            for a, b in zip(g[:4], w[:4]):
                np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
    assert len(gpu_multi._tables) == 1


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_sum_of_squares_kernels_are_the_reference(host_multi, dtype):
    arrays = [t[1] for t in _targets(dtype, 1)]
    got = gpu_multi.multi_sq_sum(arrays, np.full(len(arrays), np.nan))
    want = reference.multi_sq_sum(arrays, np.empty(len(arrays)))
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert got[2] == 0.0                                   # the empty one



@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_arrays_the_kernels_do_not_take_go_one_by_one(host_multi, monkeypatch, dtype):
    """A strided or 16-bit gradient among them: that one through the one-array kernel,
    the others still together, every slot right."""
    one_by_one = []

    def sq_sum(x, out):
        one_by_one.append(x.shape)
        return reference.sq_sum(x, out)
    monkeypatch.setattr(gpu_multi, "sq_sum", sq_sum)
    r = np.random.default_rng(2)
    arrays = [r.standard_normal(700).astype(dtype), r.standard_normal((4, 6)).astype(dtype)[:, ::2],
              r.standard_normal(5).astype(dtype), r.standard_normal(9).astype(np.float16)]
    got = gpu_multi.multi_sq_sum(arrays, np.full(4, np.nan))
    np.testing.assert_allclose(got, reference.multi_sq_sum(arrays, np.empty(4)), rtol=1e-12)
    assert one_by_one == [(4, 3), (9,)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_multi_tensor_kernels_on_each_array_module(array_backend, dtype):
    """The kernel set of each array module (on CuPy the compiled kernels, on the strict
    module their launches) against the reference on NumPy."""
    from mpishard.kernels import kernels_for
    xp = array_backend.xp
    k = kernels_for(xp)
    host, want = _targets(dtype, 3), _targets(dtype, 3)
    dev = [tuple(xp.asarray(a) for a in t[:4]) + (t[4],) for t in host]
    k.multi_adam_update(dev, 0.9, 0.95, 1e-2, 1.3, 1e-8, 0.5, 0.99)
    reference.multi_adam_update(want, 0.9, 0.95, 1e-2, 1.3, 1e-8, 0.5, 0.99)
    tol = 1e-12 if dtype == np.float64 else 2e-6
    for d, w in zip(dev, want):
        for a, b in zip(d[:4], w[:4]):
            np.testing.assert_allclose(a.get() if hasattr(a, "get") else a, b, rtol=tol,
                                       atol=tol)
    grads = [xp.asarray(t[1]) for t in host]
    got = k.multi_sq_sum(grads, xp.empty(len(grads), dtype=np.float64))
    np.testing.assert_allclose(got.get() if hasattr(got, "get") else got,
                               reference.multi_sq_sum([t[1] for t in host],
                                                      np.empty(len(host))), rtol=1e-12)


@pytest.fixture
def table_work(host_multi, monkeypatch):
    """Records each table build and each host-to-device copy into a kept table (the
    real ones run)."""
    work = {"builds": 0, "copies": []}
    build = gpu_multi._Tables.__init__

    def counted_build(self, *args, **kwargs):
        work["builds"] += 1
        build(self, *args, **kwargs)

    def recorded_copy(device, host):
        work["copies"].append(host.copy())
        launch.copy_to_device(device, host)
    monkeypatch.setattr(gpu_multi._Tables, "__init__", counted_build)
    monkeypatch.setattr(gpu_multi, "copy_to_device", recorded_copy)
    return work


@pytest.mark.parametrize("moving", [False, True], ids=["kept gradients", "new gradients"])
def test_later_steps_keep_the_tables(table_work, moving):
    """Three Adam steps and gradient norms over the same targets, as an optimizer and a
    clipping make them: the tables are built once. With the gradients kept in buffers,
    steps 2 and 3 copy nothing to the device; with each step's gradients new arrays,
    one copy a step of the gradients' addresses alone (no rebuild), and every step is
    still the reference's."""
    got, want = _targets(np.float32, 5), _targets(np.float32, 5)
    r = np.random.default_rng(6)
    for step in range(3):
        if step:
            fresh = [r.standard_normal(t[0].size).astype(np.float32) for t in got]
            for i, g in enumerate(fresh):
                want[i] = (*want[i][:1], g.copy(), *want[i][2:])
                if moving:
                    got[i] = (*got[i][:1], g, *got[i][2:])
                else:
                    got[i][1][...] = g                 # the same buffer, new values
        copies = len(table_work["copies"])
        gpu_multi.multi_adam_update(got, 0.9, 0.95, 1e-2, 1.3, 1e-8, 0.5, 0.99)
        reference.multi_adam_update(want, 0.9, 0.95, 1e-2, 1.3, 1e-8, 0.5, 0.99)
        for g, w in zip(got, want):
            for a, b in zip(g[:4], w[:4]):
                np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6)
        grads = [t[1] for t in got]
        sums = gpu_multi.multi_sq_sum(grads, np.full(len(grads), np.nan))
        np.testing.assert_allclose(sums, reference.multi_sq_sum(grads, np.empty(len(grads))),
                                   rtol=1e-12)
        assert table_work["builds"] == 2                      # Adam's and the norm's
        new = table_work["copies"][copies:]
        if step == 0 or not moving:
            assert new == []
        else:     # Adam's gradient column (of targets with elements), the norm's table
            assert [list(c) for c in new] == [
                [g.ctypes.data for _, g, *_ in got if g.size], [g.ctypes.data for g in grads]]
    assert len(gpu_multi._tables) == 2


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("skip", [False, True])
def test_the_adam_kernel_reads_a_step_decided_on_the_device(host_multi, dtype, skip):
    """The step's size, bias correction and gradient factor as 0-d float64 device arrays
    and a 0-d skip flag (a step decided on the device, see [Note: device step decisions]):
    the kernel reads them, the same bits as the host's scalars, and a set flag leaves
    every target and its state as they were."""
    got, want, before = _targets(dtype), _targets(dtype), _targets(dtype)
    on_device = [np.array(x, dtype=np.float64) for x in (1e-2, 1.3, 0.37)]
    for _ in range(2):
        gpu_multi.multi_adam_update(got, 0.9, 0.95, *on_device[:2], 1e-8, on_device[2], 0.999,
                                    skip=np.array(skip))
        gpu_multi.multi_adam_update(want, 0.9, 0.95, 1e-2, 1.3, 1e-8, 0.37, 0.999)
    for g, w, b in zip(got, want, before):
        for a, x, y in zip(g[:4], w[:4], b[:4]):
            np.testing.assert_array_equal(a, y if skip else x)


@pytest.mark.parametrize("skip", [False, True])
def test_the_strict_adam_launch_reads_nothing_back(skip):
    """On the strict module the same call is one launch and no host read, the reference's
    bits (or nothing changed, skipped)."""
    from mpishard.kernels import kernels_for
    from mpishard.testing import strict

    host, want = _targets(np.float32, 4), _targets(np.float32, 4)
    dev = [tuple(strict.asarray(a) for a in t[:4]) + (t[4],) for t in host]
    scalars = [strict.full((), x, dtype=np.float64) for x in (1e-2, 1.3, 0.37)]
    flag = strict.full((), skip, dtype=bool)
    strict.syncs.reset()
    kernels_for(strict).multi_adam_update(dev, 0.9, 0.95, *scalars[:2], 1e-8, scalars[2], 0.99,
                                          skip=flag)
    assert strict.syncs.count == 0 and strict.syncs.launches == 1
    if not skip:
        reference.multi_adam_update(want, 0.9, 0.95, 1e-2, 1.3, 1e-8, 0.37, 0.99)
    for d, w in zip(dev, want):
        for a, b in zip(d[:4], w[:4]):
            np.testing.assert_array_equal(a.get(), b)

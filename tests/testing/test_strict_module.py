"""The CuPy-strict array module (mpishard.testing.strict) behaves like CuPy where CuPy differs.

Each refusal and each counted read below is one CuPy makes (cupy/_core/core.pyx,
_kernel.pyx, _routines_indexing.pyx): if the strict module stopped refusing or
counting, the tests that run on it would stop finding NumPy assumptions.
"""
import pickle

import numpy as np
import pytest

from mpishard.testing import strict
from mpishard.core.backend import Backend, to_numpy, xp_of


@pytest.fixture(autouse=True)
def fresh_counter():
    strict.syncs.reset()
    yield
    strict.syncs.reset()


def test_no_implicit_conversion_to_host():
    a = strict.asarray([1.0, 2.0])
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(a)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.array([a, a])
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.float64(1.0) * np.ones(2) + np.asarray(a)
    assert isinstance(a.get(), np.ndarray) and a.get().tolist() == [1.0, 2.0]
    assert to_numpy(a).tolist() == [1.0, 2.0] and strict.asnumpy(a).tolist() == [1.0, 2.0]


def test_numpy_arrays_are_not_operands():
    a = strict.ones(3)
    for host in (np.ones(3), np.asarray(0.0)):          # not even a 0-d one
        with pytest.raises(TypeError, match="Unsupported type <class 'numpy.ndarray'>"):
            a + host
        with pytest.raises(TypeError, match="Unsupported type"):
            host * a
        with pytest.raises(TypeError, match="Unsupported type"):
            strict.where(a > 0, a, host)
        with pytest.raises(TypeError, match="Unsupported type"):
            strict.maximum(a, host)
    with pytest.raises(TypeError, match="Unsupported type <class 'list'>"):
        strict.where(a > 0, a, [0.0])
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for fill"):
        a[:] = np.zeros(3)
    a[...] = np.float32(2.0)                           # scalars are fine
    b = a * 2 + np.float64(1.0)
    assert b.get().tolist() == [5.0, 5.0, 5.0]


def test_numpy_functions_run_on_strict_arrays_and_stay_there():
    a = strict.arange(6.0).reshape(2, 3)
    for result in (np.exp(a), np.concatenate([a, a]), np.sum(a, axis=0), a.sum(), a[0, 1],
                   np.where(a > 2, a, 0.0), a @ a.T, np.moveaxis(a, 0, 1)):
        assert xp_of(result) is strict, type(result)
    assert a.sum().ndim == 0 and a[0, 1].shape == ()     # 0-d arrays, never scalars
    assert xp_of(np.add.reduce(a, axis=1)) is strict
    with pytest.raises(AttributeError, match="CuPy's namespace has none either"):
        strict.vecdot                                    # NumPy has it, CuPy does not
    assert strict.syncs.count == 0


def test_host_reads_are_counted_and_can_be_refused():
    a = strict.arange(4.0)
    float(a.sum()), int(a[1]), bool(a[2] > 1), a.sum().item(), a.tolist(), a.get()
    assert strict.syncs.count == 6
    assert set(strict.syncs.by_kind) == {"float", "int", "bool", "item", "tolist", "get"}
    a[a > 1]                                             # the output size is read back
    a.nonzero()
    assert strict.syncs.count == 8
    assert any("test_strict_module.py" in site for site in strict.syncs.sites)
    with strict.syncs.refused():
        a * 2 + 1
        with pytest.raises(strict.HostSyncError, match=r"host sync \(float\) at .*test_strict"):
            float(a[0])
        repr(a), str(a)                                  # printing is counted, never refused
        with strict.syncs.allowed():
            float(a[0])
    strict.syncs.reset()
    assert strict.syncs.count == 0


def test_float16_products_accumulate_in_float32():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((8, 512)), rng.standard_normal((512, 4))
    exact = (x.astype(np.float16).astype(np.float32) @ w.astype(np.float16).astype(np.float32))
    got = strict.asarray(x, np.float16) @ strict.asarray(w, np.float16)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got.get(), exact.astype(np.float16))


def test_own_random_stream_and_device_state():
    gen = strict.random.default_rng(7)
    draws = gen.random((4, 5), dtype=np.float32)
    assert xp_of(draws) is strict and draws.dtype == np.float32
    assert not np.array_equal(draws.get(), np.random.default_rng(7).random((4, 5),
                                                                          dtype=np.float32))
    again = strict.random.default_rng(7).random((4, 5), dtype=np.float32)
    np.testing.assert_array_equal(draws.get(), again.get())     # seeded: reproducible
    state = gen.bit_generator._state
    assert xp_of(state) is strict and state.dtype == np.int8
    saved = state.copy()
    first = gen.random(3).get()
    state[...] = saved                                   # written back: the same stream
    np.testing.assert_array_equal(gen.random(3).get(), first)


def test_pickle_copies_through_the_host_and_staging_is_counted_apart():
    a = strict.arange(3.0)
    b = pickle.loads(pickle.dumps(a))
    assert xp_of(b) is strict and b.get().tolist() == [0.0, 1.0, 2.0]
    strict.syncs.reset()
    host, back = strict.stage_for_mpi(a, copy_in=True, copy_out=True)
    assert isinstance(host, np.ndarray) and host.tolist() == [0.0, 1.0, 2.0]
    host[...] = 5.0
    back()
    assert strict.syncs.staged == 2 and strict.syncs.count == 0
    assert "__cuda_array_interface__" in dir(a) and a.__cuda_array_interface__["shape"] == (3,)


def test_backend_and_module_names():
    be = Backend.resolve("strict")
    assert be.xp is strict and be.describe() == "strict/cpu" and be.device is None
    on = be.asarray(np.arange(3))
    assert xp_of(on) is strict
    assert strict.get_array_module(on) is strict and strict.get_array_module(1.0) is np
    assert Backend.resolve("numpy").asarray(on).tolist() == [0, 1, 2]   # an explicit copy
    assert {"zeros", "einsum", "matmul", "fmax", "moveaxis"} <= set(dir(strict))


def test_copies_of_host_data_onto_the_device_are_counted_as_pageable():
    """Host data copied to the device (what a captured CUDA graph cannot hold) counts in
    ``syncs.pageable``, by line; device-to-device work, scalars as kernel arguments and
    fills do not. ``peek`` reads a value as a fused kernel does: no sync, and only there."""
    a = strict.arange(4.0)
    strict.syncs.reset()
    b = a * 2.0 + strict.full((), 3.0)                    # kernels, scalar arguments
    strict.asarray(b)                                      # already on the device
    b[1:3] = a[0:2]
    assert strict.syncs.pageable == 0 and strict.syncs.count == 0
    strict.asarray(np.arange(4.0))                         # host data: one copy each
    strict.asarray(1.5)
    strict.array([1, 2])
    b.set(np.zeros(4))
    b[np.array([0, 1])] = 1.0                              # the index array
    b[[0, 1]] = np.float64(1.0)                            # a list index; a scalar value
    assert strict.syncs.pageable == 6 and strict.syncs.count == 0
    assert sum(strict.syncs.pageable_sites.values()) == 6
    with pytest.raises(RuntimeError, match="outside a fused block"):
        strict.syncs.peek(b)
    with strict.syncs.fused("kernel"):
        assert strict.syncs.peek(b[0]).item() == 1.0
    assert strict.syncs.count == 0

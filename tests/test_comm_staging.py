"""Host staging of device arrays, on CPU, with a stand-in for CuPy.

The stand-in array has no buffer protocol, so if the communicator ever handed
it to mpi4py instead of a pinned host copy, mpi4py would raise. The stand-in
stream counts synchronisations, so the "sync once before MPI" rule
([Note: device buffers]) is visible. The real CuPy paths run in
scripts/gpu_check.sh.
"""
import sys
import types

import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm.gpu import DevicePath
from mpishard.comm.testing import COMM_KINDS, make_test_comm, required_size

pytestmark = [pytest.mark.timeout(60)]


class FakeStream:
    def __init__(self):
        self.syncs = 0

    def synchronize(self):
        self.syncs += 1


class FakeDeviceArray:
    """Device memory stand-in (``type(a).__module__`` starts with "cupy")."""

    __module__ = "cupy"

    def __init__(self, host):
        self._a = host

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    ndim = property(lambda self: self._a.ndim)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    data = property(lambda self: types.SimpleNamespace(ptr=self._a.ctypes.data))

    def get(self, stream=None, out=None):
        out[...] = self._a
        return out

    def set(self, host, stream=None):
        self._a[...] = host

    def reshape(self, *shape):
        return FakeDeviceArray(self._a.reshape(*shape))

    def __getitem__(self, key):
        return FakeDeviceArray(self._a[key])

    def __setitem__(self, key, value):
        self._a[key] = value._a if isinstance(value, FakeDeviceArray) else value

    def __itruediv__(self, x):
        self._a /= x
        return self

    def host(self):
        return self._a.copy()


@pytest.fixture
def fake_cupy(monkeypatch):
    stream = FakeStream()
    pinned = []

    def empty_pinned(shape, dtype):
        pinned.append(shape)
        return np.empty(shape, dtype)

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(get_current_stream=lambda: stream)
    cupy.empty = lambda shape, dtype: FakeDeviceArray(np.empty(shape, dtype))
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = empty_pinned
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    return types.SimpleNamespace(stream=stream, pinned=pinned)


def device(a):
    return FakeDeviceArray(np.array(a))


@pytest.fixture(params=COMM_KINDS)
def comm(request):
    kind = request.param
    if MPI.COMM_WORLD.Get_size() < required_size(kind):
        pytest.skip(f"{kind} needs {required_size(kind)} ranks")
    c = make_test_comm(kind, cuda_aware=False)
    if c is None:
        assert MPI.COMM_WORLD.Get_rank() >= required_size(kind)
        pytest.skip("sits out")
    yield c
    c.free()


@pytest.mark.mpi
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_staged_collectives(comm, fake_cupy, blocking):
    n, r = comm.size, comm.rank

    def done(x):
        return x if blocking else x.wait()
    base = np.arange(6, dtype=np.float32)
    buf = device(base + r)
    assert done((comm.all_reduce if blocking else comm.iall_reduce)(buf, op="avg")) is buf
    np.testing.assert_allclose(buf.host(), base + (n - 1) / 2)
    recv = done((comm.reduce_scatter if blocking else comm.ireduce_scatter)(
        device(np.arange(3 * n, dtype=np.float64) + r)))
    assert isinstance(recv, FakeDeviceArray)
    want = n * np.arange(3 * n) + n * (n - 1) / 2
    np.testing.assert_array_equal(recv.host(), want[3 * r:3 * r + 3])
    full = FakeDeviceArray(np.zeros(2 * n, np.int64))
    full[2 * r:2 * r + 2] = r + 1
    done((comm.all_gather if blocking else comm.iall_gather)(full[2 * r:2 * r + 2], full))
    np.testing.assert_array_equal(full.host(), np.repeat(np.arange(1, n + 1), 2))
    buf = device(np.full(4, r, np.float16))
    done((comm.broadcast if blocking else comm.ibroadcast)(buf, root=n - 1))
    np.testing.assert_array_equal(buf.host(), np.full(4, n - 1, np.float16))
    if n > 1:
        got = device(np.zeros(3, np.float32))
        handles = [comm.irecv(got, (r - 1) % n), comm.isend(device(np.full(3, r, np.float32)),
                                                             (r + 1) % n)]
        for h in handles:
            h.wait()
        np.testing.assert_array_equal(got.host(), np.full(3, (r - 1) % n, np.float32))
        assert fake_cupy.stream.syncs > 0 and fake_cupy.pinned  # staged, after a sync
    else:
        assert fake_cupy.pinned == []  # size 1 never stages: no MPI call


def test_device_path_branches(fake_cupy):
    a = device(np.arange(4.0))
    direct = DevicePath(True, "test", stage_nonblocking_reductions=True)
    assert direct.for_mpi(a, copy_in=True, copy_out=True) == (a, None)
    assert fake_cupy.stream.syncs == 1  # synchronised even when passed straight through
    host, back = direct.for_mpi(a, copy_in=True, copy_out=True, nonblocking_reduction=True)
    assert isinstance(host, np.ndarray) and (host == np.arange(4.0)).all()
    host += 1
    back()
    assert (a.host() == np.arange(4.0) + 1).all()
    staged = DevicePath(False, "test")
    host, back = staged.for_mpi(a, copy_in=False, copy_out=False)
    assert isinstance(host, np.ndarray) and back is None and fake_cupy.pinned == [(4,), (4,)]

"""Host staging of device arrays, on CPU, with a stand-in for CuPy.

The stand-in array has no buffer protocol, so if the communicator ever handed
it to mpi4py instead of a pinned host copy, mpi4py would raise. The stand-in
stream counts synchronisations, so the "sync once before MPI" rule
([Note: device buffers]) is visible. The real CuPy paths run in
scripts/gpu_check.sh.
"""
import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import gpu
from mpishard.comm.gpu import DevicePath
from mpishard.testing.fake_cupy import (COMM_KINDS, FakeDeviceArray, install_fake_cupy,
                                   make_test_comm, required_size)

pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture
def fake_cupy(monkeypatch):
    return install_fake_cupy(monkeypatch)


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
    direct = DevicePath(True, "test", stage_nonblocking=True)
    assert direct.for_mpi(a, copy_in=True, copy_out=True) == (a, None)
    assert fake_cupy.stream.syncs == 1  # synchronised even when passed straight through
    host, back = direct.for_mpi(a, copy_in=True, copy_out=True, nonblocking=True)
    assert isinstance(host, np.ndarray) and (host == np.arange(4.0)).all()
    host += 1
    back()
    assert (a.host() == np.arange(4.0) + 1).all()
    staged = DevicePath(False, "test")
    host, back = staged.for_mpi(a, copy_in=False, copy_out=False)
    assert isinstance(host, np.ndarray) and back is None and fake_cupy.pinned == [(4,), (4,)]


@pytest.fixture(params=[k for k in COMM_KINDS if k != "self"])
def aware_open_mpi(request, monkeypatch):
    """A CUDA-aware communicator of size > 1 on what claims to be Open MPI."""
    kind = request.param
    if MPI.COMM_WORLD.Get_size() < max(2, required_size(kind)):
        pytest.skip(f"{kind} needs more than one rank")
    monkeypatch.setattr(gpu, "mpi_vendor", lambda: "Open MPI")
    c = make_test_comm(kind, cuda_aware=True)
    if c is None:
        pytest.skip("sits out")
    yield c
    c.free()


@pytest.mark.mpi
def test_open_mpi_stages_every_nonblocking_collective(aware_open_mpi, fake_cupy):
    """libnbc treats buffers as host memory: a device buffer handed to it unstaged
    would reach mpi4py here, which has no buffer to read in the fake, and raise."""
    comm = aware_open_mpi
    n, r = comm.size, comm.rank
    got = comm.iall_gather(device(np.full(2, r, np.float32))).wait()
    np.testing.assert_array_equal(got.host(), np.repeat(np.arange(n), 2).astype(np.float32))
    buf = device(np.full(3, r, np.float64))
    comm.ibroadcast(buf, root=n - 1).wait()
    np.testing.assert_array_equal(buf.host(), np.full(3, n - 1.0))
    exchanged = comm.iall_to_all(device(100.0 * r + np.arange(n))).wait()
    np.testing.assert_array_equal(exchanged.host(), 100.0 * np.arange(n) + r)
    buf = device(np.full(2, r, np.float32))
    comm.iall_reduce(buf).wait()
    np.testing.assert_array_equal(buf.host(), np.full(2, n * (n - 1) / 2, np.float32))
    assert len(fake_cupy.pinned) == 6  # each of the six buffers went through a pinned copy


def test_device_path_stages_nonblocking_only_where_asked(fake_cupy):
    a = device(np.arange(3.0))
    open_mpi = DevicePath(True, "test", stage_nonblocking=True)
    for_nbc, back = open_mpi.for_mpi(a, copy_in=True, copy_out=False, nonblocking=True)
    assert isinstance(for_nbc, np.ndarray) and back is None
    assert open_mpi.for_mpi(a, copy_in=True, copy_out=False) == (a, None)  # blocking, p2p
    other = DevicePath(True, "test")
    assert other.for_mpi(a, copy_in=True, copy_out=True, nonblocking=True) == (a, None)

"""float16 without an MPI float16 datatype ([Note: 16-bit floats on MPI]).

Many MPI builds have no datatype for mpi4py's ``'e'`` typecode (Open MPI has
no ``MPIX_C_FLOAT16``). These tests make the datatype lookup fail for ``'e'``
and check that every collective still moves float16 (gathers, broadcasts,
all-to-all and point-to-point as uint16; reductions in float32), that the
NCCL path never asks MPI, and that a dtype MPI really lacks is still refused
on the MPI path with the usual message.
"""
import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import checks
from mpishard.comm.backends import nccl
from mpishard.testing.fake_cupy import (COMM_KINDS, FakeDeviceArray, install_fake_cupy,
                                   make_test_comm, required_size)

pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture
def no_mpi_float16(monkeypatch):
    asked = []

    def has_datatype(char):
        asked.append(char)
        return char != "e"
    monkeypatch.setattr(checks, "_mpi_has_datatype", has_datatype)
    return asked


@pytest.fixture(params=COMM_KINDS)
def comm(request):
    kind = request.param
    if MPI.COMM_WORLD.Get_size() < required_size(kind):
        pytest.skip(f"{kind} needs {required_size(kind)} ranks")
    c = make_test_comm(kind, cuda_aware=False)
    if c is None:
        pytest.skip("sits out")
    yield c
    c.free()


def finish(result, blocking):
    return result if blocking else result.wait()


@pytest.mark.mpi
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_every_collective_moves_float16_without_an_mpi_float16(comm, no_mpi_float16,
                                                               blocking):
    n, r = comm.size, comm.rank
    i = comm.iall_reduce if not blocking else comm.all_reduce
    for op, want in (("sum", n * np.arange(5) + n * (n - 1) / 2),
                     ("avg", np.arange(5) + (n - 1) / 2),
                     ("max", np.arange(5) + n - 1)):
        buf = (np.arange(5) + r).astype(np.float16)
        assert finish(i(buf, op=op), blocking) is buf and buf.dtype == np.float16
        np.testing.assert_array_equal(buf, want.astype(np.float16))
    send = (np.arange(3 * n) + r).astype(np.float16)
    rs = comm.reduce_scatter if blocking else comm.ireduce_scatter
    recv = finish(rs(send, op="avg"), blocking)
    want = (np.arange(3 * n) + (n - 1) / 2)[3 * r:3 * r + 3]
    assert recv.dtype == np.float16
    np.testing.assert_array_equal(recv, want.astype(np.float16))
    ag = comm.all_gather if blocking else comm.iall_gather
    gathered = finish(ag(np.full(2, r + 0.5, np.float16)), blocking)
    np.testing.assert_array_equal(gathered, np.repeat(np.arange(n) + 0.5, 2).astype(np.float16))
    whole = np.zeros(2 * n, np.float16)
    whole[2 * r:2 * r + 2] = r + 0.25
    finish(ag(whole[2 * r:2 * r + 2], whole), blocking)  # in place
    np.testing.assert_array_equal(whole, np.repeat(np.arange(n) + 0.25, 2).astype(np.float16))
    buf = np.full(3, r - 0.5, np.float16)
    finish((comm.broadcast if blocking else comm.ibroadcast)(buf, root=n - 1), blocking)
    np.testing.assert_array_equal(buf, np.full(3, n - 1.5, np.float16))
    send = (100 * r + np.arange(n)).astype(np.float16)
    got = finish((comm.all_to_all if blocking else comm.iall_to_all)(send), blocking)
    np.testing.assert_array_equal(got, (100 * np.arange(n) + r).astype(np.float16))
    if n > 1:
        into = np.zeros(4, np.float16)
        handles = [comm.irecv(into, (r - 1) % n), comm.isend(np.full(4, r + 0.5, np.float16),
                                                             (r + 1) % n)]
        for h in handles:
            h.wait()
        np.testing.assert_array_equal(into, np.full(4, (r - 1) % n + 0.5, np.float16))


@pytest.mark.mpi
def test_float16_sums_round_once_from_float32(comm):
    """2048 + 1 + 1 + 1 is 2051, which rounds to 2052; added up in float16 it
    would stay at 2048 (each 2048 + 1 rounds back to 2048)."""
    buf = np.array([2048.0 if comm.rank == 0 else 1.0], np.float16)
    comm.all_reduce(buf)
    assert buf[0] == np.float16(np.float32(2048 + comm.size - 1))


@pytest.mark.mpi
def test_staged_device_float16_reduces_in_float32(comm, no_mpi_float16, monkeypatch):
    fake = install_fake_cupy(monkeypatch)
    n, r = comm.size, comm.rank
    buf = FakeDeviceArray((np.arange(4) + r).astype(np.float16))
    comm.all_reduce(buf, op="avg")
    assert buf.dtype == np.float16
    np.testing.assert_array_equal(buf.host(), (np.arange(4) + (n - 1) / 2).astype(np.float16))
    recv = comm.ireduce_scatter(FakeDeviceArray(np.ones(2 * n, np.float16))).wait()
    np.testing.assert_array_equal(recv.host(), np.full(2, n, np.float16))
    if n > 1:  # staged through float32 pinned buffers
        assert fake.pinned and fake.stream.syncs


class FakeGroup:
    """An NCCL group stand-in that records what it was given."""

    built = []

    def __init__(self, mpi_comm):
        self.calls = []
        FakeGroup.built.append(self)

    def supports(self, a):
        return True

    def all_reduce(self, buf, op, host_sync=False):
        self.calls.append(("all_reduce", buf.dtype.name, op))
        return None

    def all_gather(self, send, recv, host_sync=False):
        self.calls.append(("all_gather", send.dtype.name))
        return None

    def close(self):
        pass


def test_nccl_path_never_asks_mpi_for_a_datatype(no_mpi_float16, monkeypatch):
    install_fake_cupy(monkeypatch)
    monkeypatch.setattr(nccl, "nccl_available", lambda: (True, "NCCL (fake)"))
    monkeypatch.setattr(nccl, "nccl_dtype", lambda dtype: "ncclFloat16")
    monkeypatch.setattr(nccl, "NcclGroup", FakeGroup)
    FakeGroup.built = []
    for through in (False, True):  # the size-1 shortcut, and the NCCL path at size 1
        comm = make_test_comm("self", comm_backend="nccl", backend_at_size_one=through)
        buf = FakeDeviceArray(np.ones(4, np.float16))
        assert comm.all_reduce(buf) is buf
        comm.all_gather(FakeDeviceArray(np.ones(2, np.float16)))
        comm.free()
    assert [group.calls for group in FakeGroup.built] == [
        [("all_reduce", "float16", "sum"), ("all_gather", "float16")]]
    assert no_mpi_float16 == []  # MPI's datatypes were never asked about


@pytest.mark.mpi
def test_a_dtype_mpi_lacks_is_refused_on_the_mpi_path(comm, monkeypatch):
    monkeypatch.setattr(checks, "_mpi_has_datatype", lambda char: char != "f")
    for call in (lambda: comm.all_reduce(np.zeros(4, np.float32)),
                 lambda: comm.iall_gather(np.zeros(4, np.float32)),
                 lambda: comm.broadcast(np.zeros(4, np.float32))):
        with pytest.raises(ValueError, match=r"has dtype float32, for which this MPI library "
                                             r"\(.*\) has no datatype"):
            call()
    if comm.size > 1:
        with pytest.raises(ValueError, match="has no datatype"):
            comm.isend(np.zeros(2, np.float32), (comm.rank + 1) % comm.size)
    assert comm.all_reduce(np.ones(2, np.float64))[0] == comm.size  # still in step
    assert [e.elapsed is not None for e in comm.history] == [True] * len(comm.history)


def test_wire_view_and_widening_on_numpy():
    a = np.array([1.5, -2.0], np.float16)
    assert checks.wire_view(a).dtype == np.uint16 and checks.wire_view(a).base is a
    f32 = np.zeros(2, np.float32)
    assert checks.wire_view(f32) is f32
    out = np.zeros(2, np.float16)
    wide, divide, narrow = checks.widened(((a, True, False), (out, False, True)), out)
    assert [w.dtype for w, _, _ in wide] == [np.float32, np.float32]
    assert divide is wide[1][0] and wide[0][0].tolist() == [1.5, -2.0]
    wide[1][0][...] = [2049.0, 0.1]
    narrow()
    assert out.tolist() == [np.float16(2049.0), np.float16(0.1)]

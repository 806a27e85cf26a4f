"""float16 and bfloat16 without an MPI datatype for them ([Note: 16-bit floats on MPI]).

Many MPI builds have no datatype for mpi4py's ``'e'`` typecode (Open MPI has
no ``MPIX_C_FLOAT16``), and none has bfloat16. These tests make the datatype
lookup fail for ``'e'`` and check that every collective still moves both 16-bit
floats (gathers, broadcasts, all-to-all and point-to-point as uint16; reductions
in float32, rounded once), each test run once per dtype, that the NCCL path never
asks MPI and has a datatype for both, and that a dtype MPI really lacks is still
refused on the MPI path with the usual message.
"""
import sys
import types

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import checks
from mpishard.comm.backends import nccl
from mpishard.testing.fake_cupy import (COMM_KINDS, FakeDeviceArray, install_fake_cupy,
                                   make_test_comm, required_size)

pytestmark = [pytest.mark.timeout(60)]

BF16 = np.dtype(ml_dtypes.bfloat16)
#: the 16-bit floats, and the largest integer each holds with every integer below it
#: (2^11 with float16's 11 significant bits, 2^8 with bfloat16's 8)
SIXTEEN = {"float16": (np.dtype(np.float16), 2048), "bfloat16": (BF16, 256)}


@pytest.fixture(params=sorted(SIXTEEN))
def half(request):
    """The 16-bit dtype a test runs with."""
    return SIXTEEN[request.param][0]


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
def test_every_collective_moves_16bit_floats_without_an_mpi_datatype(comm, no_mpi_float16,
                                                                     blocking, half):
    n, r = comm.size, comm.rank
    i = comm.iall_reduce if not blocking else comm.all_reduce
    for op, want in (("sum", n * np.arange(5) + n * (n - 1) / 2),
                     ("avg", np.arange(5) + (n - 1) / 2),
                     ("max", np.arange(5) + n - 1)):
        buf = (np.arange(5) + r).astype(half)
        assert finish(i(buf, op=op), blocking) is buf and buf.dtype == half
        np.testing.assert_array_equal(buf, want.astype(half))
    send = (np.arange(3 * n) + r).astype(half)
    rs = comm.reduce_scatter if blocking else comm.ireduce_scatter
    recv = finish(rs(send, op="avg"), blocking)
    want = (np.arange(3 * n) + (n - 1) / 2)[3 * r:3 * r + 3]
    assert recv.dtype == half
    np.testing.assert_array_equal(recv, want.astype(half))
    ag = comm.all_gather if blocking else comm.iall_gather
    gathered = finish(ag(np.full(2, r + 0.5, half)), blocking)
    np.testing.assert_array_equal(gathered, np.repeat(np.arange(n) + 0.5, 2).astype(half))
    whole = np.zeros(2 * n, half)
    whole[2 * r:2 * r + 2] = r + 0.25
    finish(ag(whole[2 * r:2 * r + 2], whole), blocking)  # in place
    np.testing.assert_array_equal(whole, np.repeat(np.arange(n) + 0.25, 2).astype(half))
    buf = np.full(3, r - 0.5, half)
    finish((comm.broadcast if blocking else comm.ibroadcast)(buf, root=n - 1), blocking)
    np.testing.assert_array_equal(buf, np.full(3, n - 1.5, half))
    send = (10 * r + np.arange(n)).astype(half)
    got = finish((comm.all_to_all if blocking else comm.iall_to_all)(send), blocking)
    np.testing.assert_array_equal(got, (10 * np.arange(n) + r).astype(half))
    if n > 1:
        into = np.zeros(4, half)
        handles = [comm.irecv(into, (r - 1) % n), comm.isend(np.full(4, r + 0.5, half),
                                                             (r + 1) % n)]
        for h in handles:
            h.wait()
        np.testing.assert_array_equal(into, np.full(4, (r - 1) % n + 0.5, half))


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(SIXTEEN))
def test_16bit_sums_round_once_from_float32(comm, name):
    """float16: 2048 + 1 + 1 + 1 is 2051, which rounds to 2052; added up in float16 it
    would stay at 2048 (each 2048 + 1 rounds back to 2048). bfloat16 the same from
    256: 259 rounds to 260, and 256 + 1 rounds back to 256."""
    dtype, top = SIXTEEN[name]
    buf = np.array([float(top) if comm.rank == 0 else 1.0], dtype)
    comm.all_reduce(buf)
    assert buf[0] == np.float32(top + comm.size - 1).astype(dtype)
    if comm.size == 4:
        assert float(buf[0]) == top + 4


@pytest.mark.mpi
def test_staged_device_16bit_floats_reduce_in_float32(comm, no_mpi_float16, monkeypatch,
                                                      half):
    fake = install_fake_cupy(monkeypatch)
    n, r = comm.size, comm.rank
    buf = FakeDeviceArray((np.arange(4) + r).astype(half))
    comm.all_reduce(buf, op="avg")
    assert buf.dtype == half
    np.testing.assert_array_equal(buf.host(), (np.arange(4) + (n - 1) / 2).astype(half))
    recv = comm.ireduce_scatter(FakeDeviceArray(np.ones(2 * n, half))).wait()
    np.testing.assert_array_equal(recv.host(), np.full(2, n, half))
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


def test_nccl_path_never_asks_mpi_for_a_datatype(no_mpi_float16, monkeypatch, half):
    install_fake_cupy(monkeypatch)
    monkeypatch.setattr(nccl, "nccl_available", lambda: (True, "NCCL (fake)"))
    monkeypatch.setattr(nccl, "nccl_dtype", lambda dtype: "ncclFloat16")
    monkeypatch.setattr(nccl, "NcclGroup", FakeGroup)
    FakeGroup.built = []
    for through in (False, True):  # the size-1 shortcut, and the NCCL path at size 1
        comm = make_test_comm("self", comm_backend="nccl", backend_at_size_one=through)
        buf = FakeDeviceArray(np.ones(4, half))
        assert comm.all_reduce(buf) is buf
        comm.all_gather(FakeDeviceArray(np.ones(2, half)))
        comm.free()
    assert [group.calls for group in FakeGroup.built] == [
        [("all_reduce", half.name, "sum"), ("all_gather", half.name)]]
    assert no_mpi_float16 == []  # MPI's datatypes were never asked about


def test_nccl_has_a_datatype_for_both_16bit_floats(monkeypatch):
    """``ncclFloat16`` (6) and ``ncclBfloat16`` (9, nccl.h), whether or not CuPy's
    binding names the latter; NCCL reduces them itself."""
    binding = types.ModuleType("cupy.cuda.nccl")
    for i, name in enumerate(("INT8", "UINT8", "INT32", "UINT32", "INT64", "UINT64",
                              "FLOAT16", "FLOAT32", "FLOAT64")):
        setattr(binding, f"NCCL_{name}", i)
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl = binding
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", binding)
    assert nccl.nccl_dtype(np.dtype(np.float16)) == 6
    assert nccl.nccl_dtype(BF16) == 9
    binding.NCCL_BFLOAT16 = 9
    assert nccl.nccl_dtype(BF16) == 9 and nccl.nccl_dtype(np.dtype(np.complex64)) is None


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


def test_wire_view_and_widening_on_numpy(half):
    a = np.array([1.5, -2.0], half)
    assert checks.wire_view(a).dtype == np.uint16 and checks.wire_view(a).base is a
    assert checks.reduces_in_float32(a)
    f32 = np.zeros(2, np.float32)
    assert checks.wire_view(f32) is f32 and not checks.reduces_in_float32(f32)
    out = np.zeros(2, half)
    wide, divide, narrow = checks.widened(((a, True, False), (out, False, True)), out)
    assert [w.dtype for w, _, _ in wide] == [np.float32, np.float32]
    assert divide is wide[1][0] and wide[0][0].tolist() == [1.5, -2.0]
    wide[1][0][...] = [2049.0, 0.1]
    narrow()
    assert out.tolist() == [half.type(2049.0), half.type(0.1)]

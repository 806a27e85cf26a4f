"""The collective-backend interface ([Note: collective backends]).

A backend is one class and one line in the registry: a recording backend that
hands every call to MPI runs every collective of a communicator, at every
size (through ``BackendAtSizeOne``), so the communicator talks to nothing but
the interface; a plain communicator of one rank asks its backend only for the
dtype check (``OneRank`` copies locally); a backend that leaves out a
collective cannot be built.
"""
import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import Communicator, backends
from mpishard.comm.backends.base import CollectiveBackend
from mpishard.testing.fake_cupy import COMM_KINDS, make_test_comm, required_size

pytestmark = [pytest.mark.timeout(60)]


class RecordingBackend(CollectiveBackend):
    """Every call handed to MPI, its name recorded."""

    name = "recording"
    label = "Recording"
    built = []

    def __init__(self, setup, fallback):
        self.fallback, self.how, self.calls = fallback, setup.how, []
        RecordingBackend.built.append(self)

    @property
    def takes_device_arrays(self):
        return self.fallback.takes_device_arrays

    def check_dtype(self, a, where):
        self.calls.append(f"check {where}")
        self.fallback.check_dtype(a, where)

    def all_reduce(self, buf, op, *, blocking):
        self.calls.append(f"all_reduce {op} {'blocking' if blocking else 'nonblocking'}")
        return self.fallback.all_reduce(buf, op, blocking=blocking)

    def reduce_scatter(self, send, recv, op, *, blocking):
        self.calls.append(f"reduce_scatter {op}")
        return self.fallback.reduce_scatter(send, recv, op, blocking=blocking)

    def all_gather(self, send, recv, *, in_place, blocking):
        self.calls.append(f"all_gather in_place={in_place}")
        return self.fallback.all_gather(send, recv, in_place=in_place, blocking=blocking)

    def broadcast(self, buf, root, *, blocking):
        self.calls.append(f"broadcast {root}")
        return self.fallback.broadcast(buf, root, blocking=blocking)

    def all_to_all(self, send, recv, *, blocking):
        self.calls.append("all_to_all")
        return self.fallback.all_to_all(send, recv, blocking=blocking)

    def all_to_all_v(self, send, send_rows, recv, recv_rows, *, blocking):
        self.calls.append(f"all_to_all_v {send_rows} {recv_rows}")
        return self.fallback.all_to_all_v(send, send_rows, recv, recv_rows, blocking=blocking)

    def isend(self, buf, dest, tag):
        self.calls.append(f"isend {dest}")
        return self.fallback.isend(buf, dest, tag)

    def irecv(self, buf, source, tag):
        self.calls.append(f"irecv {source}")
        return self.fallback.irecv(buf, source, tag)


@pytest.fixture
def recording(monkeypatch):
    """The registry with one more line: ``"recording": RecordingBackend``."""
    monkeypatch.setitem(backends.BACKENDS, "recording", RecordingBackend)
    monkeypatch.setattr(backends, "COMM_BACKENDS", (*backends.BACKENDS, backends.AUTO))
    RecordingBackend.built = []


@pytest.fixture(params=COMM_KINDS)
def kind(request):
    if MPI.COMM_WORLD.Get_size() < required_size(request.param):
        pytest.skip(f"{request.param} needs {required_size(request.param)} ranks")
    return request.param


@pytest.mark.mpi
def test_a_registered_backend_runs_every_collective(recording, kind):
    comm = make_test_comm(kind, comm_backend="recording", backend_at_size_one=True)
    if comm is None:
        pytest.skip("sits out")
    n, r = comm.size, comm.rank
    assert (comm.comm_backend, comm.comm_backend_how) == ("recording", "comm_backend='recording'")
    buf = np.arange(3.0) + r
    assert comm.all_reduce(buf, op="avg") is buf
    np.testing.assert_array_equal(buf, np.arange(3.0) + (n - 1) / 2)
    np.testing.assert_array_equal(comm.iall_reduce(np.ones(2)).wait(), np.full(2, n))
    np.testing.assert_array_equal(comm.reduce_scatter(np.ones(2 * n)), np.full(2, n))
    whole = np.zeros(n)
    whole[r] = r
    comm.all_gather(whole[r:r + 1], whole)
    np.testing.assert_array_equal(whole, np.arange(n))
    buf = np.full(2, r)
    comm.broadcast(buf, root=n - 1)
    np.testing.assert_array_equal(buf, np.full(2, n - 1))
    np.testing.assert_array_equal(comm.all_to_all(100 * r + np.arange(n)),
                                  100 * np.arange(n) + r)
    got = comm.all_to_all_v(np.full((n, 2), r), [1] * n, [1] * n)
    np.testing.assert_array_equal(got, np.repeat(np.arange(n), 2).reshape(n, 2))
    want = ["check all_reduce", "all_reduce avg blocking",
            "check iall_reduce", "all_reduce sum nonblocking",
            "check reduce_scatter", "reduce_scatter sum",
            "check all_gather", "all_gather in_place=True",
            "check broadcast", f"broadcast {n - 1}",
            "check all_to_all", "all_to_all",
            "check all_to_all_v", f"all_to_all_v {[1] * n} {[1] * n}"]
    if n > 1:
        into = np.zeros(2)
        handles = [comm.irecv(into, (r - 1) % n),
                   comm.isend(np.full(2, r, np.float64), (r + 1) % n)]
        for handle in handles:
            handle.wait()
        np.testing.assert_array_equal(into, np.full(2, (r - 1) % n))
        want += ["check recv", f"irecv {(r - 1) % n}", "check send", f"isend {(r + 1) % n}"]
    assert [b.calls for b in RecordingBackend.built] == [want]
    assert comm.stats["all_reduce"].calls == 2
    comm.free()


def test_one_rank_asks_its_backend_only_for_the_dtype_check(recording):
    comm = Communicator(MPI.COMM_SELF, comm_backend="recording")
    recv = comm.reduce_scatter(np.arange(4.0))
    np.testing.assert_array_equal(recv, np.arange(4.0))  # copied locally, by OneRank
    comm.ibroadcast(np.zeros(2)).wait()
    assert [b.calls for b in RecordingBackend.built] == [["check reduce_scatter",
                                                          "check ibroadcast"]]


def test_a_backend_without_every_collective_cannot_be_built(monkeypatch):
    class Half(CollectiveBackend):
        name = "half"

        def __init__(self, setup, fallback):
            pass

    monkeypatch.setitem(backends.BACKENDS, "half", Half)
    monkeypatch.setattr(backends, "COMM_BACKENDS", (*backends.BACKENDS, backends.AUTO))
    with pytest.raises(TypeError, match="abstract methods .*all_gather"):
        Communicator(MPI.COMM_SELF, comm_backend="half")

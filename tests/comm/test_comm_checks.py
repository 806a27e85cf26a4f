"""Bad input raises a clear error before any MPI call; size 1 makes no MPI call.

The "no MPI call" part is checked by replacing a communicator's mpi4py object
with one that fails on any use: if a check came after an MPI call, the test
would see that failure (or hang) instead of the ValueError.
"""
import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import CollectiveMismatch, Communicator
from mpishard.testing.fake_cupy import make_test_comm

pytestmark = pytest.mark.timeout(60)


class NoMPI:
    """Stands in for an mpi4py communicator; any use is a test failure."""

    def __getattr__(self, name):
        raise AssertionError(f"MPI call {name} made where none was allowed")


@pytest.fixture(params=["self", "world"])
def guarded(request):
    """A Communicator (size 1, or the whole world) that must not touch MPI."""
    comm = make_test_comm(request.param)
    real, comm.mpi = comm.mpi, NoMPI()
    yield comm
    comm.mpi = real
    comm.free()


def read_only(n):
    a = np.zeros(n)
    a.flags.writeable = False
    return a


BAD_CALLS = [
    ("all_reduce(non-contiguous)", lambda c: c.all_reduce(np.zeros((4, 4))[:, 0]),
     ValueError, "not C-contiguous.*ascontiguousarray"),
    ("all_reduce(op='mean')", lambda c: c.all_reduce(np.zeros(4), op="mean"),
     ValueError, r"unknown op 'mean'; use one of \['avg', 'max', 'sum'\]"),
    ("all_reduce(list)", lambda c: c.all_reduce([1.0, 2.0]),
     TypeError, "must be a NumPy or CuPy array, got list"),
    ("all_reduce(read-only)", lambda c: c.all_reduce(read_only(4)),
     ValueError, "read-only but receives data"),
    ("iall_reduce(avg of int)", lambda c: c.iall_reduce(np.zeros(4, np.int32), op="avg"),
     ValueError, "would truncate"),
    ("all_reduce(max of complex)", lambda c: c.all_reduce(np.zeros(4, np.complex64), op="max"),
     ValueError, "not defined for dtype complex64"),
    ("all_reduce(bool)", lambda c: c.all_reduce(np.zeros(4, bool)),
     ValueError, "not defined for dtype bool"),
    ("reduce_scatter(dtype mismatch)",
     lambda c: c.reduce_scatter(np.zeros(4 * c.size, np.float32), np.zeros(4, np.float64)),
     ValueError, "recv dtype float64 does not match send dtype float32"),
    ("reduce_scatter(wrong recv size)",
     lambda c: c.reduce_scatter(np.zeros(4 * c.size), np.zeros(5)),
     ValueError, "recv has 5 elements .* needs 4"),
    ("all_gather(wrong recv size)", lambda c: c.iall_gather(np.zeros(3), np.zeros(3 * c.size + 1)),
     ValueError, "recv needs"),
    ("all_gather(dtype mismatch)",
     lambda c: c.all_gather(np.zeros(3, np.float16), np.zeros(3 * c.size, np.float32)),
     ValueError, "does not match send dtype float16"),
    ("all_gather(overlap)", lambda c: (lambda a: c.all_gather(a[1:3], a))(np.zeros(2 * c.size + 2)),
     ValueError, "overlaps recv|recv needs"),
    ("broadcast(root out of range)", lambda c: c.broadcast(np.zeros(2), root=c.size),
     ValueError, "root .* is not a rank"),
    ("send(to self)", lambda c: c.send(np.zeros(2), dest=c.rank),
     ValueError, "not another rank"),
    ("all_reduce_obj(op='xor')", lambda c: c.all_reduce_obj(1, op="xor"),
     ValueError, "unknown op 'xor'"),
]


@pytest.mark.mpi
@pytest.mark.parametrize("call,error,match", [b[1:] for b in BAD_CALLS],
                         ids=[b[0] for b in BAD_CALLS])
def test_bad_input_raises_before_mpi(guarded, call, error, match):
    with pytest.raises(error, match=match):
        call(guarded)


def test_reduce_scatter_uneven_names_the_padding():
    comm = make_test_comm("self")
    comm.size = 4  # pretend: the check reads only the size
    comm.mpi, real = NoMPI(), comm.mpi
    with pytest.raises(ValueError, match=r"10 elements, not a multiple .* size 4; pad it to 12"):
        comm.reduce_scatter(np.zeros(10))
    comm.mpi = real
    comm.free()


@pytest.mark.mpi
def test_size_one_makes_no_mpi_call():
    comm = Communicator(MPI.COMM_SELF, "self", debug=True, timeout=30)
    comm.mpi = NoMPI()
    a = np.arange(6.0)
    assert comm.all_reduce(a, op="avg") is a and (a == np.arange(6.0)).all()
    assert comm.iall_reduce(a).wait() is a
    recv = comm.reduce_scatter(np.arange(4.0).reshape(2, 2))
    assert recv.shape == (2, 2) and (recv.ravel() == np.arange(4.0)).all()
    assert (comm.ireduce_scatter(np.ones(3)).wait() == 1).all()
    assert (comm.all_gather(np.arange(3)) == np.arange(3)).all()
    assert comm.iall_gather(np.arange(3)).test()
    assert comm.broadcast(a, root=0) is a and comm.ibroadcast(a).done
    comm.barrier()
    assert comm.all_reduce_obj(5) == 5 and comm.all_gather_obj(5) == [5]
    assert comm.broadcast_obj("x") == "x" and comm.gather_obj(1) == [1]
    assert [e.op for e in comm.history][:3] == ["all_reduce", "iall_reduce", "reduce_scatter"]
    assert comm.stats.total_bus_bytes == 0  # nothing left the rank


@pytest.mark.mpi(min_size=2)
def test_debug_mode_rejects_on_every_rank():
    """One rank's bad buffer raises a ValueError on all ranks, not a hang."""
    comm = make_test_comm("world", debug=True)
    buf = np.zeros((4, 4))
    bad = buf[:, 0] if comm.rank == 1 else np.zeros(4)
    with pytest.raises(ValueError, match="rank 1: ValueError: all_reduce: buf .* not C-contiguous"):
        comm.all_reduce(bad)
    # The communicator is still usable and in step afterwards.
    assert comm.all_reduce_obj(1) == comm.size
    comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("which", ["shape", "dtype", "op", "kind", "skip"])
def test_debug_mode_mismatch_raises_on_every_rank(which):
    comm = make_test_comm("world", debug=True)
    odd = comm.rank == comm.size - 1
    with pytest.raises(CollectiveMismatch) as info:
        if which == "shape":
            comm.all_reduce(np.zeros(5 if odd else 4, np.float32))
        elif which == "dtype":
            comm.all_reduce(np.zeros(4, np.float64 if odd else np.float32))
        elif which == "op":
            comm.all_reduce(np.zeros(4), op="max" if odd else "sum")
        elif which == "kind":
            (comm.broadcast if odd else comm.all_reduce)(np.zeros(4))
        else:  # the last rank skipped one collective: sequence numbers differ
            if odd:
                comm._calls.seq += 1
            comm.barrier()
    message = str(info.value)
    others = f"ranks {list(range(comm.size - 1))}" if comm.size > 2 else "rank 0"
    assert f"{others} called" in message and f"rank {comm.size - 1} called" in message
    expected = {"shape": ["shape (4,)", "shape (5,)"],
                "dtype": ["dtype float32", "dtype float64"],
                "op": ["op=sum", "op=max"],
                "kind": ["all_reduce #1", "broadcast #1"],
                "skip": ["barrier #1", "barrier #2"]}[which]
    for fragment in expected:
        assert fragment in message
    assert "test_comm_checks.py" in message  # names the call sites
    comm.free()

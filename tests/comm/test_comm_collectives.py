"""Every collective, checked on every rank, on groups of size 1, 2, 3 and 4.

Serial leg: ``self`` and ``world`` (both size 1). Under ``mpiexec -n 4``:
``self`` (1), ``split2`` (2), ``split3`` (3), ``world`` (4); see
mpishard/testing/fake_cupy.py. Element counts include ones that do not divide by
the group size; values are small integers so float16 sums are exact.
"""
import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import Handle
from mpishard.testing.fake_cupy import COMM_KINDS, make_test_comm, required_size

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

DTYPES = ["float32", "float64", "float16"]
COUNTS = [1, 7, 12]          # per-rank element counts: odd, uneven, even


@pytest.fixture(params=COMM_KINDS)
def comm(request):
    kind = request.param
    world = MPI.COMM_WORLD
    if world.Get_size() < required_size(kind):
        pytest.skip(f"{kind} needs {required_size(kind)} ranks")
    c = make_test_comm(kind)
    if c is None:
        assert world.Get_rank() >= required_size(kind)
        pytest.skip(f"rank {world.Get_rank()} sits out of {kind}")
    assert c.size == (world.Get_size() if kind == "world" else required_size(kind))
    yield c
    c.free()


def rank_data(comm, count, dtype, rank=None, shape=None):
    """Rank r's contribution: arange(count) + r (small integers)."""
    r = comm.rank if rank is None else rank
    a = (np.arange(count) + r).astype(dtype)
    return a.reshape(shape) if shape else a


def expected_sum(comm, count, dtype):
    n = comm.size
    return (n * np.arange(count) + n * (n - 1) // 2).astype(dtype)


def finish(result, blocking):
    return result if blocking else result.wait()


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce(comm, dtype, blocking):
    for count in COUNTS:
        for op in ("sum", "avg", "max"):
            buf = rank_data(comm, count, dtype)
            call = comm.all_reduce if blocking else comm.iall_reduce
            out = finish(call(buf, op=op), blocking)
            assert out is buf  # in place
            want = {"sum": expected_sum(comm, count, dtype),
                    "avg": expected_sum(comm, count, "float64") / comm.size,
                    "max": rank_data(comm, count, dtype, rank=comm.size - 1)}[op]
            np.testing.assert_allclose(buf, want.astype(dtype), rtol=1e-3)
            assert buf.dtype == np.dtype(dtype)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter(comm, dtype, blocking):
    n = comm.size
    for block in COUNTS:
        send = rank_data(comm, block * n, dtype)
        call = comm.reduce_scatter if blocking else comm.ireduce_scatter
        recv = finish(call(send), blocking)
        full = expected_sum(comm, block * n, dtype)
        np.testing.assert_array_equal(recv, full[comm.rank * block:(comm.rank + 1) * block])
        # 2-D send whose first dimension divides: recv keeps the trailing shape.
        send2 = rank_data(comm, n * 2 * block, dtype, shape=(n * 2, block))
        recv2 = np.empty((2, block), dtype)
        out = finish(call(send2, recv2, op="avg"), blocking)
        assert out is recv2
        want = expected_sum(comm, n * 2 * block, "float64").reshape(n * 2, block) / n
        np.testing.assert_allclose(recv2, want[2 * comm.rank:2 * comm.rank + 2], rtol=1e-3)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather(comm, dtype, blocking):
    n = comm.size
    call = comm.all_gather if blocking else comm.iall_gather
    for count in COUNTS:
        send = np.full(count, comm.rank + 1, dtype)
        recv = finish(call(send), blocking)
        assert recv.shape == (n * count,)
        np.testing.assert_array_equal(recv, np.repeat(np.arange(1, n + 1), count).astype(dtype))
        # In place: send is this rank's block of recv (how ZeRO keeps its shard).
        full = np.zeros(n * count, dtype)
        shard = full[comm.rank * count:(comm.rank + 1) * count]
        shard[...] = comm.rank + 1
        assert finish(call(shard, full), blocking) is full
        np.testing.assert_array_equal(full, recv)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast(comm, dtype, blocking):
    call = comm.broadcast if blocking else comm.ibroadcast
    for root in range(comm.size):
        buf = rank_data(comm, 7, dtype, shape=(7, 1))
        assert finish(call(buf, root=root), blocking) is buf
        np.testing.assert_array_equal(buf, rank_data(comm, 7, dtype, rank=root, shape=(7, 1)))


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("dtype", DTYPES + ["int64"])
def test_all_to_all(comm, dtype, blocking):
    """Block j of rank r's send lands in block r of rank j's recv."""
    n = comm.size
    call = comm.all_to_all if blocking else comm.iall_to_all
    for block in COUNTS:
        # element k of block j on rank r: 100 * r + 10 * j + k (exact in float16)
        send = (100 * comm.rank + 10 * np.arange(n)[:, None]
                + np.arange(block)[None, :]).astype(dtype)
        recv = finish(call(send), blocking)
        assert recv.shape == send.shape and recv.dtype == send.dtype
        want = (100 * np.arange(n)[:, None] + 10 * comm.rank
                + np.arange(block)[None, :]).astype(dtype)
        np.testing.assert_array_equal(recv, want)
        flat_out = np.empty(n * block, dtype)
        assert finish(call(send.reshape(-1), flat_out), blocking) is flat_out
        np.testing.assert_array_equal(flat_out, want.reshape(-1))
    assert comm.stats["all_to_all"].calls == 2 * len(COUNTS)
    assert comm.stats["all_to_all"].bus_bytes == sum(
        int(round((n - 1) / n * n * b * np.dtype(dtype).itemsize)) for b in COUNTS) * 2


def test_all_to_all_rejects_what_cannot_split(comm):
    if comm.size > 1:
        with pytest.raises(ValueError, match=f"do not split into {comm.size} equal blocks"):
            comm.all_to_all(np.zeros(comm.size + 1))
    with pytest.raises(ValueError, match="recv has 3 elements but send has"):
        comm.all_to_all(np.zeros(2 * comm.size), np.zeros(3))
    buf = np.zeros(2 * comm.size)
    with pytest.raises(ValueError, match="recv overlaps send"):
        comm.all_to_all(buf, buf)
    with pytest.raises(ValueError, match="dtype"):
        comm.all_to_all(np.zeros(comm.size, np.float32), np.zeros(comm.size, np.float64))


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_send_recv_ring(comm, blocking):
    if comm.size == 1:
        with pytest.raises(ValueError, match="not another rank"):
            comm.send(np.zeros(3), dest=0)
        return
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    out = np.full(5, comm.rank, np.float32)
    got = np.empty(5, np.float32)
    # Even ranks send first, odd ranks receive first: no deadlock in blocking mode.
    if blocking:
        if comm.rank % 2 == 0:
            comm.send(out, right, tag=3)
            comm.recv(got, left, tag=3)
        else:
            comm.recv(got, left, tag=3)
            comm.send(out, right, tag=3)
    else:
        handles = [comm.irecv(got, left, tag=3), comm.isend(out, right, tag=3)]
        assert handles[0].wait() is got
        handles[1].wait()
        assert all(h.done for h in handles)
    np.testing.assert_array_equal(got, np.full(5, left, np.float32))


def test_nonblocking_overlap_and_test(comm):
    """Several handles in flight at once; test() polls; wait() is idempotent."""
    bufs = [rank_data(comm, 9, "float64") for _ in range(3)]
    handles = [comm.iall_reduce(b) for b in bufs]
    gathered = comm.iall_gather(np.array([comm.rank], np.int64))
    while not handles[0].test():
        pass
    results = [h.wait() for h in handles] + [gathered.wait(), gathered.wait()]
    for b in results[:3]:
        np.testing.assert_array_equal(b, expected_sum(comm, 9, "float64"))
    np.testing.assert_array_equal(results[3], np.arange(comm.size))
    assert isinstance(handles[0], Handle) and handles[0].test()


def test_integer_and_large_count(comm):
    """Integers reduce exactly; a count above one MPI eager message still works."""
    big = np.full(70_000, comm.rank, np.int64)
    comm.all_reduce(big, op="max")
    assert (big == comm.size - 1).all()
    shard = comm.reduce_scatter(np.ones(comm.size * 1000, np.int32))
    assert shard.shape == (1000,) and (shard == comm.size).all()


def test_obj_collectives(comm):
    n, r = comm.size, comm.rank
    assert comm.all_reduce_obj(r + 1) == n * (n + 1) // 2
    assert comm.all_reduce_obj(r, op="max") == n - 1
    assert comm.all_reduce_obj(r, op="min") == 0
    assert comm.all_reduce_obj(r == 0, op="or") is True
    assert comm.all_gather_obj({"rank": r}) == [{"rank": i} for i in range(n)]
    assert comm.broadcast_obj(("meta", r), root=n - 1) == ("meta", n - 1)
    gathered = comm.gather_obj(r * 10, root=0)
    assert gathered == ([i * 10 for i in range(n)] if r == 0 else None)
    comm.barrier()
    assert comm.stats["barrier"].calls == 1


def test_split_and_dup(comm):
    # Even and odd ranks form two groups; the key reverses the order.
    half = comm.split(comm.rank % 2, key=-comm.rank, name="half")
    nobody = comm.split(None)
    twin = comm.dup()
    assert nobody is None
    members = half.all_gather_obj(comm.rank)
    assert members == sorted([i for i in range(comm.size) if i % 2 == comm.rank % 2],
                             reverse=True)
    assert half.name == "half" and twin.size == comm.size and twin.rank == comm.rank
    assert twin.all_reduce_obj(1) == comm.size
    half.free()
    twin.free()

"""Ledger, watchdog (in process, without aborting) and statistics."""
import time

import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import CollectiveTimeout, CommStats, Communicator
from mpishard.comm.debug import Family, CallRecord, Watchdog
from mpishard.comm.stats import bus_bytes
from mpishard.testing.fake_cupy import make_test_comm

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["self", "world"])
def comm(request):
    c = make_test_comm(request.param)
    yield c
    c.free()


@pytest.mark.mpi
def test_history_records_recent_collectives(comm):
    comm.all_reduce(np.zeros((2, 3), np.float32), op="max")
    handle = comm.iall_gather(np.zeros(2, np.float64))
    assert comm.history[-1].elapsed is None or comm.size == 1  # still pending
    handle.wait()
    comm.broadcast_obj("x")
    first, second, third = list(comm.history)[-3:]
    assert (first.seq, first.op, first.shape) == (1, "all_reduce", (2, 3))
    assert str(first.dtype) == "float32"
    assert first.detail == "op=max" and first.elapsed is not None and first.elapsed >= 0
    assert (second.seq, second.op, second.shape) == (2, "iall_gather", (2,))
    assert second.elapsed is not None
    assert (third.seq, third.op) == (3, "broadcast_obj")
    assert first.caller.startswith("comm/test_comm_debug.py:")  # the caller, not mpishard
    text = comm.format_history()
    assert "all_reduce #1 (shape (2, 3), float32, op=max)" in text


@pytest.mark.mpi
def test_history_keeps_the_last_n_and_family_reports_children():
    comm = Communicator(MPI.COMM_SELF, "small", history_size=3)
    for _ in range(5):
        comm.barrier()
    assert [e.seq for e in comm.history] == [3, 4, 5]
    child = comm.dup(name="child")
    child.all_reduce_obj(1)
    report = comm.format_history()
    assert "child" in report and "all_reduce_obj #1" in report and "barrier #5" in report
    child.free()


def test_watchdog_fires_once_with_the_stuck_operation(capsys):
    fired = []
    entry = CallRecord("world", 7, "all_reduce", (4,), "float32", "op=sum")
    dog = Watchdog(0.05, report=lambda: "world  all_reduce #7 ...", on_timeout=fired.append)
    dog.arm(entry)
    assert not dog.check(now=time.perf_counter())  # not overdue yet
    deadline = time.monotonic() + 5
    while not fired and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(fired) == 1 and isinstance(fired[0], CollectiveTimeout)
    assert "all_reduce #7 (shape (4,), float32, op=sum) on communicator 'world'" in str(fired[0])
    assert "did not complete within 0.05 s" in str(fired[0])
    err = capsys.readouterr().err
    assert "CollectiveTimeout: all_reduce #7" in err and "world  all_reduce #7 ..." in err
    assert not dog.check(now=time.perf_counter() + 100)  # fires only once


def test_watchdog_quiet_when_disarmed_in_time():
    fired = []
    dog = Watchdog(0.05, report=lambda: "", on_timeout=fired.append)
    dog.arm(CallRecord("world", 1, "barrier", None, None))
    dog.disarm()
    time.sleep(0.2)
    assert fired == [] and not dog.check(now=time.perf_counter() + 100)


@pytest.mark.mpi
def test_communicator_arms_and_disarms_its_watchdog(comm):
    fired = []
    family = Family(timeout=30, on_timeout=fired.append)
    watched = Communicator(comm.mpi, "watched", timeout=30, _family=family)
    armed = []
    real_arm = family.watchdog.arm
    family.watchdog.arm = lambda entry: (armed.append(entry.op), real_arm(entry))
    watched.all_reduce(np.ones(3))
    handle = watched.iall_reduce(np.ones(3))
    assert family.watchdog._armed is None  # issuing does not keep it armed
    handle.wait()
    watched.barrier()
    assert family.watchdog._armed is None and fired == []
    assert armed == ([] if comm.size == 1 else ["all_reduce", "iall_reduce", "iall_reduce",
                                                 "barrier"])


@pytest.mark.parametrize("kind,factor", [("all_reduce", 1.5), ("reduce_scatter", 0.75),
                                         ("all_gather", 0.75), ("broadcast", 1.0),
                                         ("send", 1.0), ("barrier", 0.0)])
def test_bus_bytes_follow_nccl_tests(kind, factor):
    assert bus_bytes(kind, 4000, 4) == 4000 * factor
    assert bus_bytes(kind, 4000, 1) == 0


@pytest.mark.mpi
def test_stats_count_bytes_per_kind(comm):
    n = comm.size
    comm.stats.reset()
    comm.all_reduce(np.zeros(100, np.float32))
    comm.all_reduce(np.zeros(100, np.float32))
    comm.reduce_scatter(np.zeros(8 * n, np.float64))
    comm.iall_gather(np.zeros(10, np.float16)).wait()
    snap = comm.stats.snapshot()
    assert snap["all_reduce"]["calls"] == 2 and snap["all_reduce"]["bytes"] == 800
    assert snap["all_reduce"]["bus_bytes"] == round(2 * (n - 1) / n * 400) * 2
    assert snap["reduce_scatter"]["bytes"] == 64 * n
    assert snap["all_gather"]["bytes"] == 20 * n  # the full gathered buffer
    assert comm.stats.total_bus_bytes == sum(v["bus_bytes"] for v in snap.values())
    assert all(v["seconds"] >= 0 for v in snap.values())
    assert "all_reduce" in comm.stats.format()
    merged = CommStats.merged(comm.stats, comm.stats)
    assert merged["all_reduce"].calls == 4
    comm.stats.reset()
    assert comm.stats.snapshot() == {} and comm.stats.total_bus_bytes == 0

"""The NCCL backend's decisions, on CPU, with stand-ins for CuPy and NCCL.

``comm_backend="auto"`` must not pick NCCL for a group in which two ranks of a
node use the same GPU (NCCL refuses that group: [Note: one GPU per rank]);
statistics of NCCL calls are device time from CUDA events, not the ~0 s the
host spends issuing them. The real NCCL paths run in scripts/gpu_check.py.
"""
import warnings

import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import format_rank_reports, rank_report
from mpishard.comm.backends import choose_comm_backend, nccl
from mpishard.testing.fake_cupy import (COMM_KINDS, BackendAtSizeOne, FakeDeviceArray,
                                        install_fake_cupy, make_test_comm, required_size)

pytestmark = [pytest.mark.timeout(60)]


class FakeRequest:
    """What an NCCL collective returns: complete in stream order, with device time."""

    def __init__(self, seconds):
        self.seconds = seconds
        self.read = 0

    def Test(self):  # noqa: N802
        return True

    def Wait(self):  # noqa: N802
        pass

    def device_seconds(self):
        self.read += 1
        return self.seconds


class FakeGroup:
    built = []

    def __init__(self, mpi_comm):
        FakeGroup.built.append(mpi_comm.Get_size())
        self.requests = []

    def supports(self, a):
        return True

    def all_reduce(self, buf, op, host_sync=False):
        self.requests.append(FakeRequest(0.25))
        return self.requests[-1]

    def close(self):
        pass


@pytest.fixture
def fake_nccl(monkeypatch):
    """NCCL "loads", groups are FakeGroups; returns a setter for each rank's device."""
    install_fake_cupy(monkeypatch)
    monkeypatch.setattr(nccl, "nccl_available", lambda: (True, "NCCL 2.99 (fake)"))
    monkeypatch.setattr(nccl, "NcclGroup", FakeGroup)
    monkeypatch.setattr(nccl, "nccl_dtype", lambda dtype: "fake")
    FakeGroup.built = []

    def devices(identity):
        monkeypatch.setattr(nccl, "device_identity", lambda device=None: identity)
    return devices


@pytest.fixture(params=COMM_KINDS)
def kind(request):
    if MPI.COMM_WORLD.Get_size() < required_size(request.param):
        pytest.skip(f"{request.param} needs {required_size(request.param)} ranks")
    return request.param


def test_shared_gpu_finds_two_ranks_of_one_node_on_one_device():
    assert nccl.shared_gpu([("a", "0000:01:00.0"), ("a", "0000:02:00.0"),
                            ("b", "0000:01:00.0")]) is None
    assert nccl.shared_gpu([("a", "X"), ("b", "X"), ("a", "Y"), ("a", "X")]) == (
        "ranks 0 and 3 on host a share GPU X")
    assert nccl.shared_gpu([]) is None


def test_choose_comm_backend_says_why(monkeypatch):
    assert choose_comm_backend("mpi") == ("mpi", "comm_backend='mpi'")
    monkeypatch.setattr(nccl, "nccl_available", lambda: (False, "CuPy is not importable"))
    assert choose_comm_backend("auto") == (
        "mpi", "auto: NCCL unavailable (CuPy is not importable)")
    with pytest.raises(ValueError, match=r"comm_backend='nccl' but NCCL is unavailable \(CuPy "
                                         r"is not importable\); install CuPy with NCCL"):
        choose_comm_backend("nccl")
    with pytest.raises(ValueError, match=r"unknown comm_backend 'gloo'; use one of "
                                         r"\('mpi', 'nccl', 'auto'\)"):
        choose_comm_backend("gloo")
    monkeypatch.setattr(nccl, "nccl_available", lambda: (True, "NCCL 2.99"))
    backend, why = choose_comm_backend("auto")
    assert backend == "nccl" and "unless ranks of one node share a GPU" in why
    assert choose_comm_backend("nccl") == ("nccl", "comm_backend='nccl' (NCCL 2.99)")


@pytest.mark.mpi(min_size=2)
def test_auto_falls_back_to_mpi_when_ranks_share_a_gpu(fake_nccl):
    fake_nccl("0000:01:00.0")  # every rank on the same GPU of this one host
    comm = make_test_comm("world", comm_backend="auto", cuda_aware=False)
    assert comm.comm_backend == "nccl"  # decided at the first device collective
    child = comm.dup()
    buf = FakeDeviceArray(np.full(3, comm.rank, np.float32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm.all_reduce(buf)
    np.testing.assert_array_equal(buf.host(), np.full(3, comm.size * (comm.size - 1) / 2))
    assert FakeGroup.built == []  # NCCL was never asked to build the group
    assert comm.comm_backend == "mpi"
    assert comm.comm_backend_how.startswith("auto: MPI, not NCCL: ranks 0 and 1 on host ")
    assert "NCCL refuses two ranks on one GPU" in comm.comm_backend_how
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == (1 if comm.rank == 0 else 0)
    assert all("ranks 0 and 1 on host" in m and "comm_backend='mpi'" in m for m in messages)
    assert child.comm_backend == "nccl"  # and checks its own group (below)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        child.all_reduce(FakeDeviceArray(np.ones(2, np.float32)))
    assert len(caught) == (1 if comm.rank == 0 else 0)
    assert all(w.filename == __file__ for w in caught)  # names the caller's line
    assert child.comm_backend == "mpi" and FakeGroup.built == []
    later = comm.dup()
    assert later.comm_backend == "mpi"  # made after the decision: plain MPI
    for c in (later, child, comm):
        c.free()


@pytest.mark.mpi
def test_auto_keeps_nccl_when_every_rank_has_its_own_gpu(fake_nccl, kind):
    fake_nccl(f"0000:{MPI.COMM_WORLD.Get_rank():02x}:00.0")
    comm = make_test_comm(kind, comm_backend="auto", backend_at_size_one=True)
    if comm is None:
        pytest.skip("sits out")
    buf = FakeDeviceArray(np.ones(4, np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert comm.all_reduce(buf) is buf
    assert FakeGroup.built == [comm.size] and comm.comm_backend == "nccl"
    assert comm.comm_backend_how.endswith("; no two ranks share a GPU")
    comm.free()


def test_explicit_nccl_does_not_second_guess(fake_nccl, monkeypatch):
    fake_nccl("same")
    monkeypatch.setattr(nccl, "gather_devices", lambda mpi_comm: pytest.fail("checked GPUs"))
    comm = BackendAtSizeOne(MPI.COMM_SELF, comm_backend="nccl")
    assert comm.comm_backend_how == "comm_backend='nccl' (NCCL 2.99 (fake))"
    comm.all_reduce(FakeDeviceArray(np.ones(2, np.float32)))
    assert FakeGroup.built == [1] and comm.comm_backend == "nccl"
    assert comm.comm_backend_how == "comm_backend='nccl' (NCCL 2.99 (fake))"


@pytest.mark.mpi
def test_nccl_statistics_are_device_time_read_lazily(fake_nccl, kind):
    fake_nccl(f"gpu{MPI.COMM_WORLD.Get_rank()}")
    comm = make_test_comm(kind, comm_backend="nccl", backend_at_size_one=True)
    if comm is None:
        pytest.skip("sits out")
    comm.all_reduce(FakeDeviceArray(np.ones(4, np.float32)))
    comm.iall_reduce(FakeDeviceArray(np.ones(4, np.float32))).wait()
    requests = comm.backend.group.requests
    assert [r.read for r in requests] == [0, 0]  # nothing waited for on the hot path
    assert comm.stats["all_reduce"].calls == 2
    assert comm.stats["all_reduce"].seconds == pytest.approx(0.5)  # 2 x 0.25 s on the device
    assert [r.read for r in requests] == [1, 1]
    assert comm.stats.snapshot()["all_reduce"]["seconds"] == pytest.approx(0.5)
    comm.stats.reset()
    comm.all_reduce(FakeDeviceArray(np.ones(4, np.float32)))
    comm.stats.reset()  # pending device times of a reset step are dropped
    assert comm.stats.total_seconds == 0 and requests[-1].read == 0
    comm.free()


@pytest.mark.mpi(min_size=2)
def test_info_says_auto_will_fall_back_when_the_gpus_to_bind_collide(fake_nccl, monkeypatch):
    fake_nccl("0000:01:00.0")
    one_gpu = type("cupy", (), {"cuda": type("cuda", (), {
        "runtime": type("runtime", (), {"getDeviceCount": staticmethod(lambda: 1)})})})
    monkeypatch.setattr(nccl, "cupy_or_none", lambda: one_gpu)
    comm = make_test_comm("world", comm_backend="auto")
    undecided = comm.comm_backend_how
    reports = comm.all_gather_obj(rank_report(comm))
    assert reports[comm.rank]["comm_backend_how"].startswith(
        "auto: will fall back to MPI at the first device collective: ranks 0 and 1 on host")
    assert "    comm backend: auto: will fall back to MPI" in format_rank_reports(reports)
    assert FakeGroup.built == [] and comm.comm_backend_how == undecided  # info decides nothing
    comm.free()

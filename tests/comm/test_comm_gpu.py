"""CUDA-aware detection and the rank report, on CPU.

The CuPy paths themselves (staging, CUDA-aware, NCCL) need a GPU: they are
exercised by scripts/gpu_check.sh.
"""
import os

import pytest
from mpi4py import MPI

from mpishard.comm import Communicator, detect_cuda_aware, format_rank_reports, rank_report
from mpishard.comm import gpu
from mpishard.testing.fake_cupy import make_test_comm

pytestmark = pytest.mark.timeout(60)


def test_loaded_libmpi_is_the_one_mpi4py_uses():
    path = gpu.loaded_libmpi()
    assert path is not None and os.path.exists(path)
    assert os.path.basename(path).startswith(("libmpi", "libmpich", "impi", "msmpi"))


def test_query_cuda_support_in_the_loaded_library():
    answer = gpu.query_cuda_support(gpu.loaded_libmpi())
    if MPI.get_vendor()[0] == "MPICH":
        # The MPICH wheel has the symbol and is built without CUDA.
        assert answer == 0
    else:
        assert answer in (0, 1, None)
    # RTLD_NOLOAD: a library that is not loaded is not loaded by asking.
    assert gpu.query_cuda_support("libdefinitely-not-loaded-mpi.so") is None


def test_detect_cuda_aware_reports_how():
    aware, how = detect_cuda_aware()
    if MPI.get_vendor()[0] == "MPICH":
        assert aware is False
        assert how.startswith("MPIX_Query_cuda_support() = 0 in ") and gpu.loaded_libmpi() in how
    assert detect_cuda_aware(True) == (True, "set by the cuda_aware argument")
    assert detect_cuda_aware(False, "MPISHARD_CUDA_AWARE=0") == (
        False, "set by MPISHARD_CUDA_AWARE=0")


def test_vendor_hints_when_the_symbol_is_missing(monkeypatch):
    monkeypatch.setattr(gpu, "query_cuda_support", lambda path: None)
    aware, how = detect_cuda_aware(environ={"MPICH_GPU_SUPPORT_ENABLED": "1"})
    assert aware is True and "MPICH_GPU_SUPPORT_ENABLED=1 (Cray MPICH GPU support)" in how
    aware, how = detect_cuda_aware(environ={})
    assert aware is False and "set MPISHARD_CUDA_AWARE=1 if it is" in how


def test_open_mpi_cuda_support_variable_is_not_proof(monkeypatch):
    """OMPI_MCA_opal_cuda_support=true asks for CUDA support; an Open MPI built
    without it ignores the variable, so only MPIX_Query_cuda_support decides."""
    monkeypatch.setattr(gpu, "loaded_libmpi", lambda: "/opt/openmpi/lib/libmpi.so.40")
    monkeypatch.setattr(gpu, "query_cuda_support", lambda path: None)
    hint = {"OMPI_MCA_opal_cuda_support": "true"}
    aware, how = detect_cuda_aware(environ=hint)
    assert aware is False
    assert "OMPI_MCA_opal_cuda_support=true is set, but Open MPI builds without CUDA " \
           "ignore it" in how and "staged" in how
    monkeypatch.setattr(gpu, "query_cuda_support", lambda path: 1)
    aware, how = detect_cuda_aware(environ=hint)
    assert aware is True and how == ("MPIX_Query_cuda_support() = 1 in "
                                     "/opt/openmpi/lib/libmpi.so.40")
    monkeypatch.setattr(gpu, "query_cuda_support", lambda path: 0)
    assert detect_cuda_aware(environ=hint)[0] is False


def test_communicator_override_skips_detection(monkeypatch):
    monkeypatch.setattr(gpu, "loaded_libmpi", lambda: pytest.fail("detection ran"))
    comm = Communicator(MPI.COMM_SELF, cuda_aware=True)
    assert comm.cuda_aware == (True, "set by the cuda_aware argument")
    env = Communicator.from_env(MPI.COMM_SELF, environ={"MPISHARD_CUDA_AWARE": "0"})
    assert env.cuda_aware == (False, "set by MPISHARD_CUDA_AWARE=0")
    child = env.dup()  # split/dup children inherit the decision and its source
    assert child.cuda_aware == (False, "set by MPISHARD_CUDA_AWARE=0")
    child.free()


def test_nccl_backend_needs_nccl():
    ok, why = gpu.nccl_available()
    if ok:
        pytest.skip(f"NCCL is available here ({why})")
    assert why
    with pytest.raises(ValueError, match=r"comm_backend='nccl' but NCCL is unavailable"):
        Communicator(MPI.COMM_SELF, comm_backend="nccl")
    assert Communicator(MPI.COMM_SELF, comm_backend="auto").comm_backend == "mpi"


@pytest.mark.mpi
def test_rank_report_on_every_rank():
    comm = make_test_comm("world")
    report = rank_report(comm)
    reports = comm.all_gather_obj(report)
    assert [r["rank"] for r in reports] == list(range(comm.size))
    assert report["comm_backend"] == "mpi" and report["cuda_aware_how"]
    assert isinstance(report["cuda_aware"], bool) and isinstance(report["nccl_available"], bool)
    assert report["device"] and report["mpi_library"] == gpu.loaded_libmpi()
    text = format_rank_reports(reports)
    assert text.count("CUDA-aware MPI: ") == comm.size and "NCCL: " in text
    comm.free()

"""Shared test set-up.

The suite runs twice: serially (``pytest --with-mpi``, in ``make test`` on two
pytest-xdist workers: MPI tests at world size 1) and under ``mpiexec -n 4 python
-m mpi4py -m pytest --with-mpi``. In the
multi-rank run only tests marked ``@pytest.mark.mpi`` run; the others already
ran serially and would only repeat on every rank, and so are the one-rank
cases of tests parametrized by their sub-world's size (``size`` or ``dp_size``,
as in ``parity.sub_world(size)``): the serial run ran them on a world of one,
and under mpiexec they would hold three ranks idle. A test file without the
``mark.mpi`` mark in its text is not even imported there (its imports, torch's
among them, would cost every rank seconds for tests that all skip); the serial
run checks that every MPI test is in a file that says so.

Under mpiexec every rank waits for the others before each MPI test, sleeping
between polls of a non-blocking barrier (:func:`parity.wait_for_every_rank`):
a rank that sat a test out (a sub-world of fewer ranks) would otherwise spin in
the next test's first collective, taking the CPU the working ranks need when
ranks outnumber cores.

Tests that take the ``array_backend`` fixture run once per array module:
NumPy and the CuPy-strict module (:mod:`mpishard.testing.strict`: NumPy memory behind
CuPy's rules, so NumPy assumptions on the device path fail on a CPU) always,
CuPy too when it imports and sees a GPU. ``MPISHARD_TEST_BACKENDS``
(comma-separated, e.g. ``cupy``) picks the modules instead; asking for CuPy
where it cannot run is an error in every such test, never a skip, so a GPU
check cannot pass without the GPU (scripts/gpu_check.sh sets it).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))
# tests/ mirrors the package's folders; a test may reuse another folder's builders
# (test_hf's transformers models, test_meta_pkl's nanoGPT folder), also when run alone
for _folder in sorted((ROOT / "tests").iterdir()):
    if _folder.is_dir() and any(_folder.glob("test_*.py")) and str(_folder) not in sys.path:
        sys.path.append(str(_folder))


def _world_size() -> int:
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 1


MPI_MARK = "mark.mpi"


def _has_mpi_tests(path: Path) -> bool:
    return MPI_MARK in path.read_text(encoding="utf-8")


def pytest_ignore_collect(collection_path, config):
    if (_world_size() > 1 and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")
            and not _has_mpi_tests(collection_path)):
        return True
    return None


#: the parameters that name an MPI test's sub-world size (``parity.sub_world(size)``)
SUB_WORLD_SIZE = ("size", "dp_size")


def _one_rank_case(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and any(callspec.params.get(name) == 1
                                        for name in SUB_WORLD_SIZE)


def pytest_collection_modifyitems(config, items):
    if _world_size() > 1:
        skip = pytest.mark.skip(reason="not an MPI test: runs in the serial leg")
        skip_one = pytest.mark.skip(reason="a one-rank case: runs in the serial leg")
        for item in items:
            if "mpi" not in item.keywords:
                item.add_marker(skip)
            elif _one_rank_case(item):
                item.add_marker(skip_one)
        return
    unseen = sorted({str(item.path.relative_to(ROOT)) for item in items
                     if item.get_closest_marker("mpi") and not _has_mpi_tests(item.path)})
    if unseen:
        raise pytest.UsageError(
            f"{', '.join(unseen)} hold MPI tests but no {MPI_MARK!r} in their text, so the "
            f"mpiexec legs would not collect them; mark them with @pytest.mark.mpi there")


def pytest_runtest_setup(item):
    if _world_size() > 1 and "mpi" in item.keywords:
        from parity import wait_for_every_rank

        wait_for_every_rank()


ARRAY_BACKENDS = ("numpy", "strict", "cupy")


def _array_backend_names() -> list:
    requested = os.environ.get("MPISHARD_TEST_BACKENDS", "").strip()
    if requested:
        names = [n.strip() for n in requested.split(",") if n.strip()]
        unknown = sorted(set(names) - set(ARRAY_BACKENDS))
        if unknown:
            raise pytest.UsageError(
                f"MPISHARD_TEST_BACKENDS={requested!r} names {unknown}; use a "
                f"comma-separated subset of {', '.join(ARRAY_BACKENDS)}")
        return names
    from mpishard.core.backend import cupy_or_none

    cupy = cupy_or_none()
    try:
        gpus = cupy.cuda.runtime.getDeviceCount() if cupy is not None else 0
    except Exception:  # CuPy imports but finds no driver
        gpus = 0
    return ["numpy", "strict", "cupy"] if gpus else ["numpy", "strict"]


def _node_local_rank() -> int:
    # From the launcher's environment, not a collective: fixtures run per test
    # and a collective here could pair up differently on different ranks.
    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 0


@pytest.fixture(params=_array_backend_names())
def array_backend(request):
    """A fresh :class:`mpishard.core.backend.Backend` for each array module under test.

    On CuPy each rank binds GPU ``local rank % GPUs`` (ranks share one GPU).
    On the strict module, host syncs are counted from zero for each test.
    Raises ``BackendUnavailable`` (an error, not a skip) when CuPy was asked
    for and cannot run.
    """
    from mpishard.core.backend import Backend

    if request.param == "strict":
        from mpishard.testing.strict import syncs

        syncs.reset()
    return Backend.resolve(request.param, local_rank=_node_local_rank())


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(1234)

"""Shared test set-up.

The suite runs twice: serially (``pytest --with-mpi``: MPI tests at world size
1) and under ``mpiexec -n 4 python -m mpi4py -m pytest --with-mpi``. In the
multi-rank run only tests marked ``@pytest.mark.mpi`` run; the others already
ran serially and would only repeat on every rank.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _world_size() -> int:
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 1


def pytest_collection_modifyitems(config, items):
    if _world_size() > 1:
        skip = pytest.mark.skip(reason="not an MPI test: runs in the serial leg")
        for item in items:
            if "mpi" not in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(1234)

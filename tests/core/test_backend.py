"""Backend resolution and the memory ledger."""
import gc

import numpy as np
import pytest

from mpishard.core.backend import (Backend, BackendUnavailable, MemoryLedger, OutOfMemoryBudget,
                              cupy_or_none, xp_of)


def test_numpy_backend():
    be = Backend.resolve("numpy")
    assert be.xp is np and be.device is None and be.describe() == "numpy/cpu"
    assert xp_of(np.ones(2)) is np


def test_auto_falls_back_to_numpy_without_gpu():
    be = Backend.resolve("auto")
    if cupy_or_none() is None:
        assert be.name == "numpy"


@pytest.mark.skipif(cupy_or_none() is not None, reason="CuPy present")
def test_cupy_without_cupy_says_how_to_install():
    with pytest.raises(BackendUnavailable, match=r"pip install 'mpishard\[cuda12\]'"):
        Backend.resolve("cupy")


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        Backend.resolve("tpu")


def test_ledger_counts_by_category_and_releases_on_gc():
    ledger = MemoryLedger()
    a = ledger.zeros("params", (10, 10), "float32", "w")
    b = ledger.empty("grads", (5,), "float64", "g")
    assert ledger.bytes_by_category()["params"] == 400
    assert ledger.bytes_by_category()["grads"] == 40
    assert ledger.total == 440
    del a
    gc.collect()
    assert ledger.bytes_by_category()["params"] == 0
    assert ledger.peak_by_category()["params"] == 400
    ledger.release(b)
    assert ledger.total == 0 and ledger.peak_total == 440


def test_ledger_budget_names_the_allocation():
    ledger = MemoryLedger(budget=1000)
    keep = ledger.zeros("params", (100,), "float32", "w")    # 400 bytes
    with pytest.raises(OutOfMemoryBudget, match=r"optim 'exp_avg'.*budget of 1,000"):
        ledger.zeros("optim", (200,), "float32", "exp_avg")   # 800 more
    assert ledger.total == 400 and keep.size == 100


def test_ledger_rejects_unknown_category():
    with pytest.raises(ValueError, match="unknown ledger category 'weights'"):
        MemoryLedger().track("weights", np.ones(2))

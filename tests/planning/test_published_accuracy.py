"""The planner against the published Megatron-LM runs (``benchmarks/plan_accuracy.py
--published-only``): the targets of issue "Reproduce the published tables".

    pytest -q tests/planning/test_published_accuracy.py

A change to the step-time model, the machine descriptions or the memory plan that
moves the published errors past a target fails here, not silently in the README.
"""
import importlib.util
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_accuracy.py"


@pytest.fixture(scope="module")
def accuracy():
    spec = importlib.util.spec_from_file_location("plan_accuracy", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("plan_accuracy", module)
    spec.loader.exec_module(module)
    start = time.perf_counter()
    result = module.published()
    return module, result, time.perf_counter() - start


def test_the_published_part_takes_seconds(accuracy):
    _, result, seconds = accuracy
    assert len(result["rows"]) >= 19
    assert seconds < 15, f"the published runs took {seconds:.1f} s to predict"


def test_errors_have_both_signs_and_stay_within_todays_figures(accuracy):
    """Today's figures as a ratchet (median <= 5.5%, worst <= 11.5%, Korthikanti Table 5
    mean <= 4%), errors of both signs: a change that makes them worse fails."""
    _, result, _ = accuracy
    assert result["signs"] == ["+", "-"]
    assert result["median_abs_error"] <= 0.055
    assert result["worst_abs_error"] <= 0.115
    assert result["table5_mean_abs_error"] <= 0.04


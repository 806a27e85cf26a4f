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


def test_errors_meet_the_targets_with_both_signs(accuracy):
    """The issue's targets: median |error| <= 5%, worst <= 10%, Korthikanti Table 5's
    mean <= 3.5%, errors of both signs (a change that moves a figure past them fails)."""
    module, result, _ = accuracy
    assert result["signs"] == ["+", "-"]
    assert result["median_abs_error"] <= module.MEDIAN_TARGET
    assert result["worst_abs_error"] <= module.WORST_TARGET
    assert result["table5_mean_abs_error"] <= module.TABLE5_TARGET


def test_a_reduction_the_paper_did_not_overlap_is_exposed(accuracy):
    """Korthikanti's Section 6.3 run reduces gradients with no overlap, as the paper says:
    its data-parallel all-reduce is exposed where the dp = 1 run of Table 5 has none."""
    _, result, _ = accuracy
    rows = {r["id"]: r for r in result["rows"]}
    assert rows["korthikanti2022_sec6.3_530B_dp8_present_work"]["breakdown"]["comm dp"] > 0.1
    assert rows["korthikanti2022_table5_530B_present_work"]["breakdown"].get("comm dp", 0) == 0


def test_every_published_run_fits_its_gpu_by_the_plan(accuracy):
    """The planned peak of the busiest stage within the GPU's memory less its reserve."""
    _, result, _ = accuracy
    for row in result["rows"]:
        assert row["peak_gib"] <= row["usable_gib"], row["id"]

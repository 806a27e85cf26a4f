"""docs/performance.md is what benchmarks/report.py makes of the newest results, and the
newest result of each benchmark is the one shown."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _report():
    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_is_generated_from_the_newest_results():
    page = (ROOT / "docs" / "performance.md").read_text()
    assert page == _report().render(), (
        "docs/performance.md differs from what the results make: run "
        "`python benchmarks/report.py` (never edit the page by hand; notes go to "
        "benchmarks/results/HISTORY.md)")


def _step(folder: Path, stem: str, ratio: float) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    entry = {"mpishard": {"median_step_s": ratio}, "torch": {"median_step_s": 1.0},
             "ratio_mpishard_over_torch": ratio}
    (folder / f"{stem}.json").write_text(json.dumps({"results": {"1_thread": entry}}) + "\n")


def test_the_newest_folder_and_a_final_run_win(tmp_path):
    report = _report()
    _step(tmp_path / "2026-01-01", "step", 0.5)
    _step(tmp_path / "2026-01-02", "step", 0.7)
    _step(tmp_path / "2026-01-02", "step_final", 0.9)
    _step(tmp_path / "2026-01-02", "step_other", 0.1)
    assert report.latest(tmp_path, "step") == (tmp_path / "2026-01-02", "step_final")
    page = report.render(tmp_path)
    assert "| 1 | GPT | 0.9 | 1.0 | 0.900 |" in page and "0.700" not in page
    assert report.latest(tmp_path, "comm") is None
    assert "(not run)" in page


def test_history_lives_with_the_results():
    history = ROOT / "benchmarks" / "results" / "HISTORY.md"
    assert history.exists()
    assert "benchmarks/results/HISTORY.md" in (ROOT / "docs" / "performance.md").read_text()

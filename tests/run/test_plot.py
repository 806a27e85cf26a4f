"""mpishard plot: three panels from a real run's metrics, a real PNG, clear errors."""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpishard.run.plot import PlotError, add_plot_command, load_metrics, metrics_figure, plot_metrics

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
STEPS = 6
TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16",
        "--batch-size", "2", "--max-bytes", "20000", "--eval-batches", "1", "--progress", "false",
        "--eval-interval", "3", "--steps", str(STEPS)]


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    for var in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        env.pop(var, None)
    return env


@pytest.fixture(scope="module")
def metrics(tmp_path_factory):
    """Metrics of a real 2-rank ZeRO-3 run (one rank if there is no mpiexec)."""
    path = tmp_path_factory.mktemp("run") / "metrics.jsonl"
    cmd = [sys.executable, "-m", "mpishard", "train", *TINY, "--metrics", str(path)]
    if MPIEXEC.exists():
        from mpi4py import MPI

        extra = ["--oversubscribe", "--allow-run-as-root"] \
            if MPI.get_vendor()[0] == "Open MPI" else []
        cmd = [str(MPIEXEC), *extra, "-n", "2", sys.executable, "-m", "mpi4py", *cmd[1:]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return path


def test_png_has_three_panels(metrics, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    out = plot_metrics(metrics, tmp_path / "sub" / "plot.png")
    assert out == tmp_path / "sub" / "plot.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 30_000, f"suspiciously small PNG: {len(data)} bytes"
    pixels = imread(out)
    height, width = pixels.shape[:2]
    assert height >= 400 and width >= 3 * height, (height, width)  # three panels side by side
    # Every third of the picture (one panel each) has ink on it, not just background.
    gray = pixels[..., :3].mean(axis=2)
    for third in range(3):
        panel = gray[:, third * width // 3:(third + 1) * width // 3]
        assert (panel < 0.5).mean() > 0.005, f"panel {third} looks empty"


def test_panels_show_the_metrics(metrics):
    pytest.importorskip("matplotlib")
    records = load_metrics(metrics)
    fig = metrics_figure(records, "title")
    loss_ax, tput_ax, mem_ax = fig.axes[:3]
    assert len(fig.axes) == 3
    assert loss_ax.get_title(loc="left") == "Loss"
    assert tput_ax.get_title(loc="left") == "Throughput"
    assert mem_ax.get_title(loc="left").startswith("Memory per rank")

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    assert [s for s, _ in train] == list(range(1, STEPS + 1))
    assert [s for s, _ in val] == [0, 3, STEPS]      # start, eval_interval, end
    lines = {line.get_label(): line for line in loss_ax.get_lines()}
    assert list(lines["train (per step)"].get_ydata()) == [l for _, l in train]
    val_line = next(line for label, line in lines.items() if label.startswith("validation"))
    assert list(val_line.get_xdata()) == [s for s, _ in val]
    assert list(tput_ax.get_lines()[0].get_ydata()) == [r["tokens_per_s"] for r in records
                                                       if "tokens_per_s" in r]

    # Memory: one bar per rank and category present, stacked to each rank's total.
    memory = [r for r in records if "memory" in r][-1]["memory"]
    assert len(memory) == (2 if MPIEXEC.exists() else 1)
    categories = [c for c in memory[0] if any(rank[c] for rank in memory)]
    labels = mem_ax.get_legend_handles_labels()[1]
    assert sorted(labels) == sorted(categories)
    bars = [patch for container in mem_ax.containers for patch in container]
    assert len(bars) == len(memory) * len(categories)
    unit = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "bytes": 1}[mem_ax.get_ylabel()]
    for rank, per_rank in enumerate(memory):
        top = max(b.get_y() + b.get_height() for b in bars if abs(b.get_x() + b.get_width() / 2
                                                                   - rank) < 1e-9)
        assert top == pytest.approx(sum(per_rank.values()) / unit)


def test_plot_command_on_a_subparsers_object(metrics, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    parser = argparse.ArgumentParser(prog="mpishard")
    add_plot_command(parser.add_subparsers(dest="command"))
    out = tmp_path / "cmd.png"
    args = parser.parse_args(["plot", str(metrics), "-o", str(out)])
    assert args.func(args) == 0
    assert out.read_bytes()[:4] == b"\x89PNG" and f"wrote {out}" in capsys.readouterr().out
    # -o defaults to the metrics path with .png
    copy = tmp_path / "copy.jsonl"
    copy.write_text(metrics.read_text())
    args = parser.parse_args(["plot", str(copy)])
    assert args.func(args) == 0 and (tmp_path / "copy.png").exists()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["plot"])
    assert exit_info.value.code == 2


def test_bad_metrics_files(tmp_path):
    with pytest.raises(PlotError, match="does not exist; write one with 'mpishard train"):
        plot_metrics(tmp_path / "missing.jsonl", tmp_path / "x.png")
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text('{"step": 0, "val_loss": 5.0}\nnot json\n')
    with pytest.raises(PlotError, match=r"garbage.jsonl:2 is not a JSON line"):
        plot_metrics(garbage, tmp_path / "x.png")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(PlotError, match="no records with a 'step'"):
        plot_metrics(empty, tmp_path / "x.png")
    no_loss = tmp_path / "no_loss.jsonl"
    no_loss.write_text(json.dumps({"step": 1, "tokens_per_s": 5.0}) + "\n")
    pytest.importorskip("matplotlib")
    with pytest.raises(PlotError, match="no 'loss' or 'val_loss'"):
        plot_metrics(no_loss, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_missing_matplotlib_says_how_to_install(metrics, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now raises ImportError
    with pytest.raises(PlotError, match=r"pip install 'mpishard\[plot\]'"):
        plot_metrics(metrics, tmp_path / "x.png")
    assert issubclass(PlotError, ValueError)   # a ConfigError: the CLI prints one line, exit 2


def test_mpishard_plot_command(metrics, tmp_path):
    """Through the real command line: needs ``add_plot_command`` wired into mpishard.cli.main."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "cli.png"
    run = subprocess.run([sys.executable, "-m", "mpishard", "plot", str(metrics), "-o", str(out)],
                         capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "-m", "mpishard", "plot", str(tmp_path / "no.jsonl")],
                         capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        f"mpishard: error: metrics file {str(tmp_path / 'no.jsonl')!r} does not exist; write one "
        f"with 'mpishard train --metrics {tmp_path / 'no.jsonl'}'"]


def _records(path: Path, steps: int = 3) -> Path:
    """A small metrics file of ``steps`` complete records, as ``mpishard train`` writes them."""
    path.write_text("".join(json.dumps({"step": s, "loss": 5.0 - s, "tokens_per_s": 100.0 + s})
                            + "\n" for s in range(1, steps + 1)))
    return path


def test_picture_paths_are_checked_before_the_metrics_are_read(tmp_path):
    folder = tmp_path / "pictures"
    folder.mkdir()
    missing = tmp_path / "run.jsonl"               # never read: the path is refused first
    with pytest.raises(PlotError, match=f"^picture {folder} is a folder; pass a file name, "
                                        f"e.g. {folder / 'run.png'}$"):
        plot_metrics(missing, folder)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(PlotError, match=f"^picture {blocker / 'x.png'} lies under {blocker}, "
                                        f"a file, so nothing can be written there"):
        plot_metrics(missing, blocker / "x.png")


def test_the_suffix_names_the_format(tmp_path):
    pytest.importorskip("matplotlib")
    metrics = _records(tmp_path / "m.jsonl")
    assert plot_metrics(metrics, tmp_path / "m.pdf").read_bytes()[:5] == b"%PDF-"
    assert b"<svg" in plot_metrics(metrics, tmp_path / "m.svg").read_bytes()[:500]
    assert plot_metrics(metrics, tmp_path / "m.PNG").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(PlotError, match=r"^picture .*m\.xyz: matplotlib cannot write \.xyz "
                                        r"files; end the name in one of .*\.pdf, .*\.png, "):
        plot_metrics(metrics, tmp_path / "m.xyz")
    assert not (tmp_path / "m.xyz").exists()


def test_a_cut_off_last_line_is_skipped_with_a_note(tmp_path, capsys):
    """A run stopped while writing leaves its last line without its end: the complete
    records are plotted, and one note says the last line was skipped. A bad line in the
    middle, or a complete bad last line, stays an error."""
    cut = _records(tmp_path / "cut.jsonl")
    cut.write_text(cut.read_text() + '{"step": 4, "lo')
    with pytest.warns(UserWarning, match=f"skipped {cut}:4, the last line, cut off before its "
                                         f"end .*; the 3 complete records before it"):
        assert [r["step"] for r in load_metrics(cut)] == [1, 2, 3]
    middle = tmp_path / "middle.jsonl"
    middle.write_text('{"step": 1, "loss": 4.0}\n{"step": 2, "lo\n{"step": 3, "loss": 3.0}')
    with pytest.raises(PlotError, match=r"middle.jsonl:2 is not a JSON line"):
        load_metrics(middle)
    pytest.importorskip("matplotlib")
    parser = argparse.ArgumentParser(prog="mpishard")
    add_plot_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plot", str(cut), "-o", str(tmp_path / "cut.png")])
    assert args.func(args) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"note: skipped {cut}:4, the last line, cut off before its end (as a stopped run "
        f"leaves it); the 3 complete records before it are plotted",
        f"wrote {tmp_path / 'cut.png'}"]


def test_a_folder_given_as_the_metrics_file(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(PlotError, match=f"^metrics file '{run}' is a folder; pass the file "
                                        f"that 'mpishard train --metrics FILE' wrote$"):
        load_metrics(run)
    _records(run / "metrics.jsonl")
    with pytest.raises(PlotError, match=f"is a folder; .* wrote, e.g. {run / 'metrics.jsonl'}$"):
        plot_metrics(run, tmp_path / "x.png")

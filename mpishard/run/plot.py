"""Pictures of a training run from its metrics file (``mpishard plot``).

    mpiexec -n 4 python -m mpi4py -m mpishard train --steps 200 --metrics runs/m.jsonl
    mpishard plot runs/m.jsonl -o runs/m.png

Three panels, read from the JSON lines ``mpishard train --metrics`` writes:

1. loss against step: training loss per step (faint) with a moving average,
   and the validation losses (start, every ``eval_interval``, end);
2. throughput: tokens (samples, for the MLP) per second per step, with a
   moving median, since single steps on a shared machine are noisy;
3. memory: each rank's peak bytes by ledger category (``params``, ``grads``,
   ``optim``, ``gathered``, ``comm``, ...) at the last step, stacked;
4. for a mixture of experts only: expert load per step (the fewest and most
   tokens an expert computed, summed over blocks and ranks) and the dropped
   fraction.

matplotlib is an optional extra (``pip install 'mpishard[plot]'``) and is
imported only when a plot is drawn. Drawing uses ``matplotlib.figure.Figure``
directly, never ``pyplot``, so no GUI backend or global figure state is involved.
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

from mpishard.core.backend import LEDGER_CATEGORIES
from mpishard.core.paths import why_unwritable
from mpishard.config.sections import ConfigError

__all__ = ["PlotError", "load_metrics", "metrics_figure", "plot_metrics", "add_plot_command"]

_CATEGORY_COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optim": "#55A868",
                    "gathered": "#8172B3", "comm": "#C44E52", "activations": "#937860",
                    "other": "#8C8C8C"}


class PlotError(ConfigError):
    """A metrics file that cannot be plotted, or matplotlib missing.

    A :class:`~mpishard.config.sections.ConfigError`, so ``mpishard`` prints it as one
    line and exits 2.
    """


class _SkippedLine(UserWarning):
    """A cut-off last line of a metrics file, skipped (``mpishard plot`` prints it as a
    note)."""


def load_metrics(metrics_path: str | Path) -> list[dict]:
    """The records of a JSON-lines metrics file, in file order.

    A last line cut off before its end (no line break after it, as a run stopped
    while writing leaves it) is skipped with a ``UserWarning`` saying so
    (``mpishard plot`` prints it as a note); every other line must be JSON.

    Raises:
        PlotError: the file is missing or a folder, a line is not JSON, or no line
            has a ``step``.
    """
    path = Path(metrics_path)
    if path.is_dir():
        inside = sorted(path.glob("*.jsonl"))
        hint = f", e.g. {inside[0]}" if inside else ""
        raise PlotError(f"metrics file {str(path)!r} is a folder; pass the file that "
                        f"'mpishard train --metrics FILE' wrote{hint}")
    if not path.is_file():
        raise PlotError(f"metrics file {str(path)!r} does not exist; write one with "
                        f"'mpishard train --metrics {path}'")
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines) and not text.endswith("\n"):     # cut off while written
                warnings.warn(f"skipped {path}:{number}, the last line, cut off before its "
                              f"end (as a stopped run leaves it); the {len(records)} "
                              f"complete records before it are plotted", _SkippedLine,
                              stacklevel=2)
                break
            raise PlotError(f"{path}:{number} is not a JSON line ({err.msg}); "
                            f"is this a metrics file from 'mpishard train --metrics'?") from None
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    if not records:
        raise PlotError(f"metrics file {str(path)!r} has no records with a 'step'; "
                        f"train for at least one step with --metrics")
    return records


def _matplotlib_figure():
    try:
        from matplotlib.figure import Figure  # noqa: PLC0415 (optional extra)
    except ImportError as err:
        raise PlotError(f"plotting needs matplotlib ({err}); "
                        f"pip install 'mpishard[plot]'") from None
    return Figure


def _moving(values: list, window: int, reduce) -> list:
    """``reduce`` over a trailing window (shorter at the start), NaNs ignored."""
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1): i + 1] if math.isfinite(v)]
        out.append(reduce(chunk) if chunk else math.nan)
    return out


def _mean(xs: list) -> float:
    return sum(xs) / len(xs)


def _median(xs: list) -> float:
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])


def _byte_unit(largest: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if largest >= scale:
            return float(scale), name
    return 1.0, "bytes"


def _si_formatter():
    from matplotlib.ticker import FuncFormatter  # noqa: PLC0415 (optional extra)

    def si(value, _pos):
        for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(value) >= scale:
                return f"{value / scale:g}{suffix}"
        return f"{value:g}"
    return FuncFormatter(si)


def _style(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=11, loc="left", fontweight="bold")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, color="#e5e5e5", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _draw_loss(ax, train: list, val: list) -> None:
    _style(ax, "Loss", "step", "cross-entropy (nats)")
    if train:
        steps, losses = zip(*train)
        window = max(1, len(losses) // 20)
        # faint when a moving average is drawn over it, plain when it is the only line
        ax.plot(steps, losses, color="#4C72B0", label="train (per step)",
                **({"alpha": 0.3, "linewidth": 0.9} if window > 1 else
                   {"linewidth": 1.6, "marker": ".", "markersize": 5}))
        if window > 1:
            ax.plot(steps, _moving(list(losses), window, _mean), color="#4C72B0",
                    linewidth=1.8, label=f"train ({window}-step mean)")
    if val:
        steps, losses = zip(*val)
        ax.plot(steps, losses, color="#DD8452", marker="o", markersize=4, linewidth=1.6,
                label=f"validation ({losses[0]:.3f} \u2192 {losses[-1]:.3f})")
    ax.legend(frameon=False, fontsize=8)


def _draw_throughput(ax, throughput: list) -> None:
    _style(ax, "Throughput", "step", "tokens / s")
    if not throughput:
        ax.text(0.5, 0.5, "no training steps", ha="center", va="center", transform=ax.transAxes)
        return
    steps, rates = zip(*throughput)
    window = max(1, min(25, len(rates) // 10))
    ax.plot(steps, rates, color="#55A868", label="per step",
            **({"alpha": 0.35, "linewidth": 0.9} if window > 1 else
               {"linewidth": 1.6, "marker": ".", "markersize": 5}))
    if window > 1:
        ax.plot(steps, _moving(list(rates), window, _median), color="#55A868", linewidth=1.8,
                label=f"{window}-step median")
    finite = [r for r in rates if math.isfinite(r)]
    if finite:
        typical = _median(finite)
        ax.axhline(typical, color="#333333", linewidth=0.8, linestyle="--",
                   label=f"median {typical:,.0f}")
        ax.set_ylim(0, max(finite) * 1.08)
    ax.yaxis.set_major_formatter(_si_formatter())
    ax.legend(frameon=False, fontsize=8)


def _draw_memory(ax, memory: list | None, step) -> None:
    _style(ax, "Memory per rank" + (f" (peak, step {step})" if memory else ""), "rank", "")
    if not memory:
        ax.text(0.5, 0.5, "no memory records", ha="center", va="center", transform=ax.transAxes)
        return
    present = {k for per_rank in memory for k, v in per_rank.items() if v}
    # stacked bottom to top in the ledger's order; unknown categories last
    categories = [c for c in LEDGER_CATEGORIES if c in present] + \
        sorted(present - set(LEDGER_CATEGORIES))
    largest = max(sum(per_rank.values()) for per_rank in memory)
    scale, unit = _byte_unit(largest)
    ax.set_ylabel(unit)
    ranks = list(range(len(memory)))
    bottoms = [0.0] * len(memory)
    for i, category in enumerate(categories):
        heights = [per_rank.get(category, 0) / scale for per_rank in memory]
        ax.bar(ranks, heights, bottom=bottoms, width=0.7, label=category,
               color=_CATEGORY_COLORS.get(category, f"C{i}"), edgecolor="white", linewidth=0.5)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for rank, total in zip(ranks, bottoms):
        ax.annotate(f"{total:.3g} {unit}", (rank, total), textcoords="offset points", xytext=(0, 2),
                    ha="center", fontsize=8)
    ax.set_xticks(ranks)
    ax.set_xlim(-0.6, len(memory) - 0.4)
    ax.set_ylim(0, max(bottoms) * 1.15 if max(bottoms) > 0 else 1)
    ax.grid(False, axis="x")
    # Legend outside the bars, top to bottom in stacking order (top category first).
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], frameon=False, fontsize=8,
              loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _draw_experts(ax, moe: list) -> None:
    _style(ax, "Expert load", "step", "tokens per expert")
    steps = [s for s, _ in moe]
    ax.fill_between(steps, [m["tokens_per_expert_min"] for _, m in moe],
                    [m["tokens_per_expert_max"] for _, m in moe], color="#4C72B0", alpha=0.3,
                    label="fewest .. most")
    ax.plot(steps, [m["tokens_per_expert_max"] for _, m in moe], color="#4C72B0", linewidth=1.0)
    dropped = ax.twinx()
    dropped.plot(steps, [m["dropped_fraction"] for _, m in moe], color="#C44E52",
                 linewidth=1.2, label="dropped fraction")
    dropped.set_ylim(0, 1)
    dropped.set_ylabel("dropped fraction", fontsize=9)
    lines = ax.get_legend_handles_labels()
    more = dropped.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], frameon=False, fontsize=8)


def metrics_figure(records: list[dict], title: str = ""):
    """A matplotlib ``Figure`` with the three panels for ``records`` (see :func:`load_metrics`).

    Raises:
        PlotError: no losses to plot, or matplotlib is not installed.
    """
    Figure = _matplotlib_figure()
    train = [(r["step"], r["loss"]) for r in records if isinstance(r.get("loss"), (int, float))]
    val = [(r["step"], r["val_loss"]) for r in records
           if isinstance(r.get("val_loss"), (int, float))]
    throughput = [(r["step"], r["tokens_per_s"]) for r in records
                  if isinstance(r.get("tokens_per_s"), (int, float))]
    with_memory = [r for r in records if r.get("memory")]
    last_memory = with_memory[-1] if with_memory else None
    if not train and not val:
        raise PlotError("the metrics have no 'loss' or 'val_loss' values to plot")
    moe = [(r["step"], r["moe"]) for r in records if isinstance(r.get("moe"), dict)]
    fig = Figure(figsize=(21 if moe else 16, 4.8), dpi=110, layout="constrained")
    if title:
        fig.suptitle(title, fontsize=12)
    axes = fig.subplots(1, 4 if moe else 3,
                        gridspec_kw={"width_ratios": [1.25, 1, 1] + ([1] if moe else [])})
    loss_ax, tput_ax, mem_ax = axes[:3]
    if moe:
        _draw_experts(axes[3], moe)
    _draw_loss(loss_ax, train, val)
    _draw_throughput(tput_ax, throughput)
    _draw_memory(mem_ax, last_memory["memory"] if last_memory else None,
                 last_memory["step"] if last_memory else None)
    return fig


def _picture_format(out: Path) -> str:
    """The format matplotlib writes ``out`` in, named by its suffix (png without one);
    a PlotError naming the suffixes it can write for any other."""
    from matplotlib.backend_bases import FigureCanvasBase  # noqa: PLC0415 (optional extra)
    suffix = out.suffix.lower().lstrip(".")
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise PlotError(f"picture {out}: matplotlib cannot write .{suffix} files; end the "
                        f"name in one of " + ", ".join(f".{f}" for f in sorted(formats)))
    return suffix or "png"


def plot_metrics(metrics_path: str | Path, out_png: str | Path, title: str | None = None) -> Path:
    """Draw loss, throughput and per-rank memory from a metrics file into a picture.

    Args:
        metrics_path: JSON-lines file written by ``mpishard train --metrics``.
        out_png: where to write the picture (parent folders are created); its suffix
            names the format (``.png``, ``.pdf``, ``.svg``, ... as matplotlib writes
            them; PNG without a suffix).
        title: figure title (default: the metrics file's name, steps and ranks).

    Returns:
        The path of the picture.

    Raises:
        PlotError: a picture path that is a folder, lies under a file or has a suffix
            matplotlib cannot write (checked before the metrics are read), unreadable
            metrics, or matplotlib is not installed.
    """
    out = Path(out_png)
    why = why_unwritable(out, folder=False, example=Path(metrics_path).with_suffix(".png").name)
    if why is not None:
        raise PlotError(f"picture {out} {why}")
    records = load_metrics(metrics_path)
    _matplotlib_figure()           # refuses first when matplotlib is missing
    fmt = _picture_format(out)
    if title is None:
        ranks = max((len(r["memory"]) for r in records if r.get("memory")), default=0)
        title = f"{Path(metrics_path).name}: {max(r['step'] for r in records)} steps" + \
            (f", {ranks} ranks" if ranks else "")
    fig = metrics_figure(records, title)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(out, format=fmt, facecolor="white")
    except OSError as err:
        raise PlotError(f"picture {out} cannot be written ({err.strerror or err}); pass "
                        f"another path") from None
    except Exception as err:   # e.g. .pgf, which needs a LaTeX installation
        out.unlink(missing_ok=True)
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PlotError(f"matplotlib could not write {out} as .{fmt} ({reason}); write a "
                        f".png, .pdf or .svg instead") from None
    return out


def add_plot_command(subparsers) -> None:
    """Register ``mpishard plot METRICS -o PICTURE`` on an argparse subparsers object."""
    plot = subparsers.add_parser(
        "plot", help="draw loss, throughput and per-rank memory from a metrics file",
        description="Draw three panels from the JSON lines 'mpishard train --metrics FILE' "
                    "wrote: loss (train and validation) against step, throughput in "
                    "tokens/s, and each rank's peak memory by category. Needs matplotlib "
                    "(pip install 'mpishard[plot]').")
    plot.add_argument("metrics", metavar="METRICS", help="metrics file (JSON lines)")
    plot.add_argument("-o", "--output", metavar="PICTURE", default=None,
                      help="picture to write; its suffix names the format: .png, .pdf, "
                           ".svg, ... (default: METRICS with .png)")
    plot.add_argument("--title", default=None, help="figure title")
    plot.set_defaults(func=_cmd_plot)


def _cmd_plot(args) -> int:
    output = args.output or str(Path(args.metrics).with_suffix(".png"))
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always")
        written = plot_metrics(args.metrics, output, title=args.title)
    for note in notes:
        if issubclass(note.category, _SkippedLine):
            print(f"note: {note.message}")
        else:               # another library's warning, shown as it would have been
            warnings.showwarning(note.message, note.category, note.filename, note.lineno)
    print(f"wrote {written}")
    return 0

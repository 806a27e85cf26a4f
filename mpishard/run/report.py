"""What ``mpishard train`` tells the user: the plan, progress, the metrics file.

Kept apart from the loop (mpishard/run/train.py) so the loop reads as its steps.
Everything here prints on rank 0 only (through :class:`~mpishard.run.log.RankLogger`)
or writes on rank 0 only; the collectives it needs run on every rank.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from mpishard.core.backend import to_numpy
from mpishard.comm import format_rank_reports, rank_report

__all__ = ["rewind_metrics", "metric_records", "describe_plan", "expert_load", "mesh_text",
           "format_groups", "thread_warning", "progress_bar",
           "Progress", "MetricsFile"]


def describe_plan(trainer) -> str:
    """The run's layout, data, batch, memory plan and where each rank runs (collective)."""
    cfg, mesh, world = trainer.cfg, trainer.mesh, trainer.world
    reports = world.gather_obj(rank_report(world, trainer.backend))
    groups = world.gather_obj(mesh.group_members())
    p, o = cfg.parallel, cfg.optim
    lines = [f"mpishard train: {cfg.model.name}, strategy {p.strategy}, world {world.size} "
             f"= mesh {mesh_text(mesh)}",
             *(format_groups(groups) if groups is not None else []),
             f"data: {trainer.data_desc}",
             f"batch: {o.batch_size} per dp rank x {o.micro_steps} micro-steps x "
             f"{mesh.dp.size} dp ranks, {o.steps} steps, {cfg.model.dtype}"
             + (f", computing in {p.precision}" if p.precision != "float32" else "")
             + ({"full": ", activation checkpointing",
                 "selective": ", selective recomputation",
                 "op": ", recomputation by op"}.get(cfg.model.activation_checkpointing, ""))
             + (f", context parallel {p.cp_mode}" if mesh.cp.size > 1 else "")
             + (", sequence parallel" if p.sequence_parallel and mesh.tp.size > 1 else ""),
             trainer.plan.format()]
    if p.offload != "none":       # the plan above puts them there (its host rows)
        lines.append(f"offload: {cfg.model.dtype} masters and optimizer state in host "
                     f"memory, updated there" + (", parameter shards too, copied in for each gather"
                                if p.offload == "params" else "")
                     + " (the plan's host rows; its device rows and the budget leave them out)")
    budget = cfg.run.memory_budget
    if budget:
        verdict = "fits" if trainer.plan.total_peak_bytes <= budget else "does not fit"
        lines.append(f"  budget    {budget / 2**20:10.2f} MiB per rank: {verdict}")
    if reports is not None:
        cpu_only = all(r["device"].endswith("/cpu") for r in reports)   # Backend.describe()
        lines.append(format_rank_reports(reports, gpu_lines=not cpu_only))
        lines.extend(thread_warning(reports))
    return "\n".join(lines)


def expert_load(module, group) -> dict:
    """``{"moe": ...}`` for a model with mixture-of-experts blocks, else ``{}``: the last
    micro-batch's routed tokens per expert (summed over blocks and over ``group``, the
    ranks holding the same parameters): min, max and coefficient of variation, the
    dropped fraction, and the load-balancing loss (mean over ``group``). Collective."""
    routes = [m.route for _, m in module.named_modules()
              if getattr(m, "route", None) is not None and hasattr(m, "experts")]
    if not routes:
        return {}
    counts = sum(r.counts.astype(np.float64) for r in routes)
    kept = sum(r.kept.astype(np.float64) for r in routes)
    rows = sum(r.rows for r in routes)
    prob = sum(to_numpy(r.prob_sum.data).astype(np.float64) for r in routes)
    aux = len(counts) * float(np.sum(counts / rows * prob / rows))
    buf = np.concatenate([counts, kept, [aux]])
    group.all_reduce(buf, op="sum")
    counts, kept, aux = buf[:len(counts)], buf[len(counts):-1], buf[-1] / group.size
    mean = float(kept.mean())
    return {"moe": {"tokens_per_expert_min": int(kept.min()),
                    "tokens_per_expert_max": int(kept.max()),
                    "tokens_per_expert_cv": float(kept.std() / mean) if mean else 0.0,
                    "dropped_fraction": float(1.0 - kept.sum() / counts.sum()),
                    "aux_loss": aux}}


def mesh_text(mesh) -> str:
    """``pp=1 x dp_replicate=1 x dp_shard=2 x cp=2 x tp=1`` (dp = dp_replicate x dp_shard)."""
    s = mesh.shape
    axes = " x ".join(f"{a}={s[a]}" for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    if s.get("ep", 1) > 1:
        axes += f", ep={s['ep']} (experts, from dp_shard x cp)"
    return f"{axes} (dp={s['dp']})"


def format_groups(per_rank: list) -> list:
    """One line per mesh group: its name and every group's world ranks, from each rank's
    ``{name: members}``."""
    names: dict = {}
    for groups in per_rank:
        for name, members in groups.items():
            names.setdefault(name, dict.fromkeys([]))[members] = None
    return [f"  {name:<12} " + " ".join("[" + " ".join(map(str, m)) + "]" for m in found)
            for name, found in names.items()]


def thread_warning(reports: list, environ=None, cores: int | None = None) -> list:
    """A warning when the ranks on one node times their BLAS threads exceed its cores.

    A BLAS without ``OMP_NUM_THREADS``/``OPENBLAS_NUM_THREADS`` starts one thread
    per core in every rank. More ranks than cores at one thread each is left
    alone: that is a deliberate choice (tests, small demos), not a setting to fix.
    """
    environ = os.environ if environ is None else environ
    per_host: dict = {}
    for r in reports:
        per_host[r["host"]] = per_host.get(r["host"], 0) + 1
    ranks = max(per_host.values())
    cores = cores or os.cpu_count() or 1
    setting = environ.get("OPENBLAS_NUM_THREADS") or environ.get("OMP_NUM_THREADS")
    try:
        threads = int(setting) if setting else cores
    except ValueError:
        threads = cores
    if threads <= 1 or ranks * threads <= cores:
        return []
    why = (f"OMP_NUM_THREADS/OPENBLAS_NUM_THREADS={setting}" if setting else
           "OMP_NUM_THREADS/OPENBLAS_NUM_THREADS are unset, so each rank's BLAS may start "
           f"{cores} threads")
    return [f"warning: {ranks} ranks share a node with {cores} cores and {why}: "
            f"{ranks} x {threads} threads > {cores} cores; export "
            f"OMP_NUM_THREADS={max(1, cores // ranks)} (cores // ranks) before launching"]


class Progress:
    """A progress bar on rank 0 (tqdm), or a plain line every tenth of the run."""

    def __init__(self, total: int, bar):
        self.total, self.bar = total, bar

    def line(self, text: str, log) -> None:
        """A line of its own (a validation loss): above the bar, or plainly logged."""
        if self.bar is not None:
            self.bar.write(text)
            log.own(text)
        else:
            log.info(text)

    def report(self, record: dict, log) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}",
                                 tok_s=f"{record['tokens_per_s']:.0f}")
            self.bar.update(1)
        elif record["step"] % max(1, self.total // 10) == 0:
            log.info(f"step {record['step']}/{self.total}: loss {record['loss']:.4f}, "
                     f"{record['tokens_per_s']:.0f} tokens/s")

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


def progress_bar(cfg, rank: int, start: int = 0) -> Progress:
    """:class:`Progress` for this run: a tqdm bar on rank 0 when asked for and installed."""
    bar = None
    if cfg.run.progress and rank == 0:
        try:
            from tqdm import tqdm  # noqa: PLC0415
        except ImportError:
            tqdm = None
        if tqdm is not None:
            bar = tqdm(total=cfg.optim.steps, initial=start, desc="train", unit="step",
                       mininterval=0.5)
    return Progress(cfg.optim.steps, bar)


class MetricsFile:
    """One JSON line per record, written by rank 0; ``active`` on every rank alike.

    A new run starts its file afresh (keeping it when it holds only events, records
    without a ``"step"``: a supervisor's restarts before the first checkpoint). A run
    resumed at step ``resumed_at`` continues it from that step: the records of the
    earlier run's steps after the checkpoint (which the resumed run trains again),
    its validation records from that step on, and a line a kill cut short are
    dropped first (:func:`rewind_metrics`), so the file holds each step's training
    record once; events stay.
    """

    def __init__(self, path: str, world, resumed_at: int | None = None):
        self.active = bool(path)
        self._file = None
        if self.active and world.rank == 0:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            if resumed_at is not None:
                rewind_metrics(Path(path), resumed_at)
            fresh = resumed_at is None and metric_records(Path(path)) > 0
            self._file = open(path, "w" if fresh else "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _parsed(path: Path) -> list:
    """``(line, record)`` for each line of ``path`` (``record`` None where it does not
    parse as a JSON object: a line a kill cut short)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (FileNotFoundError, UnicodeDecodeError):
        return []
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        out.append((line, record if isinstance(record, dict) else None))
    return out


def metric_records(path: Path) -> int:
    """How many lines of ``path`` are an earlier run's: all but blank ones and events
    (records without a ``"step"``)."""
    return sum(1 for line, record in _parsed(Path(path))
               if line.strip() and (record is None or "step" in record))


def rewind_metrics(path: Path, step: int) -> None:
    """Keep the records of ``path`` before ``step``, the training record of ``step``, and
    the events (records without a ``"step"``), in order; replaced atomically."""
    path = Path(path)
    lines = _parsed(path)
    kept = []
    for line, record in lines:
        try:
            at = None if record is None or "step" not in record else int(record["step"])
        except (ValueError, TypeError):
            continue
        if record is None:
            continue                        # cut short by a kill
        if at is None or at < step or (at == step and "loss" in record):
            kept.append(line + "\n")
    if len(kept) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)

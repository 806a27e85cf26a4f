"""The training loop behind ``mpishard train`` (and ``make demo``).

    mpiexec -n 4 python -m mpi4py -m mpishard train --config examples/configs/demo.toml

Builds the mesh, the backend, the data, the model and the strategy from a
:class:`~mpishard.config.TrainConfig`, prints the plan, then trains: one
progress bar and log on rank 0, a JSON line of metrics per step, a validation
loss at the start, every ``eval_interval`` steps and at the end.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .autodiff.tensor import no_grad
from .backend import Backend
from .checkpoint import (CheckpointError, StopSignals, load_checkpoint, load_module_rng_states,
                         module_rng_states, save_checkpoint)
from .comm import Communicator, Mesh, node_local_rank
from .config import ConfigError, TrainConfig
from .data import VOCAB_SIZE, ArraySampler, BatchSampler, DataError, load_corpus, load_digits
from .log import RankLogger
from .models import GPT, GPTConfig, MLPClassifier
from .optim import AdamW, CosineSchedule
from .parallel import ParallelModel, build_stage, plan_memory, wrap_model

__all__ = ["gpt_config", "build_model", "MLPRun", "Trainer", "run"]


def gpt_config(cfg: TrainConfig) -> GPTConfig:
    """The byte-level GPT a training config describes."""
    return GPTConfig(vocab_size=VOCAB_SIZE, block_size=cfg.block_size, n_layer=cfg.n_layer,
                     n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias)


def build_model(cfg: TrainConfig, backend: Backend, materialize_now: bool = True):
    """The whole model a config describes (GPT on bytes, or the digits MLP)."""
    if cfg.model == "gpt":
        return GPT(gpt_config(cfg), seed=cfg.seed, dtype=cfg.dtype, backend=backend,
                   materialize_now=materialize_now)
    return MLPClassifier(64, cfg.hidden_sizes(), 10, seed=cfg.seed, dtype=cfg.dtype,
                         backend=backend, materialize_now=materialize_now)


class MLPRun:
    """The MLP counterpart of :class:`~mpishard.parallel.ParallelGPT` (dp only)."""

    def __init__(self, cfg: TrainConfig, mesh: Mesh, backend: Backend):
        self.strategy = wrap_model(build_model(cfg, backend, materialize_now=False), mesh,
                                   cfg.strategy, precision=cfg.precision)
        self.micro = cfg.micro_steps
        self.ledger = self.strategy.ledger

    def parameters(self) -> list:
        return self.strategy.parameters()

    def train_step(self, x, y) -> float:
        b, total = len(x) // self.micro, 0.0
        for ctx, i in zip(self.strategy.accumulation(self.micro), range(self.micro)):
            with ctx:
                _, loss = self.strategy(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b])
                (self.strategy.scale_loss(loss) * (1.0 / self.micro)).backward()
                total += loss.item() / self.micro
        return total

    def eval_step(self, x, y) -> float:
        self.strategy.eval()
        with no_grad():
            loss = self.strategy(x, y)[1].item()
        self.strategy.train()
        return loss

    def step(self, optimizer, max_norm=None):
        return self.strategy.step(optimizer, max_norm)


class Trainer:
    """Owns the objects of one run; :meth:`fit` trains, :meth:`evaluate` measures."""

    def __init__(self, cfg: TrainConfig, world: Communicator):
        self.cfg, self.world = cfg, world
        self.log = RankLogger(world.rank, cfg.log_dir or None)
        if cfg.model == "mlp" and (cfg.tp != 1 or cfg.pp != 1):
            raise ConfigError(f"tp={cfg.tp}, pp={cfg.pp}: the MLP trains with data "
                              f"parallelism only; use tp=1 pp=1 (tensor and pipeline "
                              f"parallelism are for the GPT)")
        _agree(world, self._load_data)          # local work first, then agree on errors
        dp = cfg.dp or world.size // (cfg.tp * cfg.pp)
        try:
            self.mesh = Mesh(world, dp=dp, tp=cfg.tp, pp=cfg.pp)
        except ValueError as err:  # raised alike on every rank, before communicating
            raise ConfigError(str(err)) from None
        self.backend = Backend.resolve(cfg.backend, local_rank=node_local_rank(world),
                                       memory_budget=cfg.memory_budget or None)
        self._build_samplers()
        try:
            shapes_only = build_stage(build_model(cfg, Backend(), False), self.mesh) \
                if cfg.model == "gpt" else \
                build_model(cfg, Backend(), materialize_now=False)
        except ValueError as err:   # pp larger than n_layer, tp larger than n_head, ...
            raise ConfigError(str(err)) from None
        self.plan = plan_memory(shapes_only, cfg.strategy, self.mesh.dp.size,
                                precision=cfg.precision)

    def _load_data(self) -> None:
        cfg = self.cfg
        if cfg.model == "gpt":
            corpus = load_corpus(cfg.data or None, cfg.max_bytes, min_bytes=cfg.block_size + 1)
            self.data_desc = f"{corpus.source}: {corpus.train.size:,} train / " \
                             f"{corpus.val.size:,} val bytes from {corpus.n_files} files"
            self.train_data, self.val = corpus.train, corpus.val
            self.tokens_per_sample = cfg.block_size
        else:
            x, y, xv, yv = load_digits(cfg.seed)
            self.data_desc = f"digits: {len(y)} train / {len(yv)} val samples"
            self.train_data, self.val = (x, y), (xv, yv)
            self.tokens_per_sample = 1

    def _build_samplers(self) -> None:
        cfg, mesh = self.cfg, self.mesh
        make = (lambda: BatchSampler(self.train_data, cfg.block_size, cfg.batch_size,
                                     mesh.dp_rank, mesh.dp.size, cfg.seed)) \
            if cfg.model == "gpt" else \
            (lambda: ArraySampler(*self.train_data, cfg.batch_size, mesh.dp_rank,
                                  mesh.dp.size, cfg.seed))
        self.sampler = make()

    # -- set-up --------------------------------------------------------------
    def describe_plan(self) -> str:
        cfg, mesh = self.cfg, self.mesh
        from .comm import format_rank_reports, rank_report  # noqa: PLC0415

        reports = self.world.gather_obj(rank_report(self.world, self.backend))
        lines = [f"mpishard train: {cfg.model}, strategy {cfg.strategy}, world {self.world.size} "
                 f"= mesh dp={mesh.dp.size} x tp={mesh.tp.size} x pp={mesh.pp.size}",
                 f"data: {self.data_desc}",
                 f"batch: {cfg.batch_size} per dp rank x {cfg.micro_steps} micro-steps x "
                 f"{mesh.dp.size} dp ranks, {cfg.steps} steps, {cfg.dtype}"
                 + (f", computing in {cfg.precision}" if cfg.precision != "float32" else "")
                 + (", activation checkpointing" if cfg.activation_checkpointing else ""),
                 self.plan.format()]
        if cfg.memory_budget:
            verdict = "fits" if self.plan.total_peak_bytes <= cfg.memory_budget else "DOES NOT FIT"
            lines.append(f"  budget    {cfg.memory_budget / 2**20:10.2f} MiB per rank: {verdict}")
        if reports is not None:
            lines.append(format_rank_reports(reports))
            lines.extend(_thread_warning(reports))
        return "\n".join(lines)

    def build(self) -> None:
        cfg = self.cfg
        if cfg.model == "gpt":
            self.run = ParallelModel(build_model(cfg, self.backend, False), self.mesh,
                                     cfg.strategy, micro_batches=cfg.micro_steps,
                                     schedule=cfg.schedule, precision=cfg.precision)
            if cfg.activation_checkpointing:
                self.run.module.set_activation_checkpointing(True)
        else:
            self.run = MLPRun(cfg, self.mesh, self.backend)
        self.model = self.run.strategy
        self.opt = AdamW(self.run.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                         weight_decay=cfg.weight_decay, ledger=self.run.ledger)
        self.opt.allocate_state()
        self.schedule = CosineSchedule(cfg.lr, min(cfg.warmup_steps, cfg.steps), cfg.steps,
                                       cfg.min_lr)
        self.step = 0
        if cfg.checkpoint_dir and cfg.resume:
            self._resume()
        self._first_step = self.step  # its activations are measured (GPT)

    # -- checkpoints -------------------------------------------------------------
    def _resume(self) -> None:
        """Continue from the newest complete checkpoint in ``checkpoint_dir`` (any layout)."""
        cfg = self.cfg
        try:
            extra = load_checkpoint(cfg.checkpoint_dir, self.model, self.opt, world=self.world)
        except CheckpointError as err:           # raised identically on every rank
            if err.rule == "no-checkpoint":
                raise CheckpointError(
                    cfg.checkpoint_dir, "no-checkpoint", "--resume found no complete "
                    "checkpoint here; leave out --resume to start a new run") from None
            raise
        self.step = int(extra["step"])
        self.sampler.load_state_dict(extra["data"])
        load_module_rng_states(self.model.module, extra["rng"])
        self.log.info(f"resumed from step {self.step} ({cfg.checkpoint_dir})")

    def save(self):
        """Checkpoint parameters, optimizer state, data position and RNG (collective)."""
        extra = {"step": self.step, "data": self.sampler.state_dict(),
                 "rng": module_rng_states(self.model.module, self.world),
                 "config": asdict(self.cfg)}
        return save_checkpoint(self.cfg.checkpoint_dir, self.step, self.model, self.opt,
                               world=self.world, extra_state=extra, keep_last=self.cfg.keep_last)

    # -- evaluation ------------------------------------------------------------
    def _batch(self, sampler) -> tuple:
        """One step's batch for this dp rank: ``micro_steps`` sampler batches together."""
        parts = [sampler.next_batch() for _ in range(self.cfg.micro_steps)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def evaluate(self) -> float:
        """Mean validation loss over fixed batches, averaged over dp ranks."""
        cfg = self.cfg
        if cfg.model == "gpt":
            sampler = BatchSampler(self.val, cfg.block_size, cfg.batch_size,
                                   self.mesh.dp_rank, self.mesh.dp.size, seed=12345)
            total = sum(self.run.eval_step(*self._batch(sampler))
                        for _ in range(cfg.eval_batches)) / cfg.eval_batches
        else:
            total = self.run.eval_step(*self.val)
        buf = np.array([total])
        self.mesh.dp.all_reduce(buf, op="avg")
        return float(buf[0])

    # -- training --------------------------------------------------------------
    def _axes(self) -> dict:
        return {name: self.mesh.axis(name) for name in ("dp", "tp", "pp")
                if self.mesh.axis(name).size > 1}

    def train_step(self) -> dict:
        cfg = self.cfg
        self.opt.lr = self.schedule(self.step)
        for comm in self._axes().values():
            comm.stats.reset()
        pipeline = getattr(self.run, "pipeline", None)
        measure = pipeline is not None and self.step == self._first_step  # see pipeline.py
        if measure:
            pipeline.measure_activations = True
        t0 = time.perf_counter()
        loss = self.run.train_step(*self._batch(self.sampler))
        if measure:
            pipeline.measure_activations = False
            most = self.world.all_reduce_obj(pipeline.activation_bytes, op="max")
            self.log.info(f"activations kept for backward: {most / 2**20:.2f} MiB on the "
                          f"busiest rank (measured on step {self.step + 1}"
                          f"{', checkpointed' if cfg.activation_checkpointing else ''})")
        result = self.run.step(self.opt, max_norm=cfg.grad_clip or None)
        buf = np.array([loss])
        self.mesh.dp.all_reduce(buf, op="avg")
        seconds = time.perf_counter() - t0
        self.step += 1
        samples = cfg.batch_size * cfg.micro_steps * self.mesh.dp.size
        return {"step": self.step, "loss": float(buf[0]), "lr": self.opt.lr,
                "grad_norm": result.grad_norm, "skipped": result.skipped,
                "loss_scale": self.model.scaler.scale,
                "step_s": seconds, "tokens_per_s": samples * self.tokens_per_sample / seconds}

    def _memory_and_comm(self) -> dict:
        memory = self.world.gather_obj(self.model.ledger.peak_by_category())
        return {"memory": memory,
                "comm": {axis: comm.stats.snapshot() for axis, comm in self._axes().items()}}

    def fit(self) -> dict:
        cfg, log = self.cfg, self.log
        metrics_file = None
        if cfg.metrics and self.world.rank == 0:
            Path(cfg.metrics).parent.mkdir(parents=True, exist_ok=True)
            # a resumed run continues its metrics; a new run starts them afresh
            metrics_file = open(cfg.metrics, "a" if self.step else "w", encoding="utf-8")
        first_val = self.evaluate()
        log.info(f"step {self.step}: val loss {first_val:.4f}")
        if metrics_file:
            metrics_file.write(json.dumps({"step": self.step, "val_loss": first_val}) + "\n")
        bar = _progress(cfg, self.world.rank, self.step)
        record, stopped = {}, False
        with StopSignals() as stop:
            while self.step < cfg.steps:
                record = self.train_step()
                if cfg.metrics:     # a collective (gather to rank 0): only when it is written
                    record.update(self._memory_and_comm())
                if cfg.eval_interval and self.step % cfg.eval_interval == 0 \
                        and self.step < cfg.steps:
                    record["val_loss"] = self.evaluate()
                stopped = stop.should_stop(self.world)           # collective, every step
                if cfg.checkpoint_dir and (stopped or self.step == cfg.steps or (
                        cfg.checkpoint_interval and self.step % cfg.checkpoint_interval == 0)):
                    record["checkpoint"] = str(self.save())
                if metrics_file:
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()
                if bar is not None:
                    bar.set_postfix(loss=f"{record['loss']:.3f}",
                                    tok_s=f"{record['tokens_per_s']:.0f}")
                    bar.update(1)
                if stopped:
                    log.info(f"step {self.step}: {stop.received or 'signal on another rank'}; "
                             f"checkpoint saved, stopping" if cfg.checkpoint_dir else
                             f"step {self.step}: {stop.received or 'signal'}; stopping "
                             f"(no --checkpoint-dir, nothing saved)")
                    break
                if not math.isfinite(record["loss"]):
                    log.info(f"step {self.step}: loss is not finite; stopping")
                    break
                if bar is None and (self.step % max(1, cfg.steps // 10) == 0):
                    log.info(f"step {self.step}/{cfg.steps}: loss {record['loss']:.4f}, "
                             f"{record['tokens_per_s']:.0f} tokens/s")
        if bar is not None:
            bar.close()
        last_val = first_val if stopped else self.evaluate()
        if metrics_file:
            if not stopped:
                metrics_file.write(json.dumps({"step": self.step, "val_loss": last_val}) + "\n")
            metrics_file.close()
        return {"val_loss_start": first_val, "val_loss_end": last_val,
                "train_loss_end": record.get("loss"), "steps": self.step, "stopped": stopped,
                "skipped_steps": self.model.skipped_steps}

    def sample(self, prompt: str, n_tokens: int, seed: int = 0) -> str:
        """Generate text on every rank in lockstep (ZeRO gathers collectively)."""
        idx = np.frombuffer(prompt.encode("utf-8"), dtype=np.uint8).astype(np.int64)[None, :]
        out = self.model.module.generate(idx, n_tokens, temperature=0.8, top_k=40,
                                         rng=np.random.default_rng(seed))
        return bytes(out[0].astype(np.uint8).tolist()).decode("utf-8", errors="replace")


def _thread_warning(reports: list) -> list:
    """A warning when ranks x BLAS threads oversubscribe a node's cores."""
    per_host: dict = {}
    for r in reports:
        per_host[r["host"]] = per_host.get(r["host"], 0) + 1
    ranks = max(per_host.values())
    cores = os.cpu_count() or 1
    threads = os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if threads is None and ranks > 1 and ranks * cores > cores:
        return [f"warning: {ranks} ranks share a node with {cores} cores and "
                f"OMP_NUM_THREADS/OPENBLAS_NUM_THREADS are unset, so each rank's BLAS may "
                f"start {cores} threads; export OMP_NUM_THREADS=1 (or cores // ranks) "
                f"before launching"]
    return []


def _agree(world: Communicator, local_work) -> None:
    """Run ``local_work`` (no communication inside) on every rank, then agree on errors.

    If it raised a ConfigError or DataError on any rank, the same error is
    raised on every rank (naming the rank when not all failed), so the job
    exits cleanly everywhere instead of hanging in the next collective.
    """
    error = None
    try:
        local_work()
    except (ConfigError, DataError) as err:
        error = err
    messages = world.all_gather_obj(None if error is None else (type(error).__name__, str(error)))
    failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
    if not failed:
        return
    rank, (kind, text) = failed[0]
    if len(failed) < world.size:
        text = f"on rank {rank}: {text}"
    raise (DataError if kind == "DataError" else ConfigError)(text)


def _progress(cfg: TrainConfig, rank: int, start: int = 0):
    if not cfg.progress or rank != 0:
        return None
    try:
        from tqdm import tqdm  # noqa: PLC0415
    except ImportError:
        return None
    return tqdm(total=cfg.steps, initial=start, desc="train", unit="step", mininterval=0.5)


def run(cfg: TrainConfig, world: Communicator) -> dict:
    """Plan, build, train, report. Returns the summary dict (on every rank)."""
    trainer = Trainer(cfg, world)
    trainer.log.info(trainer.describe_plan())
    if cfg.dry_run:
        return {"dry_run": True, "plan": asdict(trainer.plan)}
    trainer.build()
    summary = trainer.fit()
    if summary["stopped"]:
        trainer.log.close()
        return summary
    if cfg.sample_tokens and cfg.model == "gpt" and (cfg.tp > 1 or cfg.pp > 1):
        trainer.log.info("sample skipped: sampling during training needs tp=1 pp=1 "
                         "(mpishard sample works on a checkpoint of any layout)")
    elif cfg.sample_tokens and cfg.model == "gpt":
        text = trainer.sample(cfg.sample_prompt, cfg.sample_tokens, cfg.seed)
        trainer.log.info("sample:\n" + text)
    trainer.log.info(f"val loss {summary['val_loss_start']:.4f} -> {summary['val_loss_end']:.4f} "
                     f"after {summary['steps']} steps ({cfg.strategy}, "
                     f"{world.size} ranks)")
    trainer.log.close()
    return summary

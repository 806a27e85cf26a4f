"""The training loop behind ``mpishard train`` (and ``make demo``).

    mpiexec -n 4 python -m mpi4py -m mpishard train --config examples/configs/demo.toml

Builds the mesh, the backend, the data (through the model's recipe, see
[Note: recipes]), the model and the strategy from a
:class:`~mpishard.config.sections.TrainConfig`, prints the plan, then trains: one
progress bar and log on rank 0, a JSON line of metrics per step, a validation
loss at the start, every ``eval_interval`` steps and at the end. What the loop
reports and how it is set up lives in :mod:`mpishard.run.report`.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from mpishard.core.agree import agree, rebuild_same_type
from mpishard.core.backend import Backend
from mpishard.core.parse import format_bytes
from mpishard.checkpoint import (INTERRUPT_TOO, BackgroundSaver, CheckpointError, StopSignals,
                                 load_checkpoint, load_module_rng_states, load_newest_valid,
                                 module_rng_states, save_checkpoint)
from mpishard.checkpoint.format import step_dir_name
from mpishard.comm import Communicator, Mesh, node_local_rank
from mpishard.config.sections import ConfigError, TrainConfig
from mpishard.config.support import check_supported
from mpishard.data.corpus import DataError
from mpishard.kernels import check_settings as check_kernel_settings
from mpishard.run.log import RankLogger
from mpishard.optim import SGD, Adam, AdamW, CosineSchedule
from mpishard.parallel import ParallelModel
from mpishard.parallel.strategy import Sharded, strategy_entry
from mpishard.planning.layout import Layout, estimate_layout
from mpishard.run.preflight import check_run_files, chosen_checkpoint
from mpishard.recipes import recipe_for
from mpishard.run.report import MetricsFile, describe_plan, expert_load, progress_bar

__all__ = ["Trainer", "run", "make_optimizer"]

_CHECKPOINTED = {"none": "", "full": ", checkpointed", "selective": ", attention recomputed",
                 "op": ", recomputed by op"}


def make_optimizer(name: str, params, cfg, ledger):
    """The optimizer ``name`` (``adamw``, ``adam``, ``sgd``, ``sgd-momentum``) with the
    config's settings."""
    o = cfg.optim
    if name.startswith("sgd"):
        return SGD(params, lr=o.lr, momentum=0.9 if name == "sgd-momentum" else 0.0,
                   weight_decay=o.weight_decay, ledger=ledger)
    cls = {"adamw": AdamW, "adam": Adam}[name]
    return cls(params, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay,
               ledger=ledger)


class Trainer:
    """Owns the objects of one run; :meth:`fit` trains, :meth:`evaluate` measures."""

    def __init__(self, cfg: TrainConfig, world: Communicator):
        self.cfg, self.world = cfg, world
        self.notes = check_run_files(cfg, world)    # see [Note: run safety]; paths first
        self.log = RankLogger(world.rank, cfg.run.log_dir or None)
        agreed(world, _kernel_settings)              # MPISHARD_KERNELS, _ATTENTION, _BLAS
        self.recipe = recipe_for(cfg)
        self.data_desc = agreed(world, self.recipe.load_data)   # local work, then agree
        if cfg.run.sample_tokens and self.recipe.can_sample:   # a prompt it cannot read
            agreed(world, lambda: self.recipe.prompt_ids(cfg.run.sample_prompt,
                                                         "--sample-prompt"))
        p = cfg.parallel
        try:
            self.mesh = Mesh(world, dp=p.dp or None, tp=p.tp, pp=p.pp, cp=p.cp,
                             dp_replicate=p.dp_replicate, dp_shard=p.dp_shard or None,
                             ep=p.ep)
        except ValueError as err:  # raised alike on every rank, before communicating
            raise ConfigError(str(err)) from None
        resolve_global_batch(cfg, self.mesh.dp.size)
        check_supported(cfg, resolved=True)    # again after --layout auto, with the
        # micro-steps a global batch gives (config/support.py)
        local_rank = node_local_rank(world)
        self.backend = agreed(world, lambda: Backend.resolve(
            cfg.run.backend, local_rank=local_rank, memory_budget=cfg.run.memory_budget or None))
        self.sampler = self.recipe.train_sampler(self.mesh.dp_rank, self.mesh.dp.size)
        self.plan = agreed(world, lambda: estimate_layout(self.recipe.model(self.backend),
                                                      layout_of(cfg, self.mesh.dp.size,
                                                                self.recipe)))

    def build(self) -> None:
        """The model on this rank's part of the mesh, its optimizer, and a resume."""
        cfg = self.cfg
        self.run = ParallelModel(self.recipe.model(self.backend), self.mesh,
                                 cfg.parallel.strategy, micro_batches=cfg.optim.micro_steps,
                                 schedule=cfg.parallel.pipeline_schedule,
                                 virtual_stages=cfg.parallel.virtual_stages,
                                 precision=cfg.parallel.policy,
                                 offload=cfg.parallel.offload,
                                 cp_mode=cfg.parallel.cp_mode,
                                 sequence_parallel=cfg.parallel.sequence_parallel)
        if cfg.model.activation_checkpointing != "none":
            self.run.module.set_activation_checkpointing(cfg.model.activation_checkpointing)
        self.strategy = self.run.strategy
        if cfg.run.init_from and not cfg.run.resume:  # a resume has trained weights already
            from mpishard.hf import load_pretrained  # noqa: PLC0415 (only runs that start from weights)
            load_pretrained(self.strategy, cfg.run.init_from, world=self.world)
        self.opt = make_optimizer(cfg.optim.optimizer, self.run.parameters(), cfg,
                                  self.run.ledger)
        self.opt.allocate_state()
        self.lr_schedule = CosineSchedule(cfg.optim.lr, min(cfg.optim.warmup_steps,
                                                            cfg.optim.steps),
                                          cfg.optim.steps, cfg.optim.min_lr)
        if cfg.run.checkpoint_dir and cfg.run.resume:
            self.resume()
        self.first_step = self.steps_done  # its activations are measured
        self.saver = None
        if cfg.run.checkpoint_async:
            try:
                self.saver = BackgroundSaver(self.world)     # collective
            except RuntimeError as err:                      # the same on every rank
                raise ConfigError(str(err)) from None
            staged = self.saver.reserve(self.strategy, self.opt)
            self.log.info(f"background checkpoints: {staged / 2**20:.1f} MiB of host memory "
                          f"on rank 0 hold the copy of its shards that a save writes")

    @property
    def steps_done(self) -> int:
        """Completed training steps: the strategy's counter (restored by a resume)."""
        return self.strategy.steps

    # -- checkpoints -------------------------------------------------------------
    def resume(self) -> None:
        """Continue from ``resume_from``, or else from the newest checkpoint in
        ``checkpoint_dir`` that verifies (see [Note: damaged checkpoints]); any layout."""
        run = self.cfg.run
        try:
            if run.resume_from:
                step_dir = chosen_checkpoint(run)
                extra = load_checkpoint(step_dir, self.strategy, self.opt, world=self.world)
                skipped = []
            else:
                extra, step_dir, skipped = load_newest_valid(run.checkpoint_dir, self.strategy,
                                                             self.opt, world=self.world)
        except CheckpointError as err:           # raised identically on every rank
            if err.rule == "no-checkpoint":
                raise CheckpointError(run.checkpoint_dir, "no-checkpoint", "--resume found no "
                                      "complete checkpoint here; leave out --resume to start "
                                      "a new run") from None
            raise
        for damaged, moved, err in skipped:
            self.log.info(f"skipped the damaged checkpoint {damaged}, set aside as "
                          f"{moved.name}: {err}")
        self.sampler.load_state_dict(extra["data"])
        load_module_rng_states(self.strategy.module, extra["rng"])
        self.log.info(f"resumed from step {self.steps_done} ({step_dir})")

    def save(self, *, last: bool = False):
        """Checkpoint parameters, optimizer state, data position and RNG (collective);
        with ``checkpoint_async``, written on a thread (see [Note: background saves]),
        waited for when it is the ``last`` save of the run."""
        run = self.cfg.run
        extra = {"step": self.steps_done, "data": self.sampler.state_dict(),
                 "token_data": getattr(self.recipe, "token_data", None),
                 "rng": module_rng_states(self.strategy.module, self.world),
                 "config": asdict(self.cfg)}
        if self.saver is None:
            return save_checkpoint(run.checkpoint_dir, self.steps_done, self.strategy,
                                   self.opt, world=self.world, extra_state=extra,
                                   keep_last=run.keep_last)
        self.report_save(self.saver.wait())       # at most one in flight
        path = self.saver.save(run.checkpoint_dir, self.steps_done, self.strategy, self.opt,
                               extra_state=extra, keep_last=run.keep_last)
        if last:
            self.report_save(self.saver.wait())
        return path

    def report_save(self, outcome) -> None:
        """One line for a background save that has finished (once)."""
        if outcome is not None and outcome.error is None and not outcome.reported:
            outcome.reported = True
            self.log.info(f"checkpoint {outcome.path.name} written in the background: "
                          f"{outcome.copy_s:.2f} s copying, then {outcome.write_s:.2f} s "
                          f"writing while training went on")

    # -- one step, and the loop ---------------------------------------------------
    def evaluate(self) -> float:
        """Mean validation loss over the recipe's fixed batches, averaged over dp ranks."""
        batches = self.recipe.eval_batches(self.mesh.dp_rank, self.mesh.dp.size)
        loss = np.array([sum(self.run.eval_step(x, y) for x, y in batches) / len(batches)])
        self.mesh.dp_cp.all_reduce(loss, op="avg")
        return float(loss[0])

    def run_step(self) -> dict:
        """One optimizer step; its metrics record."""
        cfg, pipeline = self.cfg, self.run.pipeline
        self.opt.lr = self.lr_schedule(self.steps_done)
        for comm in self.mesh.active_axes().values():
            comm.stats.reset()
        pipeline.measure_activations = self.steps_done == self.first_step  # see pipeline.py
        t0 = time.perf_counter()
        # read after the step: nothing inside it waits for the device (see [Note: device
        # step decisions] in mpishard/parallel/strategy.py)
        step_loss = self.run.forward_backward(*self.recipe.step_batch(self.sampler))
        if pipeline.measure_activations:
            pipeline.measure_activations = False
            most = self.world.all_reduce_obj(pipeline.activation_bytes, op="max")
            self.log.info(f"activations kept for backward: {most / 2**20:.2f} MiB on the "
                          f"busiest rank (measured on step {self.steps_done + 1}"
                          f"{_CHECKPOINTED[cfg.model.activation_checkpointing]})")
        result = self.run.step(self.opt, max_norm=cfg.optim.grad_clip or None)
        loss = np.array([float(step_loss)])
        self.mesh.dp_cp.all_reduce(loss, op="avg")
        seconds = time.perf_counter() - t0
        samples = cfg.optim.batch_size * cfg.optim.micro_steps * self.mesh.dp.size
        return {"step": self.steps_done, "loss": float(loss[0]), "lr": self.opt.lr,
                "grad_norm": result.grad_norm, "skipped": result.skipped,
                "loss_scale": self.strategy.scaler.scale, "step_s": seconds,
                "tokens_per_s": samples * self.recipe.tokens_per_sample / seconds}

    def fit(self) -> dict:
        """Train to ``steps``: each step evaluates, checkpoints, logs, and may stop."""
        cfg, run = self.cfg, self.cfg.run
        metrics = MetricsFile(run.metrics, self.world,
                              resumed_at=self.steps_done if run.resume else None)
        first_val = self.evaluate()
        self.log.info(f"step {self.steps_done}: val loss {first_val:.4f}")
        metrics.write({"step": self.steps_done, "val_loss": first_val})
        record, stopped = {}, False
        with StopSignals(INTERRUPT_TOO) as stop, \
                progress_bar(cfg, self.world.rank, self.steps_done) as bar:
            while self.steps_done < cfg.optim.steps:
                record = self.run_step()
                if metrics.active:   # a collective (gather to rank 0): only when it is written
                    record.update(memory_and_comm(self.world, self.strategy.ledger, self.mesh))
                    record.update(expert_load(self.strategy.module, self.mesh.dp_cp))
                self.log.own(own_line(record, self.strategy.ledger, self.mesh))
                if self._due(run.eval_interval) and self.steps_done < cfg.optim.steps:
                    record["val_loss"] = self.evaluate()
                    bar.line(f"step {self.steps_done}: val loss {record['val_loss']:.4f}",
                             self.log)
                stopped = stop.should_stop(self.world)           # collective, every step
                saving = bool(run.checkpoint_dir) and (
                    stopped or self.steps_done == cfg.optim.steps
                    or self._due(run.checkpoint_interval))
                if saving:   # recorded first: a kill between the two leaves no step unlogged
                    record["checkpoint"] = str(Path(run.checkpoint_dir) /
                                               step_dir_name(self.steps_done))
                metrics.write(record)
                if saving:
                    self.save(last=stopped or self.steps_done == cfg.optim.steps)
                elif self.saver is not None:
                    self.report_save(self.saver.finished())
                bar.report(record, self.log)
                if stopped or not math.isfinite(record["loss"]):
                    self.log.info(f"step {self.steps_done}: {stop_reason(stop, stopped, run)}")
                    break
        if self.saver is not None:
            self.report_save(self.saver.close())     # a run never exits mid-write
        last_val = first_val if stopped else self.evaluate()
        if not stopped:
            metrics.write({"step": self.steps_done, "val_loss": last_val})
        metrics.close()
        return {"val_loss_start": first_val, "val_loss_end": last_val,
                "train_loss_end": record.get("loss"), "steps": self.steps_done,
                "stopped": stopped, "interrupted": stop.interrupted,
                "diverged": not stopped and not math.isfinite(record.get("loss", 0.0)),
                "skipped_steps": self.strategy.skipped_steps}

    def _due(self, interval: int) -> bool:
        return bool(interval) and self.steps_done % interval == 0


def memory_and_comm(world, ledger, mesh) -> dict:
    """Every rank's ledger peaks (on rank 0; ``host_memory`` too where a rank keeps
    offloaded state in host memory) and this rank's traffic per mesh axis."""
    peaks = world.gather_obj((ledger.peak_by_category(), ledger.host_peak_by_category()))
    record = {"memory": None if peaks is None else [device for device, _ in peaks],
              "comm": {axis: comm.stats.snapshot() for axis, comm in mesh.active_axes().items()}}
    if peaks is not None and any(any(host.values()) for _, host in peaks):
        record["host_memory"] = [host for _, host in peaks]
    return record


def resolve_global_batch(cfg: TrainConfig, dp: int) -> None:
    """With ``global_batch`` set, the micro-steps that give it on ``dp`` ranks."""
    o = cfg.optim
    if not o.global_batch:
        return
    per_step = o.batch_size * dp
    if o.global_batch % per_step:
        raise ConfigError(f"global_batch = {o.global_batch} is not a multiple of batch_size "
                          f"{o.batch_size} x {dp} dp ranks = {per_step}; pick a global batch "
                          f"that is, or another batch_size")
    o.micro_steps = o.global_batch // per_step


def own_line(record: dict, ledger, mesh) -> str:
    """This rank's figures of a step, for its own log file."""
    held = sum(ledger.bytes_by_category().values())
    host = sum(ledger.host_bytes_by_category().values())
    waits = {axis: comm.stats.total_seconds for axis, comm in mesh.active_axes().items()}
    waited = ", ".join(f"{axis} {t:.3f} s" for axis, t in waits.items()) or "none"
    offloaded = f" (+ {host / 2**20:.2f} MiB in host memory)" if host else ""
    return (f"step {record['step']}: {record['step_s']:.3f} s, {held / 2**20:.2f} MiB "
            f"held{offloaded}, collectives {waited}")


def layout_of(cfg: TrainConfig, dp: int, recipe) -> Layout:
    """The :class:`~mpishard.planning.layout.Layout` a config trains (``dp`` data-parallel ranks)."""
    p, o = cfg.parallel, cfg.optim
    return Layout(dp, p.tp, p.pp, p.strategy, p.precision, o.optimizer,
                  batch_size=o.batch_size, seq_len=recipe.tokens_per_sample,
                  micro_batches=o.micro_steps, schedule=p.pipeline_schedule,
                  virtual_stages=p.virtual_stages,
                  activation_checkpointing=cfg.model.activation_checkpointing in ("full", "op"),
                  keep_products=cfg.model.activation_checkpointing == "op",
                  cp=p.cp, dp_replicate=p.dp_replicate, cp_mode=p.cp_mode,
                  sequence_parallel=p.sequence_parallel, ep=p.ep,
                  selective=cfg.model.activation_checkpointing == "selective",
                  offload=p.offload, reduce_dtype=p.reduce_dtype)


def stop_reason(stop, stopped: bool, run) -> str:
    """Why the loop ends early: a signal (on this rank or another), or a non-finite loss."""
    if not stopped:
        return "loss is not finite; stopping"
    saved = ("checkpoint saved, stopping" if run.checkpoint_dir else
             "stopping (no --checkpoint-dir, nothing saved)")
    got = "Ctrl-C" if stop.received == "SIGINT" else stop.received or "signal on another rank"
    return f"{got}; {saved}"


def _kernel_settings() -> None:
    """The kernel layer's environment switches, checked before anything is built (MKL
    loaded here when asked for: a node without it stops every rank alike)."""
    try:
        check_kernel_settings()
    except (ValueError, RuntimeError) as err:
        raise ConfigError(str(err)) from None


def agreed(world: Communicator, local_work):
    """``local_work()`` on every rank, then its ConfigError/DataError (or a ValueError
    from a layout that does not fit, as a ConfigError) raised on every rank alike."""
    error, value = None, None
    try:
        value = local_work()
    except (ConfigError, DataError) as err:
        error = err
    except ValueError as err:   # pp larger than n_layer, tp larger than n_head, ...
        error = ConfigError(str(err))
    agree(world, error, rebuild=rebuild_same_type(ConfigError, DataError))
    return value


def _over_budget(cfg: TrainConfig, plan) -> str | None:
    """What to do where ``plan``'s peak is over ``--memory-budget``, else ``None``."""
    budget = cfg.run.memory_budget
    if not budget or plan.total_peak_bytes <= budget:
        return None
    ways = ["more ranks", "a smaller --batch-size"]
    if strategy_entry(cfg.parallel.strategy).keeps_sharded < Sharded.PARAMETERS:
        ways.insert(0, "a sharding strategy that keeps less (--strategy zero3)")
    if cfg.model.activation_checkpointing != "full":
        ways.append("--activation-checkpointing full")
    if cfg.parallel.offload == "none":
        ways.append("--offload optimizer")
    return (f"the plan above needs {format_bytes(plan.total_peak_bytes)} per rank (model "
            f"state {format_bytes(plan.busiest.memory.model_state_bytes)}), over "
            f"--memory-budget {format_bytes(budget)}; use {', '.join(ways)}, or a larger "
            f"budget (mpishard plan --memory-budget ranks the layouts that fit)")


def run(cfg: TrainConfig, world: Communicator, notes=()) -> dict:
    """Plan, build, train, report. Returns the summary dict (on every rank)."""
    trainer = Trainer(cfg, world)
    for note in [*notes, *trainer.notes]:
        trainer.log.info(f"note: {note}")
    trainer.log.info(describe_plan(trainer))
    over = _over_budget(cfg, trainer.plan)
    if over and cfg.run.dry_run:
        trainer.log.info(f"note: a real run would stop here: {over}")
    elif over:
        trainer.log.close()         # the ledger would catch model state only, not activations
        raise ConfigError(over)
    if cfg.run.dry_run:
        trainer.log.info("dry run: nothing was trained")
        trainer.log.close()
        return {"dry_run": True, "plan": asdict(trainer.plan)}
    trainer.build()
    if trainer.steps_done >= cfg.optim.steps:      # a resumed run that is already there
        trainer.log.info(f"nothing to train: the checkpoint is at step {trainer.steps_done} "
                         f"and --steps is {cfg.optim.steps}; pass --steps above "
                         f"{trainer.steps_done} to train on")
        if trainer.saver is not None:
            trainer.saver.close()
        trainer.log.close()
        return {"steps": trainer.steps_done, "stopped": False, "interrupted": False,
                "nothing_to_train": True}
    summary = trainer.fit()
    finished = not (summary["stopped"] or summary["diverged"])
    if finished and cfg.run.sample_tokens and trainer.recipe.can_sample:
        mesh = trainer.mesh
        if mesh.tp.size > 1 or mesh.pp.size > 1 or mesh.cp.size > 1:
            trainer.log.info("sample skipped: sampling during training needs tp=1 pp=1 cp=1 "
                             "(mpishard sample works on a checkpoint of any layout)")
        else:
            text = trainer.recipe.sample(trainer.strategy.module, cfg.run.sample_prompt,
                                         cfg.run.sample_tokens, cfg.run.seed)
            trainer.log.info("sample:\n" + text)
    if summary["diverged"]:
        trainer.log.info(f"diverged: the loss was not finite at step {summary['steps']} of "
                         f"{cfg.optim.steps}, and the run stopped there (exit status 3); "
                         f"a lower --lr, more --warmup-steps or --grad-clip may help")
    elif not summary["stopped"]:
        skipped = summary["skipped_steps"]
        trainer.log.info(f"val loss {summary['val_loss_start']:.4f} -> "
                         f"{summary['val_loss_end']:.4f} after {summary['steps']} steps "
                         f"({cfg.parallel.strategy}, {world.size} ranks)"
                         + (f"; {skipped} skipped for non-finite gradients" if skipped else "")
                         + (" (the loss scale lowered each time)"
                            if skipped and cfg.parallel.precision == "float16" else ""))
    trainer.log.close()
    return summary

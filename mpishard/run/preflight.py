"""Before a run builds anything: never lose an earlier run, and say what a resume changes.

[Note: run safety]
``mpishard train`` checks the files a run would write before it reads data or
builds a model (rank 0 looks, every rank raises alike: [Note: agreed errors]):

* an output path nothing can be written to (a ``checkpoint_dir`` or ``log_dir``
  that is a file, a ``metrics`` file that is a folder, anything under a file) is
  refused, not found at the first save after training;

* a new run (no ``--resume``) into a ``checkpoint_dir`` that holds
  checkpoints, or with a ``--metrics`` file that holds records, is refused:
  its next saves would repoint ``latest`` and prune the old run's checkpoints,
  and the metrics would be truncated. ``--resume true`` continues that run;
  ``--overwrite true`` deletes its checkpoints and replaces its metrics;
* ``--resume true`` needs a complete checkpoint there (the newest whose manifest
  reads; ``--resume-from step-N`` picks one), written for the same
  model: the ``[model]`` settings that shape parameters (name, vocabulary,
  widths, depth, ...) are compared with the saved config, each difference named;
* a resume on another number of ranks changes the global batch (sequences per
  step) unless ``--global-batch`` holds it; the plan says so.

A dry run writes nothing: what a real run would refuse is a note in its plan.
"""
from __future__ import annotations

from pathlib import Path

from mpishard.core.agree import agree, rebuild_same_type
from mpishard.checkpoint import CheckpointError, read_manifest
from mpishard.checkpoint.format import LATEST_RE, MANIFEST
from mpishard.checkpoint.locate import complete_steps, resume_candidates
from mpishard.checkpoint.writer import delete_checkpoints
from mpishard.config.sections import KEYS, ConfigError, config_from_dict, flat_values
from mpishard.core.paths import why_unwritable
from mpishard.models import MODELS
from mpishard.run.report import metric_records

__all__ = ["check_run_files", "chosen_checkpoint", "shaping_keys"]


def shaping_keys(name: str) -> tuple:
    """The [model] settings that change the parameters a checkpoint of model family
    ``name`` holds: the shape every model has, and the family's keys that shape (its
    spec's)."""
    spec = MODELS.get(name)
    own = tuple(k.name for k in spec.keys if k.shapes) if spec is not None else ()
    return ("name", "vocab_size", "block_size", "n_layer", "n_head", "n_embd", *own)


def _output_paths(run) -> None:
    """A ConfigError for an output path nothing can be written to (a checkpoint or log
    folder that is a file, a metrics file that is a folder, a file where a parent folder
    should be): found before the run, not at its first save after training."""
    for flag, value, folder in (("--checkpoint-dir", run.checkpoint_dir, True),
                                ("--log-dir", run.log_dir, True),
                                ("--metrics", run.metrics, False)):
        why = why_unwritable(value, folder, "metrics.jsonl") if value else None
        if why is not None:
            raise ConfigError(f"{flag} {value} {why}")


def _fresh_run(cfg) -> None:
    run = cfg.run
    fix = ("pass --resume true to continue it, --overwrite true to start afresh (deleting "
           "it), or another")
    if run.checkpoint_dir:
        steps = complete_steps(run.checkpoint_dir)
        if steps and not run.overwrite:
            shown = ", ".join(f"step-{s}" for s in sorted(steps)[-3:])
            raise ConfigError(f"checkpoint_dir {run.checkpoint_dir} already holds {len(steps)} "
                              f"checkpoint(s) of an earlier run ({shown}); {fix} "
                              f"--checkpoint-dir")
    if run.metrics and not run.overwrite:
        n = metric_records(Path(run.metrics))
        if n:
            raise ConfigError(f"metrics file {run.metrics} already holds {n} records of an "
                              f"earlier run; {fix} --metrics")


def chosen_checkpoint(run) -> Path:
    """The step directory ``resume_from`` names: ``step-N`` in ``checkpoint_dir``, or a
    step directory's path. Raises a one-line ConfigError when it is neither."""
    named = Path(run.resume_from)
    inside = Path(run.checkpoint_dir) / run.resume_from
    for step_dir in ((inside, named) if LATEST_RE.fullmatch(run.resume_from) else (named,)):
        if (step_dir / MANIFEST).is_file():
            return step_dir
    raise ConfigError(f"--resume-from {run.resume_from} is neither a complete step-N in "
                      f"{run.checkpoint_dir} nor a step directory with a {MANIFEST}; "
                      f"mpishard checkpoint inspect {run.checkpoint_dir} shows what is there")


def _newest_readable(root: Path):
    """The checkpoint a resume will try first whose manifest reads, or ``None``: a damaged
    newer one is set aside when the resume loads (see [Note: damaged checkpoints])."""
    for step_dir in resume_candidates(root):
        try:
            return step_dir, read_manifest(step_dir)
        except CheckpointError:
            continue
    return None


def _resumed_run(cfg, world_size: int) -> list:
    root = Path(cfg.run.checkpoint_dir)
    if cfg.run.resume_from:
        step_dir = chosen_checkpoint(cfg.run)
        found = step_dir, read_manifest(step_dir)
    else:
        found = _newest_readable(root) if root.is_dir() else None
    if found is None:
        why = ("it does not exist" if not root.exists() else
               "it holds none that reads" if complete_steps(root) else "it holds none")
        raise CheckpointError(str(root), "no-checkpoint", f"--resume found no complete "
                              f"checkpoint here ({why}); leave out --resume to start a new run")
    step_dir, manifest = found
    saved = manifest.extra.get("config")
    if not saved:
        return []
    before = config_from_dict(flat_values(saved, str(step_dir), []))
    # vocab_size 0 is "from the data", settled only when the data are read
    differ = [(k, getattr(before.model, k), getattr(cfg.model, k))
              for k in shaping_keys(cfg.model.name)
              if getattr(before.model, k) != getattr(cfg.model, k)
              and not (k == "vocab_size" and getattr(cfg.model, k) == 0)]
    if differ:
        was = ", ".join(f"{k}={a!r}" for k, a, _ in differ)
        now = ", ".join(f"{k}={b!r}" for k, _, b in differ)
        raise ConfigError(f"the checkpoint in {step_dir} was written for {was}; this run has "
                          f"{now}: resume with the checkpoint's [model] settings, or start a "
                          f"new run in another --checkpoint-dir")
    notes = _changed_settings(before, cfg)
    o, saved_dp = before.optim, int(manifest.mesh["dp"])
    old = o.batch_size * o.micro_steps * saved_dp
    p = cfg.parallel
    dp = p.dp or world_size // (p.tp * p.pp * p.cp) or 1
    new = cfg.optim.global_batch or cfg.optim.batch_size * cfg.optim.micro_steps * dp
    if new == old:
        return notes
    hint = "" if cfg.optim.global_batch else f"; pass --global-batch {old} to keep it"
    return notes + [f"resuming a run of global batch {old} ({o.batch_size} per rank x "
                    f"{o.micro_steps} micro-steps x {saved_dp} dp ranks) with global batch "
                    f"{new}: the optimisation changes{hint}"]


#: what a resume may change that changes the run from the checkpoint on (a note each):
#: the optimizer and its schedule, the data and their order
_FOLLOWED = (("optim", ("optimizer", "steps", "lr", "min_lr", "warmup_steps", "weight_decay",
                        "beta1", "beta2", "grad_clip")),
             ("data", ("path", "dtype", "max_bytes")), ("run", ("seed",)))


def _changed_settings(before, cfg) -> list:
    """A note naming the optimizer, schedule and data settings, and the [model] settings
    that shape no parameter (dtype, dropout, the router's), that differ from the
    checkpoint's run (the resumed run follows the new ones), or none."""
    flags = {(k.section, k.name): k.flag for k in KEYS.values()}
    shaping = set(shaping_keys(cfg.model.name)) | {"preset"}
    model = tuple(k.name for k in KEYS.values() if k.section == "model"
                  and k.name not in shaping)
    changed = []
    for section, keys in (("model", model), *_FOLLOWED):
        now, was = getattr(cfg, section), getattr(before, section)
        changed += [f"{flags[section, key]} {getattr(now, key)!r} (was {getattr(was, key)!r})"
                    for key in keys if getattr(now, key) != getattr(was, key)]
    if not changed:
        return []
    return [f"resuming with {', '.join(changed)}: from the checkpoint on the run follows "
            f"these (the learning-rate schedule is a function of the step and --steps; "
            f"other data or another seed change what the next batches hold)"]


def check_run_files(cfg, world) -> list:
    """The checks of [Note: run safety] (collective); returns notes for the plan.

    With ``overwrite`` (and no resume), rank 0 then deletes the earlier run's
    checkpoints; the metrics file is replaced when training starts.
    """
    notes, error = [], None
    if world.rank == 0:
        try:
            _output_paths(cfg.run)
            notes = _resumed_run(cfg, world.size) if cfg.run.resume else (_fresh_run(cfg) or [])
        except (ConfigError, CheckpointError) as err:
            if not cfg.run.dry_run:
                error = err
            notes = [f"a real run would stop here: {err}"]
    rebuild = rebuild_same_type(ConfigError, CheckpointError, name_the_rank=False)
    notes = agree(world, error, notes, describe=_describe, rebuild=_rebuilt(rebuild))[0]
    if cfg.run.overwrite and not cfg.run.resume and cfg.run.checkpoint_dir \
            and not cfg.run.dry_run:
        error, deleted = None, 0
        if world.rank == 0:
            try:
                deleted = delete_checkpoints(cfg.run.checkpoint_dir)
            except OSError as err:
                error = ConfigError(f"--overwrite true could not delete the checkpoints in "
                                    f"{cfg.run.checkpoint_dir}: {err}")
        deleted = agree(world, error, deleted, rebuild=rebuild)[0]
        if deleted:
            notes.append(f"--overwrite true: deleted {deleted} checkpoint(s) of an earlier "
                         f"run in {cfg.run.checkpoint_dir}")
    return notes


def _describe(err) -> dict:
    extra = {"path": err.path, "rule": err.rule, "detail": err.detail} \
        if isinstance(err, CheckpointError) else {}
    return {"type": type(err).__name__, "message": str(err), **extra}


def _rebuilt(rebuild):
    """Rebuild a CheckpointError with its path and rule (others as their type)."""
    def again(failures: dict, size: int):
        record = failures[min(failures)]
        if record["type"] == "CheckpointError":
            return CheckpointError(record["path"], record["rule"], record["detail"])
        return rebuild(failures, size)
    return again

"""``mpishard plan``: the best layouts of a model on a number of ranks of a machine.

    mpishard plan --preset llama3.1-8b --ranks 64 --ranks-per-node 8 --machine h100-sxm \\
        --seq 8192 --global-batch 1024
    mpishard plan --preset gpt2 --ranks 4 --machine machine.json --json
    mpishard plan --preset llama3.1-8b --ranks 1 --machine h200 --memory-budget 60GiB
    mpishard plan --preset llama3.1-8b --ranks 1 --machine h200 --reduce-dtype bfloat16

A layout that does not fit is tried with optimizer offload, then (ZeRO-3) parameter
offload, on a machine whose description has a ``host_link``; one that fits so is
listed marked, with the shares of its step the copies and the host update take
(see [Note: offload plan] in mpishard/planning/offload.py). ``--offload`` plans
every layout with that offload instead. ``--reduce-dtype bfloat16`` plans the
gradients of 16-bit compute in bfloat16 (half their bytes and data-parallel
traffic); the header says so.
"""
from __future__ import annotations

import dataclasses
import json
import sys

__all__ = ["add_plan_command", "plan_config", "plan_from_args", "apply_auto_layout",
           "machine_or_error"]


def add_plan_command(sub) -> None:
    from mpishard.config.flags import add_config_flags
    from mpishard.planning.machine_file import shipped_machines

    plan = sub.add_parser("plan", help="rank the layouts of a model on N ranks of a machine "
                          "by predicted step time (memory planned exactly)")
    plan.add_argument("--ranks", type=int, required=True, help="ranks (GPUs or processes)")
    plan.add_argument("--machine", default="cpu-2core", help=f"a machine description file "
                      f"or one of {', '.join(shipped_machines())} (default: cpu-2core)")
    plan.add_argument("--ranks-per-node", type=int, default=None,
                      help="ranks on each node, >= 1 (default: the machine's)")
    plan.add_argument("--seq", type=int, default=None,
                      help="tokens per sequence (block size), >= 1")
    plan.add_argument("--global-batch", type=int, default=None,
                      help="sequences per step over all data ranks, >= 1 (default: "
                      "--batch-size x ranks)")
    plan.add_argument("--top", type=int, default=5, help="layouts to print, >= 1")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.add_argument("--explain", action="store_true",
                      help="print the fastest layout's breakdown: compute by op class, "
                      "recomputation, exposed communication per mesh group, bubble, "
                      "optimizer, memory by category, and where the machine's figures "
                      "come from")
    plan.add_argument("--config", help="TOML file with training settings")
    add_config_flags(plan, "estimate")
    plan.set_defaults(func=_cmd_plan)


#: the layout keys a search chooses that a user may fix (flags or the TOML file): each
#: the candidates must match (the value of a candidate layout)
_MATCHED = {"strategy": lambda lay: lay.strategy, "dp": lambda lay: lay.dp,
            "dp_replicate": lambda lay: lay.dp_replicate,
            "dp_shard": lambda lay: lay.dp // lay.dp_replicate,
            "tp": lambda lay: lay.tp, "pp": lambda lay: lay.pp, "cp": lambda lay: lay.cp,
            "virtual_stages": lambda lay: lay.virtual_stages}
#: the layout keys every candidate takes as given (recomputation, schedule, splits)
_SET = ("activation_checkpointing", "pipeline_schedule", "sequence_parallel", "cp_mode")
#: kept as given by :func:`plan_config` itself: ``none`` proposes no offload, another
#: value offloads every layout that can
_OFFLOAD = ("offload",)


def kept_as_given(cfg, given) -> dict:
    """The layout keys of ``given`` (the flat keys a user's flags and TOML file gave) and
    their values in ``cfg``, which a search keeps (dp or dp_shard 0: inferred, not kept)."""
    kept = {}
    for key in (*_MATCHED, *_SET, *_OFFLOAD):
        if key in given:
            value = getattr(cfg.model if key == "activation_checkpointing" else cfg.parallel,
                            key)
            if not (key in ("dp", "dp_shard") and value == 0):
                kept[key] = value
    return kept


def _as_given(layout, kept: dict):
    """``layout`` with the kept keys it takes (see :data:`_SET`), or ``None`` where it
    differs from a kept value it must match (:data:`_MATCHED`) or cannot take them."""
    if any(key in kept and kept[key] != value(layout) for key, value in _MATCHED.items()):
        return None
    schedule = kept.get("pipeline_schedule")
    if schedule is not None and (schedule == "interleaved") != (layout.virtual_stages > 1):
        return None
    changes = {}
    if schedule is not None and layout.virtual_stages == 1:
        changes["schedule"] = schedule
    if "sequence_parallel" in kept:
        changes["sequence_parallel"] = kept["sequence_parallel"] and layout.tp > 1
    if "cp_mode" in kept:
        changes["cp_mode"] = kept["cp_mode"]
    if "activation_checkpointing" in kept:
        mode = kept["activation_checkpointing"]
        changes.update(activation_checkpointing=mode in ("full", "op"),
                       keep_products=mode == "op", selective=mode == "selective")
    try:
        return dataclasses.replace(layout, **changes) if changes else layout
    except ValueError:             # a split these sizes cannot take
        return None


def plan_config(cfg, ranks: int, machine, ranks_per_node=None, global_batch=None,
                precision=None, kept=None, say=None, memory_bytes=None) -> tuple:
    """``(ranked layouts, over the memory limit, candidates, machine, precision)`` of the
    model ``cfg`` describes on ``ranks`` ranks of ``machine`` (a :class:`Machine`, or
    the name or file :func:`load_machine` takes), each rank fitting ``memory_bytes``
    (default: the machine's usable memory); offloaded where nothing else fits (on a
    machine with a host link), or as ``cfg.parallel.offload`` asks; gradients reduced
    in ``cfg.parallel.reduce_dtype``; the layout keys of ``kept`` at their values
    (:func:`kept_as_given`)."""
    from mpishard.config.sections import ConfigError
    from mpishard.recipes import recipe_for
    from mpishard.planning.offload import offload_untimed
    from mpishard.planning.search import candidate_layouts, rank_layouts

    machine = machine_or_error(machine)
    if ranks < 1:
        raise ConfigError(f"--ranks {ranks} must be >= 1")
    precision = precision or cfg.parallel.precision
    recipe = recipe_for(cfg)
    seq = recipe.tokens_per_sample
    batch = global_batch or cfg.optim.batch_size * ranks
    m = cfg.model
    rpn = ranks_per_node or min(machine.ranks_per_node, ranks)
    kept = kept or {}
    strategies = [kept["strategy"]] if "strategy" in kept else None
    chunks = (kept["virtual_stages"],) if "virtual_stages" in kept else (1, 2)
    try:
        layouts = candidate_layouts(ranks, rpn, seq, batch, m.n_layer, m.n_head,
                                    None if precision == "float32" else precision, strategies,
                                    virtual_stages=chunks,  # 1, and interleaved, 2 a rank
                                    reduce_dtype=cfg.parallel.reduce_dtype)
    except ValueError as err:      # a reduce dtype that this precision does not admit
        raise ConfigError(str(err)) from None
    if not layouts:
        raise ConfigError(f"no layout of {ranks} ranks fits a global batch of {batch} "
                          f"sequences; pass a --global-batch that the data-parallel sizes "
                          f"divide")
    if kept:
        layouts = list(dict.fromkeys(lay for lay in (_as_given(lay, kept) for lay in layouts)
                                     if lay is not None))
        if not layouts:
            raise ConfigError(f"no layout of {ranks} ranks (global batch {batch}) has "
                              f"{describe_kept(kept)}; leave out one of those, or pass sizes "
                              f"that fit the ranks together")
    asked = kept.get("offload", cfg.parallel.offload)
    untimed = offload_untimed(machine)
    offloads = ("optimizer", "params") if machine.host_link is not None and not untimed \
        and "offload" not in kept else ()
    if asked != "none":                     # asked for: every layout that can
        if untimed:
            raise ConfigError(f"--offload {asked}: {untimed}; or leave out --offload")
        layouts = [lay for lay in (_with_offload(lay, asked) for lay in layouts)
                   if lay is not None]
        offloads = ()

    def progress(i, n):
        if say and (i % max(1, n // 10) == 0):
            say(f"plan: {i}/{n} layouts")
    backend = plan_backend(machine)
    ranked, over = rank_layouts(lambda: recipe.model(backend), layouts, machine, rpn,
                                memory_bytes, progress=progress, offloads=offloads)
    if "activation_checkpointing" in kept:     # not also tried recomputed by op
        mode = kept["activation_checkpointing"]
        ranked = [r for r in ranked if recomputation(r.layout) == mode]
    return ranked, over, len(layouts), machine, precision


def recomputation(layout) -> str:
    """The ``activation_checkpointing`` key of a layout: none, full, selective or op."""
    return "op" if layout.keep_products else "full" if layout.activation_checkpointing \
        else "selective" if layout.selective else "none"


def describe_kept(kept: dict) -> str:
    """``tp=2, strategy=zero3``: the layout keys a search kept as given."""
    return ", ".join(f"{key}={str(v).lower() if isinstance(v, bool) else v}"
                     for key, v in kept.items())


def _with_offload(layout, offload: str):
    try:
        return dataclasses.replace(layout, offload=offload)
    except ValueError:             # a strategy that cannot offload this
        return None


def machine_or_error(machine):
    """``machine`` itself, or the description :func:`load_machine` reads for it."""
    from mpishard.config.sections import ConfigError
    from mpishard.planning.machine import Machine
    from mpishard.planning.machine_file import load_machine
    if isinstance(machine, Machine):
        return machine
    try:
        return load_machine(machine)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def plan_from_args(args, say=None) -> tuple:
    """:func:`plan_config` of ``mpishard plan``'s flags (see :func:`_config`)."""
    machine = machine_or_error(args.machine)
    cfg, given = _config(args, machine)
    return _plan(cfg, kept_as_given(cfg, given), args, machine, say)


def _config(args, machine) -> tuple:
    """``(configuration, the flat keys given)`` of ``mpishard plan``'s flags. On a GPU
    machine without ``--precision``, bfloat16 (what GPUs train in), written into
    ``args`` first so that the config check (``--reduce-dtype``) sees it; ``--seq``
    sets the block size."""
    from mpishard.config.flags import config_from_args

    if getattr(args, "precision", None) is None and machine.kind == "gpu":
        args.precision = "bfloat16"
    given: set = set()
    cfg = config_from_args(args, None, given)
    if args.seq:
        cfg.model.block_size = args.seq
    return cfg, given


def _plan(cfg, kept, args, machine, say) -> tuple:
    """:func:`plan_config` of ``cfg`` with the flags only ``mpishard plan`` has."""
    return plan_config(cfg, args.ranks, machine, args.ranks_per_node, args.global_batch,
                       None, kept, say, cfg.run.memory_budget or None)


def apply_auto_layout(cfg, world_size: int, given=()) -> str:
    """Set ``cfg``'s layout to the fastest :func:`plan_config` predicts for ``world_size``
    ranks on ``cfg.parallel.machine`` within ``--memory-budget`` (the global batch kept;
    under ``layout = "auto"`` the layout keys of ``given``, the flat names a user gave,
    too; ``"auto-all"`` replaces them); returns a line saying what."""
    from mpishard.config.sections import ConfigError
    o, p = cfg.optim, cfg.parallel
    batch = o.global_batch or o.batch_size * o.micro_steps * world_size
    budget = cfg.run.memory_budget or None
    layout_keys = kept_as_given(cfg, given)
    kept, replaced = (layout_keys, {}) if p.layout == "auto" else ({}, layout_keys)
    if "offload" in replaced:
        p.offload = "none"           # proposed again where nothing else fits
    ranked, _, n, machine, _ = plan_config(cfg, world_size, p.machine, None, batch, None,
                                           kept, None, budget)
    if not ranked:
        raise ConfigError(f"--layout {p.layout} on {world_size} ranks: "
                          + _none_fit_line(n, _limit(budget, machine), budget, machine,
                                           p.offload, kept, "--block-size"))
    lay = ranked[0].layout
    p.dp, p.tp, p.pp, p.cp, p.strategy = lay.dp, lay.tp, lay.pp, lay.cp, lay.strategy
    p.dp_replicate, p.dp_shard, p.sequence_parallel = lay.dp_replicate, 0, lay.sequence_parallel
    p.offload = lay.offload
    p.pipeline_schedule, p.virtual_stages = lay.schedule, lay.virtual_stages
    o.batch_size, o.micro_steps, o.global_batch = lay.batch_size, lay.micro_batches, 0
    cfg.model.activation_checkpointing = recomputation(lay)
    return (f"layout {p.layout} ({machine.name}, {n} layouts): dp={lay.dp} (dp_replicate="
            f"{lay.dp_replicate}) x cp={lay.cp} x tp={lay.tp} x pp={lay.pp}"
            f"{f' ({lay.virtual_stages} chunks each, interleaved)' if lay.virtual_stages > 1 else ''}"
            f", {lay.strategy}, "
            f"{lay.batch_size} x {lay.micro_batches} micro-batches per dp rank"
            f"{f', recomputation {recomputation(lay)}' if recomputation(lay) != 'none' else ''}"
            f"{f', offload {lay.offload}' if lay.offload != 'none' else ''}"
            f"{f' ({describe_kept(kept)} as given)' if kept else ''}"
            f"{f' (replacing the given {describe_kept(replaced)})' if replaced else ''}; "
            f"predicted {ranked[0].cost.seconds:.3f} s/step")


#: ``mpishard plan``'s count flags: what each counts, and what leaving it out gives
_COUNTS = {"ranks_per_node": ("ranks on each node", "the machine's"),
           "seq": ("tokens per sequence", "the model's block size"),
           "global_batch": ("sequences per step", "--batch-size x ranks"),
           "top": ("layouts to print", "5")}


def _check_counts(args) -> None:
    """A ConfigError naming the first of ``mpishard plan``'s count flags given below 1."""
    from mpishard.config.sections import ConfigError
    for key, (what, default) in _COUNTS.items():
        value = getattr(args, key)
        if value is not None and value < 1:
            raise ConfigError(f"--{key.replace('_', '-')} {value} must be >= 1 ({what}; "
                              f"left out: {default})")


def _none_fit_line(n: int, limit: str, budget, machine, asked: str, kept: dict,
                   seq_flag: str = "--seq") -> str:
    """What ``mpishard plan`` prints where none of its ``n`` layouts fits ``limit`` per
    rank: what would make one fit. The search already tried one sequence per
    micro-batch, recomputation and, on a machine with a host link, offload; a smaller
    global batch gives no smaller micro-batch."""
    from mpishard.planning.offload import offload_untimed
    helps = ["more ranks"]
    if budget:
        helps.append("a larger --memory-budget")
    helps.append(f"a shorter {seq_flag}")
    layout_keys = {k: v for k, v in kept.items() if k != "offload"}
    if layout_keys:
        helps.append(f"leaving out {describe_kept(layout_keys)}")
    untimed = offload_untimed(machine)
    tried, proposed = "", machine.host_link is not None and not untimed
    instead = " in place of --offload none" if "offload" in kept else ""
    if asked == "optimizer":
        helps.append("--offload params (ZeRO-3)")
    elif untimed:
        helps.append("host_link and host_memory_bandwidth in the machine description, to "
                     "try offload")
    elif proposed and not instead:
        tried = " (optimizer and parameter offload were tried)"
    elif asked == "none":
        helps.append(f"--offload optimizer (or params){instead}")
    ways = " or ".join(helps) if len(helps) == 2 else \
        f"{', '.join(helps[:-1])}, or {helps[-1]}"
    return f"none of the {n} layouts fits {limit} per rank{tried}; what would help: {ways}"


def _cmd_plan(args) -> int:
    from mpishard.planning.search import format_table

    def say(text):
        print(text, file=sys.stderr, flush=True)
    _check_counts(args)
    machine = machine_or_error(args.machine)
    cfg, given = _config(args, machine)
    kept = kept_as_given(cfg, given)
    ranked, over, n, machine, precision = _plan(cfg, kept, args, machine, say)
    top = ranked[:args.top]
    reduce = cfg.parallel.reduce_dtype
    if args.json:
        print(json.dumps({"machine": machine.name, "ranks": args.ranks,
                          "precision": precision, "reduce_dtype": reduce, "candidates": n,
                          "over_memory": over, "layouts": [r.as_dict() for r in top]},
                         indent=1))
        return 0
    budget, asked = cfg.run.memory_budget, cfg.parallel.offload
    limit = _limit(budget, machine)
    offloaded = [r for r in ranked if r.layout.offload != "none"]
    gradients = f", gradients in {reduce}" if reduce != "float32" else ""
    with_kept = f" with {describe_kept(kept)}" if kept else ""
    print(f"{n} layouts of {args.ranks} ranks{with_kept} on {machine.name} "
          f"({precision}{gradients}); "
          f"{over} over {limit} per rank, {len(ranked)} fit"
          + (f" (offload {asked}, as asked)" if asked != "none"
             else f" ({len(offloaded)} only with offload)" if offloaded else "")
          + (f"; the fastest {len(top)}:" if top else ""))
    if not top:
        print(_none_fit_line(n, limit, budget, machine, asked, kept))
    else:
        print(format_table(top))
        parts = ", ".join(f"{k} {v:.4f}" for k, v in top[0].cost.breakdown.items() if v)
        print(f"#1 step {top[0].cost.seconds:.4f} s: {parts}")
    first = next((i for i, r in enumerate(top) if r.layout.offload != "none"), None)
    if first is not None:
        print(offload_line(first + 1, top[first]))
    print("figures: " + "; ".join(f"{kind}: {', '.join(keys)}" for kind, keys in
                                  sorted(machine.provenance().items())))
    if top and args.explain:
        print(explain(top[0], cfg, machine))
    return 0


def offload_line(number: int, ranked) -> str:
    """What an offloaded layout's step pays for it, and what it keeps in host memory."""
    from mpishard.planning.search import offload_share
    cost, lay = ranked.cost, ranked.layout
    copies, host = offload_share(cost)
    b = cost.breakdown
    what = "optimizer and parameters" if lay.offload == "params" else "optimizer"
    return (f"#{number} offloads the {what}: {ranked.host_bytes / 2**30:.2f} GiB per rank "
            f"in host memory; offload copies {b['offload copies']:.4f} s ({copies:.1%} of "
            f"the step), host optimizer {b['host optimizer']:.4f} s ({host:.1%}), neither "
            f"overlapped with compute")


def _limit(budget, machine) -> str:
    """The per-rank memory a plan fits layouts into, as its lines say it."""
    from mpishard.core.parse import format_bytes
    return f"{format_bytes(budget)} (--memory-budget)" if budget else _usable(machine)


def _usable(machine) -> str:
    gib = 2**30
    if not machine.memory_reserve_bytes:
        return f"{machine.memory_bytes / gib:.1f} GiB"
    return (f"{machine.usable_memory_bytes / gib:.1f} GiB ({machine.memory_bytes / gib:.1f} "
            f"less a {machine.memory_reserve_bytes / gib:.1f} GiB reserve)")


def plan_backend(machine):
    """The backend a plan's models are built on (unmaterialised: no memory): a GPU
    machine's as its device runs (the CuPy-strict module's rules on the host), so that
    the activation plan counts what a device's kernels keep (the dropouts' float32
    draws, the rotary tables, and the attention ``MPISHARD_ATTENTION`` chooses, as the
    step-time model costs it);
    NumPy's on a CPU."""
    from mpishard.core.backend import Backend
    return Backend("strict") if machine is not None and machine.kind == "gpu" else Backend()


def explain(ranked, cfg, machine=None) -> str:
    """One layout's breakdown beside its step total: compute by op class (with the
    recomputation in it), exposed communication per mesh group, bubble, optimizer, and
    its busiest rank's memory by category (planned on ``machine``'s backend, see
    :func:`plan_backend`)."""
    from mpishard.planning.layout import estimate_layout
    from mpishard.recipes import recipe_for

    cost, lay = ranked.cost, ranked.layout
    total = cost.seconds
    rows = [f"#1 explained: {total:.4f} s per step, {cost.tokens_per_s:.0f} tokens/s, "
            f"MFU {cost.mfu:.1%} (busiest pipeline stage {cost.stage})"]
    for part, seconds in cost.breakdown.items():
        if seconds:
            before = cost.comm_total.get(part[5:]) if part.startswith("comm ") else None
            hidden = f" (of {before:.4f} s before overlap)" if before is not None else ""
            rows.append(f"  {part:<26}{seconds:10.4f} s {seconds / total:6.1%}{hidden}")
    recompute = "blocks but for every second product" if lay.keep_products else \
        "full blocks" if lay.activation_checkpointing else \
        "attention's core" if lay.selective else "none"
    rows.append(f"  recomputation: {recompute} (inside the compute rows)")
    rows.append(estimate_layout(recipe_for(cfg).model(plan_backend(machine)), lay).format())
    return "\n".join(rows)

"""What a model and the mesh axes can honour, checked with the configuration.

[Note: refused before anything is built]
Every combination that a model or an axis cannot train is refused while the
configuration is checked (:func:`check_supported`, from
:func:`~mpishard.config.sections.load_config`, and again by the trainer after
``--layout auto``), as one ConfigError: the same on every rank by construction,
one line on rank 0 and exit status 2 from ``mpishard``, before any data is read
or any model is built. Those are: a model split over an axis its spec does not
list (an MLP over tp, pp, cp or ep); more tensor-parallel ranks than heads,
more stages than blocks; a sequence that context parallelism cannot cut into
``2 cp`` chunks, heads that all-to-all attention cannot share over ``tp x cp``,
rows that sequence parallelism cannot split over tp; the model config's own
refusals (a head size that is odd for rotary embeddings, key/value heads that
do not divide the heads, biases or dropout a family does not have, a context
beyond the model's positions); and what the family's spec refuses on the split
(``ModelSpec.check_split``: dropout with context parallelism, expert
parallelism of a dense model or of experts it does not divide, the mixture of
experts' auxiliary losses over pipeline stages or with activation
checkpointing); model chunks the pipeline cannot interleave (``virtual_stages >
1`` without the interleaved schedule, the interleaved schedule without ``pp`` and
``virtual_stages`` of 2 or more, micro-steps that are not a multiple of ``pp``,
blocks that do not split into ``pp x virtual_stages`` equal chunks); an
offload the strategy cannot do; a 16-bit ``reduce_dtype`` without a 16-bit
``precision``, and bfloat16 gradients reduced in float16. What depends on the
world size (a mesh whose product is not the number of ranks, ep not inside
``dp_shard x cp``) is refused alike when the mesh is built, before the model.
"""
from __future__ import annotations

from mpishard.core.errors import ConfigError
from mpishard.data.corpus import VOCAB_SIZE
from mpishard.models import MODELS, AxisSizes
from mpishard.models.checkpointing import check_op_mode

__all__ = ["check_supported"]

#: axis -> (the config key that sizes it, what it splits)
_AXES = {"tp": ("tp", "its layers (tensor parallelism)"),
         "pp": ("pp", "its blocks into stages (pipeline parallelism)"),
         "cp": ("cp", "its sequences (context parallelism)"),
         "ep": ("ep", "experts (expert parallelism)"),
         "sp": ("sequence_parallel", "the rows of its norms (sequence parallelism)")}


def check_supported(cfg, resolved: bool = False) -> list:
    """ConfigError for what ``cfg`` asks that its model or the axes cannot honour (see
    [Note: refused before anything is built]); else notes for the plan (how tp splits
    heads it does not divide). ``resolved``: the micro-steps a ``global_batch`` gives
    are known (they need the data-parallel size: the trainer's check, not the
    configuration's)."""
    m, p = cfg.model, cfg.parallel
    spec = MODELS[m.name]
    asked = {"tp": p.tp > 1, "pp": p.pp > 1, "cp": p.cp > 1, "ep": p.ep > 1,
             "sp": p.sequence_parallel and p.tp > 1}
    for axis, wanted in asked.items():
        if wanted and axis not in spec.axes:
            key, what = _AXES[axis]
            value = getattr(p, key)
            fix = f"--{key.replace('_', '-')} {'false' if isinstance(value, bool) else 1}"
            raise ConfigError(f"{key} = {str(value).lower()}: the {m.name} model does not "
                              f"split {what}; use {fix}")
    _check_interleaving(cfg, resolved or not cfg.optim.global_batch)
    _check_offload(cfg)
    _check_reduce_dtype(cfg)
    if spec.build_config is None:
        return []
    if p.tp > m.n_head:
        raise ConfigError(f"tp = {p.tp} is larger than n_head = {m.n_head}: every "
                          f"tensor-parallel rank needs at least one head; use tp <= {m.n_head}")
    if p.pp > m.n_layer:
        raise ConfigError(f"pp = {p.pp} is larger than n_layer = {m.n_layer}: every stage "
                          f"needs at least one block; use pp <= {m.n_layer}")
    chunks = p.pp * p.virtual_stages
    if p.virtual_stages > 1 and m.n_layer % chunks:
        fits = [v for v in range(2, m.n_layer // p.pp + 1) if m.n_layer % (p.pp * v) == 0]
        fix = f"--virtual-stages {' or '.join(map(str, fits))}" if fits else \
            "an n_layer that is a multiple of pp x virtual_stages"
        raise ConfigError(f"n_layer = {m.n_layer} blocks do not split into pp x "
                          f"virtual_stages = {p.pp} x {p.virtual_stages} = {chunks} equal "
                          f"model chunks of at least one block; use {fix}")
    _check_sequence(cfg)
    sizes = AxisSizes(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep,
                      sequence_parallel=asked["sp"],
                      activation_checkpointing=m.activation_checkpointing in ("full", "op"))
    try:
        config = spec.config_of(m, vocab_size=m.vocab_size or VOCAB_SIZE)
        check_op_mode(config, m.activation_checkpointing)
        return list(spec.check_split(config, sizes)) if spec.check_split else []
    except ValueError as err:     # the model config's refusals, and the family's
        raise ConfigError(str(err)) from None


def _check_sequence(cfg) -> None:
    """A sequence that context or sequence parallelism cannot split."""
    p, seq_len = cfg.parallel, cfg.model.block_size
    cp, tp = p.cp, p.tp
    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(f"sequence length {seq_len} does not divide by 2 x cp = {2 * cp} "
                          f"(context parallelism gives each rank two of 2*cp chunks); use a "
                          f"--block-size that is a multiple of {2 * cp} or another --cp")
    n_head = cfg.model.n_head
    if cp > 1 and p.cp_mode == "all-to-all" and n_head % (tp * cp):
        raise ConfigError(f"--cp-mode all-to-all splits the heads over tp x cp = {tp * cp} "
                          f"ranks, but n_head = {n_head} does not divide by {tp * cp}; use "
                          f"--cp-mode ring, or a cp and tp whose product divides {n_head}")
    rows = cfg.optim.batch_size * (seq_len // cp)
    if p.sequence_parallel and tp > 1 and rows % tp:
        raise ConfigError(f"sequence parallelism splits the {rows} rows of each micro-batch "
                          f"(batch x sequence / cp) over tp = {tp}; use a --batch-size or "
                          f"--block-size that makes them divisible by {tp}, or "
                          f"--sequence-parallel false")


def _check_interleaving(cfg, micro_known: bool) -> None:
    """Model chunks the pipeline schedule, pp or the micro-steps (where known) cannot run
    (what :func:`~mpishard.parallel.compose.check_interleaving` refuses, in flags)."""
    p, micro = cfg.parallel, cfg.optim.micro_steps
    if p.pipeline_schedule != "interleaved":
        if p.virtual_stages > 1:
            raise ConfigError(f"virtual_stages = {p.virtual_stages}: model chunks need "
                              f"--pipeline-schedule interleaved (it is "
                              f"{p.pipeline_schedule}); add it or use --virtual-stages 1")
        return
    if p.pp < 2 or p.virtual_stages < 2:
        raise ConfigError(f"pipeline_schedule = interleaved needs --pp and --virtual-stages "
                          f"of 2 or more (got pp = {p.pp}, virtual_stages = "
                          f"{p.virtual_stages}); set both, or use --pipeline-schedule 1f1b")
    if micro_known and micro % p.pp:
        steps = p.pp * max(1, round(micro / p.pp))
        batch = cfg.optim.global_batch
        given = f"global_batch = {batch} gives " if batch else ""
        fix = f"--global-batch {batch // micro * steps}" if batch else f"--micro-steps {steps}"
        raise ConfigError(f"{given}micro_steps = {micro}: the interleaved schedule sends "
                          f"micro-batches round the pipeline in groups of pp = {p.pp}; use "
                          f"{fix} ({steps} micro-steps, a multiple of {p.pp})")


def _check_offload(cfg) -> None:
    """An offload the strategy cannot do (what :func:`~mpishard.parallel.offload.
    check_offload` refuses, in flags)."""
    from mpishard.parallel.offload import check_offload  # noqa: PLC0415 (as options.py)
    from mpishard.parallel.strategy import STRATEGIES  # noqa: PLC0415
    p = cfg.parallel
    try:
        check_offload(p.offload, STRATEGIES[p.strategy].cls)
    except ValueError:
        if p.offload == "params":
            what = "its parameters (only ZeRO-3 keeps them as shards between uses)"
            fix = "--strategy zero3, or --offload optimizer"
        else:
            what, fix = "its optimizer", "--strategy ddp or a ZeRO stage, or --offload none"
        raise ConfigError(f"offload = {p.offload}: strategy = {p.strategy} cannot offload "
                          f"{what}; use {fix}") from None


def _check_reduce_dtype(cfg) -> None:
    """A reduce dtype that means nothing under float32 compute, or that
    :class:`~mpishard.parallel.Precision` refuses (bfloat16 gradients in float16), in
    flags."""
    p = cfg.parallel
    reduce, precision = p.reduce_dtype, p.precision
    if reduce != "float32" and precision == "float32":
        raise ConfigError(f"reduce_dtype = {reduce}: gradients are reduced in 16 bits only "
                          f"under a 16-bit precision (precision = float32); add --precision "
                          f"{reduce}, or use --reduce-dtype float32")
    if reduce == "float16" and precision == "bfloat16":
        raise ConfigError("reduce_dtype = float16 with precision = bfloat16: bfloat16 "
                          "gradients reduced in float16 lose the small ones and overflow on "
                          "large ones; use --reduce-dtype bfloat16 or float32")

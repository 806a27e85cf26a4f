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
checkpointing). What depends on the world size (a mesh whose product is not
the number of ranks, ep not inside ``dp_shard x cp``) is refused alike when the
mesh is built, before the model.
"""
from __future__ import annotations

from mpishard.core.errors import ConfigError
from mpishard.data.corpus import VOCAB_SIZE
from mpishard.models import MODELS, AxisSizes

__all__ = ["check_supported"]

#: axis -> (the config key that sizes it, what it splits)
_AXES = {"tp": ("tp", "its layers (tensor parallelism)"),
         "pp": ("pp", "its blocks into stages (pipeline parallelism)"),
         "cp": ("cp", "its sequences (context parallelism)"),
         "ep": ("ep", "experts (expert parallelism)"),
         "sp": ("sequence_parallel", "the rows of its norms (sequence parallelism)")}


def check_supported(cfg) -> list:
    """ConfigError for what ``cfg`` asks that its model or the axes cannot honour (see
    [Note: refused before anything is built]); else notes for the plan (how tp splits
    heads it does not divide)."""
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
    if spec.build_config is None:
        return []
    if p.tp > m.n_head:
        raise ConfigError(f"tp = {p.tp} is larger than n_head = {m.n_head}: every "
                          f"tensor-parallel rank needs at least one head; use tp <= {m.n_head}")
    if p.pp > m.n_layer:
        raise ConfigError(f"pp = {p.pp} is larger than n_layer = {m.n_layer}: every stage "
                          f"needs at least one block; use pp <= {m.n_layer}")
    _check_sequence(cfg)
    sizes = AxisSizes(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep,
                      sequence_parallel=asked["sp"],
                      activation_checkpointing=m.activation_checkpointing == "full")
    try:
        config = spec.config_of(m, vocab_size=m.vocab_size or VOCAB_SIZE)
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

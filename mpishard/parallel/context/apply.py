"""Context parallelism: every activation split along the sequence over ``mesh.cp``.

    run = ParallelModel(Llama(cfg, materialize_now=False), Mesh(world, cp=4), cp_mode="ring")
    run.train_step(x, y)        # x, y: this dp rank's whole (B, T) batch; T % (2 cp) == 0

Each cp rank keeps the zigzag pair of sequence chunks ``r`` and ``2 cp - 1 - r``
(see :func:`~mpishard.parallel.context.attention.zigzag_positions`), so the causal
attention work is the same on every rank. Everything but attention is
row-wise, so it runs on the local rows unchanged; positions (GPT's position
table, Llama's rotary angles) are the rows' global positions; attention is
``ring`` (K/V blocks passed around the cp ring, log-sum-exp merge) or
``all-to-all`` (DeepSpeed-Ulysses: sequence-split to head-split and back).
Gradients are averaged over ``dp x cp`` (``mesh.dp_cp``), and the loss is
normalised by the global count of valid targets (see [Note: global token
count] in parallel/pipeline/schedule.py).

A model takes part through its plan's ``attention`` patterns: those modules,
and the model itself, get a ``sequence`` attribute (a :class:`SequenceShard`)
that their forward consults (``None`` means the whole sequence is here).
"""
from __future__ import annotations

from mpishard.nn.sharding import plan_of
from mpishard.parallel.context.attention import ring_attention, ulysses_attention, zigzag_positions, zigzag_slice
from mpishard.parallel.plans import matching_modules

__all__ = ["SequenceShard", "apply_context_plan", "CP_MODES"]

CP_MODES = ("ring", "all-to-all")


class SequenceShard:
    """This rank's share of every sequence: positions, attention, and batch slicing.

    Args:
        cp: the context-parallel Communicator.
        mode: ``"ring"`` or ``"all-to-all"``.
    """

    def __init__(self, cp, mode: str = "ring"):
        if mode not in CP_MODES:
            raise ValueError(f"unknown context-parallel mode {mode!r}; use 'ring' or "
                             f"'all-to-all'")
        self.cp, self.mode = cp, mode

    def global_length(self, local_len: int) -> int:
        return local_len * self.cp.size

    def positions(self, local_len: int, xp):
        """The global positions of this rank's ``local_len`` rows of a sequence."""
        return xp.asarray(zigzag_positions(local_len * self.cp.size, self.cp.size,
                                           self.cp.rank))

    def split(self, batch):
        """This rank's zigzag columns of a ``(B, T)`` batch (``T % (2 cp) == 0``)."""
        return zigzag_slice(batch, self.cp.size, self.cp.rank, axis=1)

    def attention(self, qkv, n_head: int, batch_size: int, dropout_p: float = 0.0,
                  rng=None, training: bool = True):
        """Causal attention of the local rows over the whole sequence."""
        if dropout_p > 0.0 and training:
            raise ValueError(f"attention dropout {dropout_p} is not supported with context "
                             f"parallelism (cp={self.cp.size}); set dropout = 0")
        if self.mode == "ring":
            return ring_attention(qkv, n_head, batch_size, self.cp)
        return ulysses_attention(qkv, n_head, batch_size, self.cp)


def apply_context_plan(model, cp, mode: str = "ring", plan=None):
    """Give ``model`` and its attention modules (its plan's ``attention`` patterns) the
    :class:`SequenceShard` of ``cp``; nothing at ``cp.size == 1``. Returns the model.

    Raises:
        ValueError: an unknown mode, or ``cp > 1`` for a model whose plan names no
            attention modules.
    """
    shard = SequenceShard(cp, mode)        # checks the mode at any size
    if cp.size == 1:
        return model
    plan = plan or plan_of(model)
    if not plan.attention:
        raise ValueError(f"{type(model).__name__} has no context-parallel plan (its "
                         f"parallel_plan() names no attention modules); use cp=1")
    model.sequence = shard
    for pattern in plan.attention:
        for _, module in matching_modules(model, pattern):
            module.sequence = shard
    return model

"""A pipeline rank's model chunks under the interleaved schedule, as one module.

    mpiexec -n 2 python -m mpi4py -m mpishard train --pp 2 --micro-steps 4 \
        --pipeline-schedule interleaved --virtual-stages 2 --strategy zero1

With ``p`` pipeline ranks and ``V`` chunks per rank the model's blocks are cut
into ``p V`` equal stages (:func:`chunk_blocks`) and rank ``r`` holds stages
``r, r + p, ...`` (see [Note: interleaved order] in order.py). Each chunk is
the model's own ``pipeline_stage`` (see [Note: pipeline stage interface] in
mpishard/nn/sharding.py); :class:`ModelChunks` holds the ``V`` of them.

[Note: one strategy over the chunks]
One strategy (DataParallel or ZeRO) wraps one :class:`ModelChunks`, not one
strategy per chunk: the rank's parameters then form one set, so gradient
buckets and ZeRO's units, the one global-norm all-reduce of clipping and the
non-finite check, mixed precision's masters and the checkpoint pieces are
those of a plain stage, unchanged (a strategy per chunk would take its own
norm and skip decision, and its own checkpoint pieces, per chunk). That needs
the module's parameters under
their global names: the module tree of :class:`ModelChunks` is the union of its
chunks' trees (``transformer.h.0`` of chunk 0 beside ``transformer.h.4`` of
chunk 1 in one ``transformer.h``), built from new containers where chunks
meet and the chunks' own modules below, while the chunks themselves stay
unregistered (a plain list) and run their own forwards. ``forward(...,
chunk=c)`` runs chunk ``c``, so the strategy's forward hooks run once per
chunk call. Under ZeRO-3 each block unit is gathered around its own chunk's
forward and backward as in a plain stage; the root unit (the embeddings and
the head, the parameters outside the blocks) is gathered at the first chunk
call of a step and stays so until the step's gradients are reduced, taking
one chunk's forward in the middle of another's backward (see [Note: unit
training state] in mpishard/parallel/zero/stage3.py).
"""
from __future__ import annotations

from mpishard.nn.module import Module, ModuleDict
from mpishard.nn.sharding import ShardingPlan, plan_of

__all__ = ["ModelChunks", "chunk_blocks"]


def chunk_blocks(n_layer: int, stages: int, chunks: int) -> list:
    """The blocks of each of the ``stages x chunks`` interleaved stages, equal runs in order
    (stage ``r + c * stages`` is chunk ``c`` of pipeline rank ``r``).

    Raises:
        ValueError: ``n_layer`` does not split into ``stages x chunks`` equal chunks of
            at least one block.
    """
    n = stages * chunks
    if n_layer % n:
        raise ValueError(f"n_layer = {n_layer} blocks do not split into pp x virtual_stages "
                         f"= {stages} x {chunks} = {n} equal chunks; use a number of layers "
                         f"that is a multiple of {n}, or another pp or virtual_stages")
    size = n_layer // n
    return [range(k * size, (k + 1) * size) for k in range(n)]


def _union(trees: list) -> Module:
    """One module whose tree holds every module of ``trees`` under its own path: a path
    only one tree has is that tree's module itself; one several have becomes a new
    container of the union of their children (in first-seen order)."""
    node = ModuleDict() if all(isinstance(t, ModuleDict) for t in trees) else Module()
    names = []
    for tree in trees:
        for name in tree._parameters:
            if name in node._parameters:
                raise ValueError(f"parameter {name!r} is held by two model chunks; a chunk's "
                                 f"parameters outside its blocks must not repeat")
            setattr(node, name, tree._parameters[name])
        names += [n for n in tree._modules if n not in names]
    for name in names:
        holders = [tree._modules[name] for tree in trees if name in tree._modules]
        setattr(node, name, holders[0] if len(holders) == 1 else _union(holders))
    return node


class ModelChunks(Module):
    """This pipeline rank's ``V`` model chunks under their global parameter names.

    Answers the stage interface of one stage (see [Note: pipeline stage interface]):
    ``first_stage`` when it holds the model's first stage (chunk 0 of rank 0),
    ``last_stage`` the last (chunk ``V - 1`` of the last rank); ``forward(...,
    chunk=c)`` runs chunk ``c``. See [Note: one strategy over the chunks].

    Args:
        chunks: the chunks in order, each a stage of the same model (its own
            ``pipeline_stage``), tensor-parallel layers already applied.
    """

    def __init__(self, chunks):
        super().__init__()
        chunks = list(chunks)
        if len(chunks) < 2:
            raise ValueError(f"ModelChunks needs at least 2 chunks, got {len(chunks)}")
        self.chunks = chunks              # a list: not registered (names come from the union)
        union = _union(chunks)
        for name, p in union._parameters.items():
            setattr(self, name, p)
        for name, module in union._modules.items():
            setattr(self, name, module)
        head = chunks[0]
        self.first_stage = getattr(head, "first_stage", True)
        self.last_stage = getattr(chunks[-1], "last_stage", True)
        for attr in ("config", "backend", "seed", "dtype", "sequence", "sequence_parallel_size"):
            if hasattr(head, attr):       # what every chunk has alike
                setattr(self, attr, getattr(head, attr))

    @property
    def virtual_stages(self) -> int:
        """``V``, the chunks this rank holds."""
        return len(self.chunks)

    def parallel_plan(self) -> ShardingPlan:
        """The chunks' plan: the model's, with every chunk's units in chunk order."""
        plans = [plan_of(chunk) for chunk in self.chunks]
        return ShardingPlan(tensor=plans[0].tensor,
                            units=tuple(u for plan in plans for u in plan.units),
                            pipeline=plans[0].pipeline, tied=plans[0].tied,
                            attention=plans[0].attention,
                            sequence_entry=plans[0].sequence_entry)

    def forward(self, inputs, targets=None, batch_size=None, chunk: int = 0):
        """Chunk ``chunk``'s forward (the stage interface's ``forward``)."""
        if not 0 <= chunk < len(self.chunks):
            raise ValueError(f"chunk {chunk} out of range for {len(self.chunks)} chunks")
        if getattr(self.chunks[chunk], "last_stage", True):
            return self.chunks[chunk](inputs, targets, batch_size=batch_size)
        return self.chunks[chunk](inputs, batch_size=batch_size)

    def activation_shape(self, batch_size: int, seq_len: int) -> tuple:
        """What one chunk hands the next (every chunk alike)."""
        return self.chunks[0].activation_shape(batch_size, seq_len)

    def chunk_activation_bytes(self, batch_size: int, seq_len: int, dtype="float32") -> list:
        """Bytes one micro-batch's forward keeps for backward, per chunk."""
        return [chunk.activation_bytes(batch_size, seq_len, dtype) for chunk in self.chunks]

    def activation_bytes(self, batch_size: int, seq_len: int, dtype="float32",
                         lean: bool | None = None) -> int:
        """Bytes one micro-batch keeps for backward through every chunk of this rank
        (``lean``: as the model's)."""
        return sum(chunk.activation_bytes(batch_size, seq_len, dtype, lean=lean)
                   for chunk in self.chunks)

    def train(self, mode: bool = True) -> "ModelChunks":
        """Training or evaluation mode for every chunk (their roots are not in the tree)."""
        super().train(mode)
        for chunk in self.chunks:
            chunk.train(mode)
        return self

    def set_activation_checkpointing(self, enabled=True) -> "ModelChunks":
        """Every chunk's (see the model's ``set_activation_checkpointing``)."""
        for chunk in self.chunks:
            chunk.set_activation_checkpointing(enabled)
        return self

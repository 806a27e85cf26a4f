"""What a rank holds, as pieces of global tensors: the interface checkpoints use.

[Note: pieces]
A :class:`Piece` is a 1-D run of elements this rank owns of one global tensor
(a parameter, or one optimizer state of that parameter), together with where
those elements sit in the global tensor: ``runs``, intervals of the global
row-major flat index (:meth:`mpishard.nn.ShardSpec.global_runs`). Saving writes
each piece's array and runs; loading asks, for each piece the *new* layout
needs, for the elements of its runs, wherever the old layout kept them. A
tensor replicated over dp is owned (saved) by dp rank 0 only. Strategies
produce and consume pieces; nothing outside reads their buffers directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from mpishard.core.backend import to_numpy, xp_of

__all__ = ["Piece", "TargetSlices", "pieces_of", "replicated_pieces", "unit_pieces",
           "load_pieces", "gather_full_params"]


@dataclass
class Piece:
    """One owned run of one global tensor.

    Attributes:
        name: the parameter's name (``transformer.h.0.mlp.c_fc.weight``).
        kind: ``"param"`` or an optimizer state name (``"exp_avg"``, ...).
        global_shape: shape of the whole tensor.
        dtype: dtype name.
        runs: ``(start, stop)`` intervals of the global flat index, in the
            order of ``array``'s elements.
        array: a 1-D view into this rank's storage (writes land in place).
        owner: whether this rank is the one that saves it: exactly one rank
            owns each element (see [Note: counted once] in strategy.py; a dp
            replica is owned by dp rank 0, a tp-replicated tensor by tp rank 0,
            a tied copy on another pipeline stage by nobody). Non-owned pieces
            are still loaded.
    """

    name: str
    kind: str
    global_shape: tuple
    dtype: str
    runs: list
    array: object
    owner: bool = True

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.runs)


class TargetSlices:
    """One element range of an optimizer target, as pieces: its values and every state
    the optimizer keeps for it (allocated here, so each state has its array).

    Args:
        optimizer: the optimizer whose targets these are, or ``None`` (values only).
    """

    def __init__(self, optimizer=None):
        self.optimizer = optimizer
        self.index: dict = {}        # id(target) -> its index in optimizer.params
        if optimizer is not None:
            optimizer.allocate_state()
            self.index = {id(t): i for i, t in enumerate(optimizer.params)}

    def pieces(self, name: str, spec, target, span: tuple, runs: list,
               owner: bool) -> list[Piece]:
        """Elements ``span = (lo, hi)`` of ``target`` (flat), which hold the ``runs`` of
        parameter ``name`` (shard spec ``spec``): a ``"param"`` piece and one per state."""
        lo, hi = span
        views = {"param": target.data.reshape(-1)[lo:hi]}
        if id(target) in self.index:
            state = self.optimizer.state[self.index[id(target)]]
            views.update({kind: arr[lo:hi] for kind, arr in state.items()})
        return [Piece(name, kind, spec.global_shape, spec.dtype, runs, arr, owner)
                for kind, arr in views.items()]


def replicated_pieces(strategy, optimizer=None) -> list[Piece]:
    """Pieces of a model every dp rank holds whole: each parameter (through
    ``strategy.optimizer_target``, the float32 master under mixed precision)
    and its optimizer state, owned by dp rank 0."""
    slices = TargetSlices(optimizer)
    pieces: list[Piece] = []
    for name, p in strategy.module.named_parameters():
        owner = strategy.replica_group(p).rank == 0 and strategy.counts_once(p.spec)
        target = strategy.optimizer_target(p)
        pieces += slices.pieces(name, p.spec, target, (0, target.data.size),
                                p.spec.global_runs(), owner)
    return pieces


def unit_pieces(strategy, units, optimizer=None) -> list[Piece]:
    """Pieces of flat units (ZeRO): for each unit, this rank's slice of every
    parameter in it (``unit.target``, a :class:`FlatShard`) and of its state."""
    slices = TargetSlices(optimizer)
    pieces: list[Piece] = []
    replicate = getattr(strategy, "replicate", None)   # hybrid sharding: replica 0 owns
    first_replica = replicate is None or replicate.rank == 0
    for unit in units:
        layout = unit.layout
        for i, (name, p) in enumerate(zip(layout.names, layout.params)):
            lo, hi = layout.shard_range_of(i)
            if hi <= lo:
                continue
            owner = first_replica and strategy.counts_once(p.spec)
            pieces += slices.pieces(name, p.spec, unit.target, (lo, hi),
                                    p.spec.global_runs(p.spec.flat.owned), owner)
    return pieces


def pieces_of(strategy, optimizer=None) -> list[Piece]:
    """``strategy.pieces(optimizer)``: every piece this rank holds (see [Note: pieces])."""
    return strategy.pieces(optimizer)


def gather_full_params(strategy) -> dict:
    """Name -> whole parameter as a host NumPy array, on every rank.

    Collective over the mesh's world; every element comes from the one rank
    that owns it. Pickles whole tensors: for tests and small models (checkpoints
    stream pieces instead).
    """
    owned = [(p.name, p.global_shape, p.runs, to_numpy(p.array)) for p in strategy.pieces()
             if p.kind == "param" and p.owner]
    full: dict = {}
    for rank_pieces in strategy.mesh.world.all_gather_obj(owned):
        for name, shape, runs, values in rank_pieces:
            flat = full.setdefault(name, np.zeros(shape, values.dtype)).reshape(-1)
            pos = 0
            for a, b in runs:
                flat[a:b] = values[pos:pos + b - a]
                pos += b - a
    return full


def load_pieces(strategy, optimizer, read: Callable[[str, str, list, str], np.ndarray]) -> None:
    """Fill every piece this rank holds from ``read(name, kind, runs, dtype) -> 1-D array``,
    then let the strategy finish (``after_load``: ZeRO-1/2 re-gather full parameters,
    mixed precision casts the loaded masters into the compute copies)."""
    for piece in strategy.pieces(optimizer):
        values = read(piece.name, piece.kind, piece.runs, piece.dtype)
        if values.size != piece.array.size:
            raise ValueError(f"{piece.name} ({piece.kind}): read {values.size} elements, "
                             f"the piece holds {piece.array.size}")
        piece.array[...] = xp_of(piece.array).asarray(values, dtype=piece.array.dtype)
    strategy.after_load()

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

__all__ = ["Piece", "pieces_of", "replicated_pieces", "unit_pieces", "load_pieces",
           "gather_full_params"]


@dataclass
class Piece:
    """One owned run of one global tensor.

    Attributes:
        name: the parameter's name (``transformer.h.0.attn.c_attn.weight``).
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


def _state_views(optimizer, target_index: int, lo: int, hi: int) -> dict:
    if optimizer is None:
        return {}
    state = optimizer.state[target_index]
    return {name: arr[lo:hi] for name, arr in state.items()}


def replicated_pieces(strategy, optimizer=None) -> list[Piece]:
    """Pieces of a model every dp rank holds whole: each parameter (through
    ``strategy.optimizer_target``, the float32 master under mixed precision)
    and its optimizer state, owned by dp rank 0."""
    index = _target_index(optimizer)
    pieces: list[Piece] = []
    for name, p in strategy.module.named_parameters():
        owner = strategy.replica_group(p).rank == 0 and strategy.counts_once(p.spec)
        target = strategy.optimizer_target(p)
        flat = target.data.reshape(-1)
        views = {"param": flat}
        if id(target) in index:
            views.update(_state_views(optimizer, index[id(target)], 0, flat.size))
        pieces.extend(Piece(name, kind, p.spec.global_shape, p.spec.dtype,
                            p.spec.global_runs(), arr, owner) for kind, arr in views.items())
    return pieces


def unit_pieces(strategy, units, optimizer=None) -> list[Piece]:
    """Pieces of flat units (ZeRO): for each unit, this rank's slice of every
    parameter in it (``unit.target``, a :class:`FlatShard`) and of its state."""
    index = _target_index(optimizer)
    pieces: list[Piece] = []
    replicate = getattr(strategy, "replicate", None)   # hybrid sharding: replica 0 owns
    first_replica = replicate is None or replicate.rank == 0
    for unit in units:
        target, layout = unit.target, unit.layout
        for i, (name, p) in enumerate(zip(layout.names, layout.params)):
            lo, hi = layout.shard_range_of(i)
            if hi <= lo:
                continue
            views = {"param": target.data[lo:hi]}
            if id(target) in index:
                views.update(_state_views(optimizer, index[id(target)], lo, hi))
            owner = first_replica and strategy.counts_once(p.spec)
            runs = p.spec.global_runs(p.spec.flat.owned)
            pieces.extend(Piece(name, kind, p.spec.global_shape, p.spec.dtype, runs, arr, owner)
                          for kind, arr in views.items())
    return pieces


def pieces_of(strategy, optimizer=None) -> list[Piece]:
    """``strategy.pieces(optimizer)``: every piece this rank holds (see [Note: pieces])."""
    return strategy.pieces(optimizer)


def _target_index(optimizer) -> dict:
    if optimizer is None:
        return {}
    optimizer.allocate_state()
    return {id(t): i for i, t in enumerate(optimizer.params)}


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

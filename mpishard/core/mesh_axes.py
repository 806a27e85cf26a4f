"""The mesh's axes and the groups derived from them: one table, free of MPI.

    shape = MeshShape(dp_shard=2, cp=2, tp=2, world_rank=5)
    shape.dp_cp.size, shape.dp_cp.rank, shape.dp_cp.name     # 4, 2, "dp_cp"
    shape.active_names()                                     # ["dp", "cp", "dp_cp", "tp"]

:class:`~mpishard.comm.Mesh` splits one communicator per group of
:data:`MESH_GROUPS` by the colours and keys a :class:`MeshShape` gives it; the
layout planner builds pipeline stages over a :class:`MeshShape` itself (sizes,
one rank's coordinates, every group's size, index and communicator name); the
cost model asks a group whether its ranks are on several nodes. See [Note: mesh
layout] in comm/mesh.py for the order and the groups.

Kept free of MPI so that planning (and the checkpoint tools that import it)
never starts MPI.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

__all__ = ["MESH_AXES", "EXPERT_AXES", "MESH_GROUPS", "GROUPS_OUTERMOST_FIRST", "MeshGroup",
           "MeshShape"]

#: The axes, outermost first: ``world_rank = (((pp R + dp_replicate) S + dp_shard) CP + cp) TP + tp``.
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
#: The same rank order with ``dp_shard x cp`` cut into ``edp_shard x ep`` (experts).
EXPERT_AXES = ("pp", "dp_replicate", "edp_shard", "ep", "tp")
#: Every group of a mesh and the axes it spans, in the order a mesh creates them: a
#: group over the same ranks as an earlier one shares its communicator and name.
MESH_GROUPS = {
    "tp": ("tp",),
    "cp": ("cp",),
    "pp": ("pp",),
    "dp": ("dp_replicate", "dp_shard"),              # the ranks reading different data
    "dp_replicate": ("dp_replicate",),
    "dp_shard": ("dp_shard",),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),     # every rank holding the same parameters
    "dp_shard_cp": ("dp_shard", "cp"),               # what ZeRO shards over
    "ep": ("ep",),                                   # the ranks splitting a layer's experts
    "edp": ("dp_replicate", "edp_shard"),            # every rank holding the same experts
    "edp_shard": ("edp_shard",),                     # what ZeRO shards experts over
}
#: The groups outermost first (the order :meth:`Mesh.active_axes` lists them in).
GROUPS_OUTERMOST_FIRST = ("pp", "dp_replicate", "dp_shard", "dp", "cp", "dp_shard_cp",
                          "dp_cp", "ep", "edp_shard", "edp", "tp")


def _expert_axes_as_plain(ep: int, cp: int, dp_shard: int) -> dict:
    """The expert axes ``ep`` and ``edp_shard`` as plain axes where they are the same
    ranks (so that their groups share those communicators), else ``{}``.

    The ``dp_shard x cp`` ranks form blocks of ``ep`` consecutive ranks: with
    ``ep = 1`` a block is one rank, with ``ep = cp`` a cp group, with ``ep =
    dp_shard x cp`` the whole group.
    """
    return {1: {"ep": (), "edp_shard": ("dp_shard", "cp")},
            cp: {"ep": ("cp",), "edp_shard": ("dp_shard",)},
            dp_shard * cp: {"ep": ("dp_shard", "cp"), "edp_shard": ()}}.get(ep, {})


@dataclass(frozen=True)
class MeshGroup:
    """One group of a mesh as one rank sees it, without a communicator.

    Attributes:
        name: the name its communicator carries: the first group of
            :data:`MESH_GROUPS` over the same ranks (its own, with one rank).
        size: ranks in the group.
        rank: this rank's index in it (the key a split orders the ranks by).
        color: which group of its kind this rank's is (the colour of a split).
        first_world_rank, last_world_rank: its lowest and highest world rank.
        steps: ``(stride, size)`` in world ranks of each axis it spans: its ranks are
            ``first_world_rank + sum(k * stride)`` over ``0 <= k < size``.
    """

    name: str
    size: int
    rank: int
    color: int
    first_world_rank: int
    last_world_rank: int
    steps: tuple = ()

    def spans_nodes(self, ranks_per_node: int) -> bool:
        """Whether its ranks are on two nodes or more, with ranks placed on nodes in
        blocks of ``ranks_per_node``."""
        return self.first_world_rank // ranks_per_node != self.last_world_rank // ranks_per_node

    def world_ranks(self) -> list:
        """Its ranks' world ranks, ascending."""
        ranks = [self.first_world_rank]
        for stride, size in self.steps:
            ranks = [r + k * stride for r in ranks for k in range(size)]
        return sorted(ranks)

    def fewest_ranks_on_a_node(self, ranks_per_node: int) -> int:
        """The fewest of its ranks on any node it has ranks on (ranks placed on nodes in
        blocks of ``ranks_per_node``): a ring over it crosses every node it touches, so
        the node with the fewest sets the NICs it crosses on (see [Note: rails] in
        mpishard/planning/machine.py)."""
        return min(Counter(r // ranks_per_node for r in self.world_ranks()).values())


class MeshShape:
    """A mesh's sizes and one rank's place in it: every group of :data:`MESH_GROUPS` as a
    :class:`MeshGroup` attribute (``shape.tp``, ``shape.dp_cp``, ...), as a
    :class:`~mpishard.comm.Mesh` has them as communicators.

    Args:
        pp, dp_replicate, dp_shard, cp, tp: the axis sizes.
        ep: expert-parallel size, dividing ``dp_shard x cp``.
        world_rank: the rank whose coordinates and groups these are.

    Raises:
        ValueError: a size that is not a positive int, an ``ep`` that does not divide
            ``dp_shard x cp``, or a ``world_rank`` outside the mesh.
    """

    def __init__(self, pp: int = 1, dp_replicate: int = 1, dp_shard: int = 1, cp: int = 1,
                 tp: int = 1, ep: int = 1, world_rank: int = 0):
        given = dict(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep)
        for axis, n in given.items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"mesh {axis}={n!r} must be a positive int")
        if (dp_shard * cp) % ep:
            raise ValueError(f"mesh ep={ep} must divide dp_shard x cp = {dp_shard} x {cp}; "
                             f"pass an ep that divides {dp_shard * cp}")
        self.world_size = pp * dp_replicate * dp_shard * cp * tp
        if not 0 <= world_rank < self.world_size:
            raise ValueError(f"world rank {world_rank} is outside a mesh of "
                             f"{self.world_size} ranks; use 0 <= world_rank < {self.world_size}")
        #: every axis's size, the expert axes too
        self.sizes = {**given, "edp_shard": dp_shard * cp // ep}
        r, S = world_rank, dp_shard
        c = {"tp": r % tp, "cp": (r // tp) % cp, "dp_shard": (r // (tp * cp)) % S,
             "dp_replicate": (r // (tp * cp * S)) % dp_replicate,
             "pp": r // (tp * cp * S * dp_replicate)}
        c["dp"] = c["dp_replicate"] * S + c["dp_shard"]
        inner = c["dp_shard"] * cp + c["cp"]          # place in dp_shard x cp
        c["ep"], c["edp_shard"] = inner % ep, inner // ep
        #: this rank's coordinate on every axis, and its index ``dp`` in ``dp_replicate x dp_shard``
        self.coords = c
        #: group name -> :class:`MeshGroup`, in the order of :data:`MESH_GROUPS`
        self.groups = {}
        named: dict = {}
        same = _expert_axes_as_plain(ep, cp, S)
        for name, axes in MESH_GROUPS.items():
            axes = tuple(b for a in axes for b in same.get(a, (a,)))
            members = tuple(a for a in axes if self.sizes[a] > 1)
            label = named.setdefault(members, name) if members else name
            self.groups[name] = self._group(label, axes, world_rank)
            setattr(self, name, self.groups[name])

    def _group(self, name: str, axes: tuple, world_rank: int) -> MeshGroup:
        sizes, c = self.sizes, self.coords
        order = EXPERT_AXES if {"ep", "edp_shard"} & set(axes) else MESH_AXES
        color, key, size = 0, 0, 1
        low, high, stride, steps = world_rank, world_rank, 1, []
        for a in reversed(order):        # innermost first: each axis's stride in world ranks
            if a in axes:
                low -= c[a] * stride
                high += (sizes[a] - 1 - c[a]) * stride
                steps.append((stride, sizes[a]))
            stride *= sizes[a]
        for a in order:
            if a not in axes:
                color = color * sizes[a] + c[a]
        for a in axes:
            key = key * sizes[a] + c[a]
            size *= sizes[a]
        return MeshGroup(name, size, key, color, low, high, tuple(steps))

    def active_names(self) -> list:
        """The communicator names of the groups with more than one rank, outermost
        first, each once (as :meth:`Mesh.active_axes` lists them)."""
        out = []
        for name in GROUPS_OUTERMOST_FIRST:
            group = self.groups[name]
            if group.size > 1 and group.name not in out:
                out.append(group.name)
        return out

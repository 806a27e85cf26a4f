"""The device mesh: named parallel axes as sub-communicators.

    world = Communicator.from_env(MPI.COMM_WORLD)
    mesh = Mesh(world, tp=2)               # dp inferred: world.size // 2
    mesh.tp.all_reduce(partial)            # within a tensor-parallel group
    mesh.dp_cp.all_reduce(grads)           # over every replica of the parameters
    mesh = Mesh(world, dp_replicate=2, cp=2)   # hybrid sharding x context parallel

[Note: mesh layout]
Five axes, outermost first: ``pp x dp_replicate x dp_shard x cp x tp``::

    world_rank = (((pp * R + dp_replicate) * S + dp_shard) * CP + cp) * TP + tp

(``R``, ``S``, ``CP``, ``TP`` the axis sizes). ``tp`` is innermost, then
``cp``, then ``dp_shard``: with the usual block placement of ranks on nodes a
tensor-parallel group shares a node first (it communicates every layer), then
a context-parallel ring, then a ZeRO shard group; ``dp_replicate`` crosses
nodes (one gradient all-reduce per step) and pipeline stages are outermost
(point-to-point only). ``dp = dp_replicate x dp_shard`` is the data axis: each
of its ranks reads different batches, and ``--dp`` is its size.

Derived groups (the same ranks as an axis reuse that axis's communicator; the
one table of axes and groups, free of MPI, is :mod:`mpishard.core.mesh_axes`):

- ``dp``: ``dp_replicate x dp_shard``, the ranks that read different data.
- ``dp_cp``: ``dp x cp``, every rank holding the same parameters (the same
  ``pp`` stage and ``tp`` slice): DDP averages gradients over it, and the loss
  is normalised over it.
- ``dp_shard_cp``: ``dp_shard x cp``, the group ZeRO shards over (context
  ranks hold the same parameters, so they share the shards as torchtitan does);
  ``dp_replicate`` then averages the shards across replicas (hybrid sharding).

Expert parallelism (``ep``) is carved out of ``dp_shard x cp``, as in torchtitan
and Megatron: that group's ``dp_shard * CP`` ranks, in the order above, form
``dp_shard * CP / ep`` consecutive blocks of ``ep`` ranks. Two groups follow:

- ``ep``: one such block, the ranks that split a layer's experts between them
  and exchange tokens (all-to-all);
- ``edp``: every rank of ``dp_cp`` holding the same experts (the same place in
  its block): expert gradients are averaged over it and ZeRO shards expert
  state over ``edp_shard``, its part inside ``dp_shard x cp``.

With ``ep == cp`` these are the ``cp`` and ``dp_shard`` groups (and share their
communicators); with ``ep = 1``, ``edp`` is ``dp_cp``.

Checkpoints, pipeline schedules and reports that need "which world rank holds
these coordinates" call :meth:`Mesh.world_rank` rather than re-deriving this.
Nodes are detected with ``COMM_TYPE_SHARED`` (:func:`ranks_per_node`);
``MPISHARD_RANKS_PER_NODE`` overrides it, to emulate several nodes on one.
"""
from __future__ import annotations

import os

from mpi4py import MPI

from mpishard.comm.communicator import Communicator
from mpishard.core.mesh_axes import GROUPS_OUTERMOST_FIRST, MESH_GROUPS, MeshShape

__all__ = ["Mesh", "ranks_per_node", "node_of"]


def _describe(sizes: dict) -> str:
    shown = [f"{axis}={n}" for axis, n in sizes.items() if n != 1 or axis == "dp"]
    product = 1
    for n in sizes.values():
        product *= n
    return f"{' x '.join(shown)} = {product}"


def ranks_per_node(world: Communicator, environ=None) -> int:
    """Ranks per node: ``MPISHARD_RANKS_PER_NODE`` if set, else the size of this
    rank's shared-memory group (collective over ``world`` unless the variable is set)."""
    env = os.environ if environ is None else environ
    value = env.get("MPISHARD_RANKS_PER_NODE", "").strip()
    if value:
        if not value.isdigit() or int(value) < 1 or world.size % int(value):
            raise ValueError(f"MPISHARD_RANKS_PER_NODE={value!r} must be a positive integer "
                             f"that divides the world size {world.size}")
        return int(value)
    if world.size == 1:
        return 1
    local = world.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    try:
        sizes = set(world.mpi.allgather(local.Get_size()))
    finally:
        local.Free()
    return min(sizes)


def node_of(world_rank: int, per_node: int) -> int:
    """The node a world rank is on with block placement of ``per_node`` ranks a node."""
    return world_rank // per_node


class Mesh:
    """Named axes ``pp x dp_replicate x dp_shard x cp x tp`` over a world communicator.

    Construction is collective over ``world`` (one ``Split`` per distinct
    group). Sizes are checked before any communication, so a mesh that does not
    fit raises the same ValueError on every rank instead of hanging.

    Args:
        world: the :class:`Communicator` to divide.
        dp: data-parallel size ``dp_replicate x dp_shard``; ``None`` infers it
            from the world size.
        tp, cp, pp: tensor-, context- and pipeline-parallel sizes.
        dp_replicate: replicas of the sharded state (hybrid sharding; default 1).
        dp_shard: ranks sharing one copy of it (default ``dp // dp_replicate``).
        ep: expert-parallel size, dividing ``dp_shard x cp`` (see [Note: mesh layout]).

    Raises:
        TypeError: ``world`` is not a Communicator.
        ValueError: an unknown axis, a size that is not a positive int, or sizes
            whose product is not the world size.
    """

    def __init__(self, world: Communicator, dp: int | None = None, tp: int = 1,
                 pp: int = 1, cp: int = 1, dp_replicate: int | None = None,
                 dp_shard: int | None = None, ep: int = 1, **unknown):
        if not isinstance(world, Communicator):
            raise TypeError(f"Mesh needs a mpishard Communicator, got {type(world).__name__}; "
                            f"wrap it: Mesh(Communicator(MPI.COMM_WORLD), ...)")
        if unknown:
            raise ValueError(f"unknown mesh axis {sorted(unknown)[0]!r}; the axes are "
                             f"pp, dp_replicate, dp_shard, cp and tp (dp = dp_replicate "
                             f"x dp_shard)")
        given = dict(dp=dp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp)
        for axis, n in given.items():
            if n is None and axis in ("dp", "dp_replicate", "dp_shard"):
                continue
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"mesh {axis}={n!r} must be a positive int")
        R, S = _data_sizes(world.size, dp, dp_replicate, dp_shard, tp, cp, pp)
        if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1 or (S * cp) % ep:
            raise ValueError(f"mesh ep={ep!r} must be a positive int dividing dp_shard x cp "
                             f"= {S} x {cp} = {S * cp} (experts are split over ranks that "
                             f"read different tokens); pass an ep that divides {S * cp}")
        self.world = world
        self.shape = {"pp": pp, "dp": R * S, "tp": tp, "dp_replicate": R, "dp_shard": S,
                      "cp": cp, "ep": ep}
        shape = MeshShape(pp=pp, dp_replicate=R, dp_shard=S, cp=cp, tp=tp, ep=ep,
                          world_rank=world.rank)
        self.coords = shape.coords
        # One communicator per group of MESH_GROUPS, in its order: the first group over
        # some ranks splits them, later ones over the same ranks reuse it (and its name:
        # the data axis is "dp" unless both of its parts are real).
        made: dict = {}
        for attr, group in shape.groups.items():
            if group.name not in made:
                made[group.name] = (world.split(group.color, key=group.rank, name=group.name)
                                    if group.size > 1 else world.single(group.name))
            setattr(self, attr, made[group.name])
        self._groups = list(made.values())

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def cp_rank(self) -> int:
        return self.coords["cp"]

    def axis(self, name: str) -> Communicator:
        """The communicator of axis or group ``name`` (``"dp"``, ``"tp"``, ``"cp"``, ...)."""
        if name not in MESH_GROUPS:
            raise ValueError(f"mesh has no axis {name!r}; the axes are pp, dp_replicate, "
                             f"dp_shard, cp and tp, with the groups dp, dp_cp, dp_shard_cp, "
                             f"ep, edp and edp_shard")
        return getattr(self, name)

    def active_axes(self) -> dict:
        """``{name: communicator}`` of the distinct groups with more than one rank,
        outermost first (each communicator once, under its own name)."""
        out = {}
        for attr in GROUPS_OUTERMOST_FIRST:
            comm = getattr(self, attr)
            if comm.size > 1 and comm.name not in out:
                out[comm.name] = comm
        return out

    def world_rank(self, *, pp: int = 0, dp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """The world rank at coordinates ``(pp, dp, cp, tp)`` ([Note: mesh layout]);
        ``dp`` is ``dp_replicate * dp_shard_size + dp_shard``."""
        for axis, i in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)):
            if not 0 <= i < self.shape[axis]:
                raise ValueError(f"mesh coordinate {axis}={i} is out of range; "
                                 f"use 0 <= {axis} < {self.shape[axis]}")
        s = self.shape
        return ((pp * s["dp"] + dp) * s["cp"] + cp) * s["tp"] + tp

    def group_members(self) -> dict:
        """``{name: world ranks of this rank's group}`` for every active group (collective)."""
        return {name: tuple(comm.all_gather_obj(self.world.rank))
                for name, comm in self.active_axes().items()}

    def describe_groups(self) -> list[str]:
        """One line per active group: its name, size and this rank's members (collective)."""
        return [f"{name} (size {len(members)}): world ranks {list(members)}"
                for name, members in self.group_members().items()]

    def free(self) -> None:
        """Free the axis communicators (collective)."""
        for comm in self._groups:
            comm.free()

    def __repr__(self) -> str:
        s = self.shape
        return (f"Mesh(pp={s['pp']}, dp_replicate={s['dp_replicate']}, "
                f"dp_shard={s['dp_shard']}, cp={s['cp']}, tp={s['tp']}"
                + (f", ep={s['ep']}" if s["ep"] > 1 else "") + "; "
                f"rank {self.world.rank} at {self.coords})")


def _data_sizes(world_size: int, dp, dp_replicate, dp_shard, tp: int, cp: int,
                pp: int) -> tuple:
    """``(dp_replicate, dp_shard)`` from the sizes given; ValueError naming the fix."""
    model = {"tp": tp, "cp": cp, "pp": pp}
    model_ranks = tp * cp * pp
    shown = " x ".join(f"{a}={n}" for a, n in model.items() if n > 1) or "tp=1"
    if dp is not None and dp * model_ranks != world_size:
        sizes = {"dp": dp, **{a: n for a, n in model.items() if n > 1}}
        raise ValueError(f"mesh {_describe(sizes)} does not match world size {world_size}; "
                         f"pass sizes whose product is {world_size} (or leave dp out to "
                         f"infer it)")
    if model_ranks > world_size:
        raise ValueError(f"mesh {shown} = {model_ranks} exceeds the world size "
                         f"{world_size}; launch at least {model_ranks} ranks "
                         f"(mpiexec -n {model_ranks}) or lower tp, cp and pp")
    if world_size % model_ranks:
        raise ValueError(f"mesh {shown} = {model_ranks} does not divide world size "
                         f"{world_size}; pass tp, cp and pp whose product divides "
                         f"{world_size} (dp is inferred as world size / (tp * cp * pp))")
    if dp is None:
        dp = (dp_replicate or 1) * dp_shard if dp_shard is not None else \
            world_size // model_ranks
    if dp * model_ranks != world_size:
        sizes = {"dp": dp, **{a: n for a, n in model.items() if n > 1}}
        raise ValueError(f"mesh {_describe(sizes)} does not match world size {world_size}; "
                         f"pass sizes whose product is {world_size} (or leave dp out to "
                         f"infer it)")
    R = dp_replicate if dp_replicate is not None else (
        dp // dp_shard if dp_shard is not None and dp % dp_shard == 0 else 1)
    S = dp_shard if dp_shard is not None else (dp // R if dp % R == 0 else None)
    if S is None or R * S != dp:
        what = f"dp_replicate={R} x dp_shard={S} is not" if S is not None else \
            f"dp_replicate={R} does not divide"
        raise ValueError(f"mesh {what} dp={dp}; pass a dp_replicate that divides {dp} "
                         f"(dp_shard = dp / dp_replicate)")
    return R, S

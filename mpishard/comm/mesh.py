"""The device mesh: named parallel axes as sub-communicators.

    world = Communicator.from_env(MPI.COMM_WORLD)
    mesh = Mesh(world, tp=2)          # dp inferred: world.size // 2
    mesh.tp.all_reduce(partial)       # within a tensor-parallel group
    mesh.dp.reduce_scatter(grads)     # across data-parallel replicas

[Note: mesh layout]
World ranks are laid out with ``tp`` innermost, then ``dp``, then ``pp``
outermost (Megatron-LM's order)::

    world_rank = (pp_rank * dp + dp_rank) * tp + tp_rank

so the ranks of one tensor-parallel group are consecutive and, with the usual
block placement of ranks on nodes, share a node (tensor parallelism
communicates every layer; it needs the fastest links). Pipeline stages are the
outermost, slowest-varying axis. Checkpoints, pipeline schedules and reports
that need "which world rank holds (pp, dp, tp)" call :meth:`Mesh.world_rank`
rather than re-deriving this formula.
"""
from __future__ import annotations

from .communicator import Communicator

__all__ = ["Mesh", "MESH_AXES"]

#: Axis names, outermost first.
MESH_AXES = ("pp", "dp", "tp")


def _describe(sizes: dict) -> str:
    shown = [f"{axis}={n}" for axis, n in sizes.items() if n != 1 or axis == "dp"]
    product = 1
    for n in sizes.values():
        product *= n
    return f"{' x '.join(shown)} = {product}"


class Mesh:
    """Named axes ``pp x dp x tp`` over a world communicator.

    Construction is collective over ``world`` (three ``Split`` calls). Sizes are
    checked before any communication, so a mesh that does not fit raises the
    same ValueError on every rank instead of hanging.

    Args:
        world: the :class:`Communicator` to divide.
        dp: data-parallel size; ``None`` infers ``world.size // (tp * pp)``.
        tp: tensor-parallel size (innermost, see [Note: mesh layout]).
        pp: pipeline-parallel size (outermost).

    Raises:
        TypeError: ``world`` is not a Communicator.
        ValueError: an unknown axis, a size that is not a positive int, or sizes
            whose product is not the world size.
    """

    def __init__(self, world: Communicator, dp: int | None = None, tp: int = 1,
                 pp: int = 1, **unknown):
        if not isinstance(world, Communicator):
            raise TypeError(f"Mesh needs a mpishard Communicator, got {type(world).__name__}; "
                            f"wrap it: Mesh(Communicator(MPI.COMM_WORLD), ...)")
        if unknown:
            raise ValueError(f"unknown mesh axis {sorted(unknown)[0]!r}; the axes are "
                             f"dp, tp and pp (outermost to innermost: pp, dp, tp)")
        for axis, n in (("dp", dp), ("tp", tp), ("pp", pp)):
            if n is None and axis == "dp":
                continue
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"mesh {axis}={n!r} must be a positive int")
        if dp is None:
            if tp * pp > world.size:
                raise ValueError(
                    f"mesh tp={tp} x pp={pp} = {tp * pp} exceeds the world size "
                    f"{world.size}; launch at least {tp * pp} ranks (mpiexec -n {tp * pp}) "
                    f"or lower tp and pp")
            if world.size % (tp * pp):
                raise ValueError(
                    f"mesh tp={tp} x pp={pp} = {tp * pp} does not divide world size "
                    f"{world.size}; pass tp and pp whose product divides {world.size} "
                    f"(dp is inferred as world size / (tp * pp))")
            dp = world.size // (tp * pp)
        sizes = {"dp": dp, "tp": tp, "pp": pp}
        if dp * tp * pp != world.size:
            raise ValueError(f"mesh {_describe(sizes)} does not match world size "
                             f"{world.size}; pass sizes whose product is {world.size}")
        self.world = world
        self.shape = {"pp": pp, "dp": dp, "tp": tp}
        r = world.rank
        self.coords = {"pp": r // (tp * dp), "dp": (r // tp) % dp, "tp": r % tp}
        c = self.coords
        self.tp = world.split(c["pp"] * dp + c["dp"], key=c["tp"], name="tp")
        self.dp = world.split(c["pp"] * tp + c["tp"], key=c["dp"], name="dp")
        self.pp = world.split(c["dp"] * tp + c["tp"], key=c["pp"], name="pp")

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    def axis(self, name: str) -> Communicator:
        """The communicator of axis ``name`` (``"dp"``, ``"tp"`` or ``"pp"``)."""
        if name not in MESH_AXES:
            raise ValueError(f"mesh has no axis {name!r}; the axes are dp, tp and pp")
        return getattr(self, name)

    def active_axes(self) -> dict:
        """``{name: communicator}`` of the axes with more than one rank, outermost first."""
        return {name: getattr(self, name) for name in MESH_AXES
                if getattr(self, name).size > 1}

    def world_rank(self, *, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        """The world rank at coordinates ``(pp, dp, tp)`` ([Note: mesh layout])."""
        for axis, i in (("pp", pp), ("dp", dp), ("tp", tp)):
            if not 0 <= i < self.shape[axis]:
                raise ValueError(f"mesh coordinate {axis}={i} is out of range; "
                                 f"use 0 <= {axis} < {self.shape[axis]}")
        return (pp * self.shape["dp"] + dp) * self.shape["tp"] + tp

    def free(self) -> None:
        """Free the axis communicators (collective)."""
        for axis in MESH_AXES:
            getattr(self, axis).free()

    def __repr__(self) -> str:
        return (f"Mesh(pp={self.shape['pp']}, dp={self.shape['dp']}, tp={self.shape['tp']}; "
                f"rank {self.world.rank} at {self.coords})")

"""Which mesh groups are the same ranks: shared by the mesh and the layout planner.

Kept free of MPI so that planning (and the checkpoint tools that import it)
never starts MPI.
"""
from __future__ import annotations

__all__ = ["expert_axes_as_plain"]


def expert_axes_as_plain(ep: int, cp: int, dp_shard: int) -> dict:
    """The expert axes ``ep`` and ``edp_shard`` as plain axes where they are the same
    ranks (so that their groups share those communicators), else ``{}``.

    The ``dp_shard x cp`` ranks form blocks of ``ep`` consecutive ranks: with
    ``ep = 1`` a block is one rank, with ``ep = cp`` a cp group, with ``ep =
    dp_shard x cp`` the whole group.
    """
    return {1: {"ep": (), "edp_shard": ("dp_shard", "cp")},
            cp: {"ep": ("cp",), "edp_shard": ("dp_shard",)},
            dp_shard * cp: {"ep": ("dp_shard", "cp"), "edp_shard": ()}}.get(ep, {})

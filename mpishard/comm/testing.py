"""Communicators for tests: the same test body on several group sizes.

mpi4py's own tests run each case on ``COMM_SELF`` and a dup of ``COMM_WORLD``;
mpishard adds sub-communicators split from ``COMM_WORLD`` so that one
``mpiexec -n 4`` run covers sizes 1, 2, 3 and 4:

==========  ======================================  =====================
kind        members                                 size (4-rank run)
==========  ======================================  =====================
``self``    every rank alone (``COMM_SELF`` dup)    1
``split2``  world ranks 0-1 (the others sit out)    2
``split3``  world ranks 0-2 (rank 3 sits out)       3
``world``   a dup of ``COMM_WORLD``                 4
==========  ======================================  =====================

:func:`make_test_comm` is collective over ``COMM_WORLD`` for every kind but
``self``; call it in the same order on all ranks (pytest fixtures do).
"""
from __future__ import annotations

from mpi4py import MPI

from .communicator import Communicator

__all__ = ["COMM_KINDS", "make_test_comm", "required_size"]

COMM_KINDS = ("self", "split2", "split3", "world")


def required_size(kind: str) -> int:
    """World size a kind needs to be meaningful (1 for ``self`` and ``world``)."""
    return int(kind[5:]) if kind.startswith("split") else 1


def make_test_comm(kind: str, **settings) -> Communicator | None:
    """A fresh Communicator of ``kind`` (``None`` on ranks that sit out).

    Free it with ``comm.free()`` (collective over its members).
    """
    world = MPI.COMM_WORLD
    if kind == "self":
        return Communicator(MPI.COMM_SELF.Dup(), "self", _owned=True, **settings)
    if kind == "world":
        return Communicator(world.Dup(), "world", _owned=True, **settings)
    size = required_size(kind)
    member = world.Get_rank() < size
    mpi_comm = world.Split(0 if member else MPI.UNDEFINED, world.Get_rank())
    if mpi_comm == MPI.COMM_NULL:
        return None
    return Communicator(mpi_comm, kind, _owned=True, **settings)

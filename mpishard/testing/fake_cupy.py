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
:class:`BackendAtSizeOne` is a communicator whose collectives go through its
backend (MPI or NCCL) also when it has one rank, where a plain one copies
locally: the tests and the GPU check drive those paths on one process with it.

:class:`FakeDeviceArray` and :func:`install_fake_cupy` stand in for CuPy on a
machine without a GPU: the fake array has no buffer protocol, so if a
communicator ever handed one to mpi4py instead of a pinned host copy, mpi4py
would raise; the fake stream counts synchronisations.
"""
from __future__ import annotations

import sys
import types

import numpy as np
from mpi4py import MPI

from mpishard.comm import Communicator

__all__ = ["COMM_KINDS", "make_test_comm", "required_size", "BackendAtSizeOne",
           "FakeDeviceArray", "install_fake_cupy"]

COMM_KINDS = ("self", "split2", "split3", "world")


def required_size(kind: str) -> int:
    """World size a kind needs to be meaningful (1 for ``self`` and ``world``)."""
    return int(kind[5:]) if kind.startswith("split") else 1


class BackendAtSizeOne(Communicator):
    """A :class:`~mpishard.comm.Communicator` that runs its collectives on its
    backend at every size: with one rank too, where a plain one takes them to
    ``OneRank`` (local copies, no MPI call). ``backend`` is that backend (the
    GPU check reaches NCCL's group through it)."""

    def _carrier(self, backend):
        self.backend = backend
        return backend


def make_test_comm(kind: str, *, backend_at_size_one: bool = False,
                   **settings) -> Communicator | None:
    """A fresh Communicator of ``kind`` (``None`` on ranks that sit out); a
    :class:`BackendAtSizeOne` with ``backend_at_size_one``.

    Free it with ``comm.free()`` (collective over its members).
    """
    world = MPI.COMM_WORLD
    make = BackendAtSizeOne if backend_at_size_one else Communicator
    if kind == "self":
        return make(MPI.COMM_SELF.Dup(), "self", _owned=True, **settings)
    if kind == "world":
        return make(world.Dup(), "world", _owned=True, **settings)
    size = required_size(kind)
    member = world.Get_rank() < size
    mpi_comm = world.Split(0 if member else MPI.UNDEFINED, world.Get_rank())
    if mpi_comm == MPI.COMM_NULL:
        return None
    return make(mpi_comm, kind, _owned=True, **settings)


class FakeStream:
    """A CUDA stream stand-in that counts ``synchronize`` calls."""

    def __init__(self):
        self.syncs = 0

    def synchronize(self):
        self.syncs += 1


class FakeDeviceArray:
    """Device memory stand-in: ``type(a).__module__`` starts with "cupy" and it has
    no buffer protocol (``host()`` returns a copy of its values)."""

    __module__ = "cupy"

    def __init__(self, host):
        self._a = host

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    ndim = property(lambda self: self._a.ndim)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    data = property(lambda self: types.SimpleNamespace(ptr=self._a.ctypes.data))

    def get(self, stream=None, out=None):
        out[...] = self._a
        return out

    def set(self, host, stream=None):
        self._a[...] = host

    def view(self, dtype):
        return FakeDeviceArray(self._a.view(dtype))

    def astype(self, dtype):
        return FakeDeviceArray(self._a.astype(dtype))

    def reshape(self, *shape):
        return FakeDeviceArray(self._a.reshape(*shape))

    def __getitem__(self, key):
        return FakeDeviceArray(self._a[key])

    def __setitem__(self, key, value):
        self._a[key] = value._a if isinstance(value, FakeDeviceArray) else value

    def __itruediv__(self, x):
        self._a /= x
        return self

    def host(self):
        return self._a.copy()


def install_fake_cupy(monkeypatch):
    """Put fake ``cupy`` and ``cupyx`` modules in ``sys.modules`` (pytest's
    ``monkeypatch`` undoes it). Returns ``stream`` (a :class:`FakeStream`, the
    current stream) and ``pinned`` (the shapes of pinned buffers handed out)."""
    stream = FakeStream()
    pinned = []

    def empty_pinned(shape, dtype):
        pinned.append(tuple(shape))
        return np.empty(shape, dtype)

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(get_current_stream=lambda: stream)
    cupy.empty = lambda shape, dtype: FakeDeviceArray(np.empty(shape, dtype))
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = empty_pinned
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    return types.SimpleNamespace(stream=stream, pinned=pinned)

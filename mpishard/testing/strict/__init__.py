"""A CuPy-strict array module for CPU tests: NumPy computes, CuPy's rules apply.

Code written for NumPy and CuPy takes its array module from the data
(:func:`mpishard.core.backend.xp_of`). Tests on a CPU only ever run the NumPy half,
so a NumPy assumption on the CuPy path (``np.asarray`` of a device array, a
NumPy constant mixed into device math, ``float()`` per parameter) shows up
only on a GPU. This module is the CuPy half without a GPU: arrays whose memory
is NumPy's but that refuse what CuPy refuses, count what CuPy makes expensive,
and draw from their own random stream. Build a model on it with
``Backend.resolve("strict")``; the test suite runs its array-module tests on it
(tests/conftest.py, ``array_backend``).

What differs from NumPy, as on CuPy (:mod:`.array`):

* ``np.asarray(a)`` raises ``TypeError: Implicit conversion to a NumPy array
  is not allowed``; ``a.get()`` (or :func:`asnumpy`) copies to the host;
* NumPy arrays are not operands (``TypeError: Unsupported type``), in
  operators, ufuncs, ``where`` and the other functions; scalars are;
* reductions and integer indexing give 0-d arrays;
* ``bool``/``int``/``float``/``item``/``tolist``/``get`` and data-dependent
  output shapes are host syncs, counted in :data:`syncs` (and refused inside
  ``with syncs.refused():``);
* every operation that would launch a kernel on a GPU counts one launch in
  ``syncs.launches`` (by name in ``syncs.launches_by_op``): each ufunc call
  (operators and in-place ones too), reduction, ``matmul``/``dot``/``einsum``,
  copy or ``astype``, gather (``a[idx]`` with an array or list) and write
  (``a[...] = v``, scatters), filled creation (``zeros``, ``ones``, ``full``,
  ``arange``, ``asarray`` of host data), ``concatenate``/``stack``, ``where``;
  views (``reshape``, ``transpose``, ``.T``, basic slicing), attribute reads and
  host reads (syncs) are not launches; ``with syncs.fused(name):`` counts its
  whole block as one launch (a fused kernel; see :mod:`.syncs`);
* every copy of host data onto the device (``asarray`` of host data, a list or a
  scalar, ``set``, a NumPy array written in, a NumPy array or list as an index)
  counts in ``syncs.pageable`` (by line in ``syncs.pageable_sites``): what a captured
  CUDA graph cannot hold; ``syncs.peek`` reads a value as a fused kernel does;
* bfloat16 arrays (``ml_dtypes.bfloat16``) are taken as CuPy 14 takes them; their
  products accumulate in float32 as float16's do, and a bfloat16 product of more
  than two dimensions or ``scatter_add`` into bfloat16 raises, as in CuPy 14;
* :mod:`.random` draws another stream than NumPy for the same seed, and keeps
  its state in a device array (``bit_generator._state``);
* only names CuPy has exist (:data:`.namespace.CUPY_NAMES`), plus
  :func:`scatter_add` (``cupyx.scatter_add``) and :func:`asnumpy`;
* arrays expose ``__cuda_array_interface__``, so code that tells device
  arrays from host ones takes the device path; :func:`stage_for_mpi` is that
  path's host staging (what ``mpishard.comm`` does for CuPy arrays on an MPI
  library that is not CUDA-aware), counted in ``syncs.staged``.

    >>> from mpishard import strict
    >>> a = strict.asarray([1.0, 2.0])
    >>> import numpy as np
    >>> np.asarray(a)
    Traceback (most recent call last):
    ...
    TypeError: Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a NumPy array explicitly.
    >>> a.get()
    array([1., 2.])
"""
from __future__ import annotations

import sys

import numpy

from mpishard.testing.strict import random
from mpishard.testing.strict.array import ndarray
from mpishard.testing.strict.namespace import (CUPY_NAMES, array, asanyarray, asarray, asnumpy, dot, lookup,
                        matmul, scatter_add, stage_for_mpi, where)
from mpishard.testing.strict.syncs import HostSyncError, SyncCounter, syncs

__all__ = ["ndarray", "random", "syncs", "SyncCounter", "HostSyncError", "asarray", "array",
           "asanyarray", "asnumpy", "get_array_module", "scatter_add", "stage_for_mpi",
           "matmul", "dot", "where", "CUPY_NAMES"]

#: how ``Backend`` and reports name this module
NAME = "strict"


def get_array_module(*args):
    """This module if any argument is a strict array, else NumPy (``cupy.get_array_module``)."""
    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else numpy


def __getattr__(name: str):
    return lookup(name)


def __dir__():
    return sorted(set(globals()) | CUPY_NAMES)

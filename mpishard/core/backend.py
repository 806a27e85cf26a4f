"""Array backends (NumPy or CuPy), device binding and the memory ledger.

Every array in mpishard belongs to one array module, ``numpy`` or ``cupy`` (or,
in tests, :mod:`mpishard.testing.strict`, which computes with NumPy but refuses what
CuPy refuses and counts host syncs). Code that works on arrays takes the
module from the data (:func:`xp_of`), never from a global, so the same
function runs on all of them.

A :class:`Backend` is the small explicit object a model is built with: which
array module, which device, and the :class:`MemoryLedger` that counts every
long-lived array the library allocates. Nothing here is global; pass it on.

    >>> be = Backend.resolve("numpy")
    >>> w = be.ledger.zeros("params", (4, 3), "float32", name="w")
    >>> be.ledger.bytes_by_category()["params"]
    48
"""
from __future__ import annotations

import contextlib
import gc
import tracemalloc
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpishard.core.allocator import keep_freed_memory

__all__ = [
    "Backend",
    "MemoryLedger",
    "ActivationMeasurement",
    "OutOfMemoryBudget",
    "BackendUnavailable",
    "xp_of",
    "to_numpy",
    "cupy_or_none",
    "LEDGER_CATEGORIES",
]

#: Categories the ledger, the memory planner and the reports share.
LEDGER_CATEGORIES = (
    "params",        # parameters (the shard, under ZeRO-3)
    "grads",         # gradients (the shard, under ZeRO-2/3)
    "optim",         # optimizer state (the shard, under ZeRO-1/2/3)
    "gathered",      # parameters gathered for compute (ZeRO-3 units)
    "comm",          # communication buffers (buckets, padded flat buffers)
    "activations",   # activations kept for backward, where known
    "other",
)


class BackendUnavailable(RuntimeError):
    """The requested array backend cannot be used on this machine."""


class OutOfMemoryBudget(MemoryError):
    """An allocation would take a rank past its memory budget."""


def cupy_or_none():
    """Return the ``cupy`` module if it imports, else ``None``."""
    try:
        import cupy  # noqa: PLC0415 (optional dependency, imported on demand)
    except Exception:  # ImportError, or a CUDA library that fails to load
        return None
    return cupy


def xp_of(array) -> Any:
    """Return the array module (``numpy``, ``cupy`` or ``mpishard.testing.strict``) that owns ``array``."""
    if isinstance(array, np.ndarray) or np.isscalar(array):
        return np
    module = type(array).__module__
    if module.startswith("cupy"):
        import cupy  # noqa: PLC0415

        return cupy
    if module.startswith("mpishard.testing.strict"):
        from mpishard.testing import strict  # noqa: PLC0415

        return strict
    return np


def to_numpy(array) -> np.ndarray:
    """Copy a device array to host memory (no copy for NumPy arrays)."""
    if isinstance(array, np.ndarray):
        return array
    get = getattr(array, "get", None)
    if get is not None:
        return get()
    return np.asarray(array)


def visible_gpu_count(cupy) -> int:
    """GPUs ``cupy`` sees (0 without a driver)."""
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


@dataclass
class Backend:
    """Which array module and device a model lives on, plus its memory ledger.

    Build one with :meth:`resolve`. ``name`` is ``"numpy"``, ``"cupy"`` or
    ``"strict"`` (:mod:`mpishard.testing.strict`, CuPy's rules on the CPU, for tests);
    ``device`` is the CUDA device index (``None`` on NumPy and strict).
    """

    name: str = "numpy"
    device: int | None = None
    ledger: "MemoryLedger" = field(default_factory=lambda: MemoryLedger())

    def __post_init__(self):
        if self.name in ("numpy", "strict"):
            keep_freed_memory()

    @property
    def xp(self):
        """The array module: ``numpy``, ``cupy`` or ``mpishard.testing.strict``."""
        if self.name == "numpy":
            return np
        if self.name == "strict":
            from mpishard.testing import strict  # noqa: PLC0415

            return strict
        import cupy  # noqa: PLC0415

        return cupy

    @classmethod
    def resolve(cls, name: str = "numpy", *, local_rank: int = 0,
                memory_budget: int | None = None) -> "Backend":
        """Pick the array backend and bind a device.

        Args:
            name: ``"numpy"``, ``"cupy"``, ``"auto"`` (CuPy when it imports
                and a GPU is visible, else NumPy) or ``"strict"`` (NumPy memory
                behind CuPy's rules, see :mod:`mpishard.testing.strict`).
            local_rank: this rank's index among the ranks on its node; the
                device is ``local_rank % visible_gpus`` (see
                :func:`mpishard.comm.node_local_rank`).
            memory_budget: optional per-rank byte budget for the ledger.

        Raises:
            BackendUnavailable: ``"cupy"`` was asked for without CuPy or
                without a visible GPU; the message says how to install.
            ValueError: an unknown backend name.
        """
        if name not in ("numpy", "cupy", "auto", "strict"):
            raise ValueError(
                f"unknown backend {name!r}; use 'numpy', 'cupy', 'auto' or 'strict'")
        ledger = MemoryLedger(budget=memory_budget)
        if name in ("numpy", "strict"):
            return cls(name, None, ledger)
        cupy = cupy_or_none()
        gpus = visible_gpu_count(cupy) if cupy is not None else 0
        if cupy is None or gpus == 0:
            if name == "auto":
                return cls("numpy", None, ledger)
            if cupy is None:
                raise BackendUnavailable(
                    "backend='cupy' but CuPy is not importable; install it with "
                    "pip install 'mpishard[cuda12]' (or [cuda13] for CUDA 13), "
                    "or use backend='numpy'")
            raise BackendUnavailable(
                "backend='cupy' but no GPU is visible (cupy.cuda.runtime."
                "getDeviceCount() == 0; check CUDA_VISIBLE_DEVICES and the "
                "driver), or use backend='numpy'")
        device = local_rank % gpus
        cupy.cuda.Device(device).use()
        ledger.cupy_pool = cupy.get_default_memory_pool()
        if memory_budget is not None:  # the pool enforces the budget for real on the GPU
            ledger.cupy_pool.set_limit(size=int(memory_budget))
        return cls("cupy", device, ledger)

    def asarray(self, array, dtype=None):
        """Move ``array`` (host or device) onto this backend."""
        if self.name == "numpy":
            return np.asarray(to_numpy(array), dtype=dtype)
        return self.xp.asarray(array, dtype=dtype)

    def describe(self) -> str:
        """Short human description, e.g. ``numpy/cpu`` or ``cupy/cuda:1``."""
        if self.name in ("numpy", "strict"):
            return f"{self.name}/cpu"
        return f"cupy/cuda:{self.device}"


@dataclass
class ActivationMeasurement:
    """What :meth:`MemoryLedger.measure_activations` found (``nbytes``, set on exit)."""

    nbytes: int = 0


# [Note: memory ledger]
# The ledger counts *live* bytes of the long-lived arrays mpishard allocates,
# by category. An array is registered once (``track`` or one of the allocation
# helpers) and is released either explicitly (``release``) or automatically when
# the array object is garbage collected (a weakref finalizer), so a strategy that
# drops a gathered buffer never leaves a stale count behind. Views are not
# tracked: register the base allocation. Peak bytes are kept per category and in
# total; a budget turns an allocation that would exceed it into OutOfMemoryBudget
# before the memory is taken. Arrays registered with ``host=True`` (what
# ``--offload optimizer`` keeps in host memory: float32 masters, their optimizer
# state, the gradients' host copies) are counted apart, by category too
# (``host_bytes_by_category``), and never against the budget, which is the device's.
class MemoryLedger:
    """Per-rank accounting of long-lived array bytes by category.

    Args:
        budget: optional byte budget for the total; an allocation past it
            raises :class:`OutOfMemoryBudget`.
    """

    def __init__(self, budget: int | None = None):
        self.budget = budget
        self.cupy_pool = None
        self._live: dict[int, tuple[str, int, str, bool]] = {}
        self._finalizers: dict[int, Any] = {}
        self._bytes = {c: 0 for c in LEDGER_CATEGORIES}
        self._peak = {c: 0 for c in LEDGER_CATEGORIES}
        self._total = 0
        self._peak_total = 0
        self._measured_activations = 0
        self._host = {c: 0 for c in LEDGER_CATEGORIES}
        self._host_peak = {c: 0 for c in LEDGER_CATEGORIES}

    # -- allocation -------------------------------------------------------
    def check(self, category: str, nbytes: int, name: str = "") -> None:
        """Raise :class:`OutOfMemoryBudget` if ``nbytes`` more would not fit."""
        if self.budget is not None and self._total + nbytes > self.budget:
            raise OutOfMemoryBudget(
                f"allocating {nbytes:,} bytes for {category} {name!r} would bring "
                f"this rank to {self._total + nbytes:,} bytes, over its budget of "
                f"{self.budget:,} bytes ({self._total:,} in use: "
                f"{self._summary()}); use a sharding strategy that keeps less "
                f"per rank (e.g. --strategy zero3), more ranks, or a larger budget")

    def track(self, category: str, array, name: str = "", host: bool = False):
        """Register an existing array under ``category`` (``host``: in host memory, see
        [Note: memory ledger]); returns the array."""
        if category not in self._bytes:
            raise ValueError(
                f"unknown ledger category {category!r}; use one of {LEDGER_CATEGORIES}")
        key = id(array)
        if key in self._live:
            return array
        nbytes = int(array.nbytes)
        if not host:
            self.check(category, nbytes, name)
        self._live[key] = (category, nbytes, name, host)
        if host:
            self._host[category] += nbytes
            self._host_peak[category] = max(self._host_peak[category], self._host[category])
        else:
            self._add(category, nbytes)
        try:
            self._finalizers[key] = weakref.finalize(array, self._forget, key)
        except TypeError:  # an array type without weakref support
            pass
        return array

    def empty(self, category: str, shape, dtype, name: str = "", xp=np, host: bool = False):
        """Allocate an uninitialised array and register it."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if not host:
            self.check(category, nbytes, name)
        return self.track(category, xp.empty(shape, dtype=dtype), name, host)

    def zeros(self, category: str, shape, dtype, name: str = "", xp=np, host: bool = False):
        """Allocate a zero-filled array and register it."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if not host:
            self.check(category, nbytes, name)
        return self.track(category, xp.zeros(shape, dtype=dtype), name, host)

    def on_host(self, array) -> bool:
        """Whether ``array`` (or the allocation it is a view of) is registered as host
        memory."""
        while array is not None:
            entry = self._live.get(id(array))
            if entry is not None:
                return entry[3]
            array = getattr(array, "base", None)
        return False

    def release(self, array) -> None:
        """Stop counting ``array`` (no-op if it was not registered)."""
        key = id(array)
        fin = self._finalizers.pop(key, None)
        if fin is not None:
            fin.detach()
        self._forget(key)

    def _forget(self, key: int) -> None:
        entry = self._live.pop(key, None)
        self._finalizers.pop(key, None)
        if entry is not None:
            category, nbytes, _, host = entry
            if host:
                self._host[category] -= nbytes
                return
            self._bytes[category] -= nbytes
            self._total -= nbytes

    def _add(self, category: str, nbytes: int) -> None:
        self._bytes[category] += nbytes
        self._total += nbytes
        self._peak[category] = max(self._peak[category], self._bytes[category])
        self._peak_total = max(self._peak_total, self._total)

    # -- reports ----------------------------------------------------------
    def bytes_by_category(self) -> dict[str, int]:
        """Live bytes per category (every category present, zeros included)."""
        return dict(self._bytes)

    def peak_by_category(self) -> dict[str, int]:
        """Peak live bytes per category since creation or :meth:`reset_peak`."""
        return dict(self._peak)

    def host_bytes_by_category(self) -> dict[str, int]:
        """Live bytes per category registered as host memory (``host=True``)."""
        return dict(self._host)

    def host_peak_by_category(self) -> dict[str, int]:
        """Peak live host bytes per category since creation or :meth:`reset_peak`."""
        return dict(self._host_peak)

    @property
    def total(self) -> int:
        """Live bytes over all categories (host memory apart)."""
        return self._total

    @property
    def peak_total(self) -> int:
        """Peak of the total live bytes."""
        return self._peak_total

    def reset_peak(self) -> None:
        """Restart peak tracking from the current live bytes."""
        self._peak = dict(self._bytes)
        self._peak_total = self._total
        self._host_peak = dict(self._host)

    # -- activations --------------------------------------------------------
    @contextlib.contextmanager
    def measure_activations(self):
        """Measure the bytes one forward pass leaves alive for backward.

            with ledger.measure_activations() as m:
                _, loss = model(x, y)
            m.nbytes        # also bytes_by_category()["activations"]

        Counted: bytes allocated inside the ``with`` block and still reachable
        at its end (the arrays the graph keeps for backward, the outputs, the
        graph's small Python objects; cyclic garbage is collected before the
        figure is read, so where the collector's thresholds fall does not
        count), minus arrays the ledger already counts in another category
        (e.g. ZeRO-3's gathered units). NumPy: by
        :mod:`tracemalloc` (NumPy reports its data buffers to it), started for
        the block and stopped after; Python allocations run slower meanwhile.
        Where tracemalloc was already tracing, and on CuPy (the memory pool's
        ``used_bytes()``), it is the net change instead, so memory allocated
        before the block and freed inside it counts negative.

        The figure replaces the previous one as the live ``"activations"``
        bytes (one forward's worth at a time) and counts toward their peak;
        :meth:`release_activations` drops it once backward has freed them. It
        is recorded, never checked against the budget: the memory is taken.

        Yields:
            An :class:`ActivationMeasurement`; its ``nbytes`` is set on exit.
        """
        measurement = ActivationMeasurement()
        on_device = self.cupy_pool is not None
        if on_device:        # the pool's figure would see older garbage freed inside
            gc.collect()
        # what exists now is frozen, so that the last collection looks at the block's
        # objects only (a full one, with a large heap, takes tenths of a second)
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        ledger_before = dict(self._live)
        started = False
        if on_device:
            used_before = int(self.cupy_pool.used_bytes())
        else:
            started = not tracemalloc.is_tracing()
            if started:
                tracemalloc.start()
            used_before = tracemalloc.get_traced_memory()[0]
        try:
            yield measurement
            gc.collect()
            if on_device:
                grown = int(self.cupy_pool.used_bytes()) - used_before
            else:
                grown = tracemalloc.get_traced_memory()[0] - used_before
        finally:
            if freeze:
                gc.unfreeze()
            if started:
                tracemalloc.stop()
        # An entry is the same tuple object for as long as its array is tracked.
        # (host arrays are not in the device pool's figure)
        ledger_new = sum(e[1] for k, e in self._live.items()
                         if ledger_before.get(k) is not e and not (on_device and e[3]))
        ledger_gone = sum(e[1] for k, e in ledger_before.items()
                          if self._live.get(k) is not e and not (on_device and e[3]))
        sees_old_frees = not started  # fresh tracing does not see frees of older memory
        measurement.nbytes = max(0, grown - ledger_new + (ledger_gone if sees_old_frees else 0))
        self.record_activations(measurement.nbytes)

    def record_activations(self, nbytes: int) -> None:
        """Set the live ``"activations"`` figure to ``nbytes`` (replacing the last one)."""
        self._bytes["activations"] -= self._measured_activations
        self._total -= self._measured_activations
        self._measured_activations = int(nbytes)
        self._add("activations", self._measured_activations)

    def release_activations(self) -> None:
        """Drop the measured activations from the live bytes (their peak stays)."""
        self.record_activations(0)

    def device_used_bytes(self) -> int | None:
        """CuPy memory-pool bytes in use (``None`` on NumPy), for cross-checks."""
        if self.cupy_pool is None:
            return None
        return int(self.cupy_pool.used_bytes())

    def _summary(self) -> str:
        parts = [f"{c} {b:,}" for c, b in self._bytes.items() if b]
        return ", ".join(parts) or "nothing"

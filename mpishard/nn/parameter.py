"""Parameters, their initialisation rules and their shard spec.

[Note: one layout source of truth]
A :class:`Parameter` carries a :class:`ShardSpec`: the shape and dtype of the
whole (global) parameter as the unsharded model has it, and how the array this
rank holds maps into it. Layers, optimizers, the memory planner and the
checkpoint manifest all read this spec; nothing re-derives layout from a
parameter's name. A parameter's ``shape`` is its *local unsharded* shape, the
shape its ``data`` has while it is in use for compute (the global shape unless
tensor parallelism split it).

[Note: deterministic init]
Initial values depend only on ``(seed, parameter name)`` (see
:func:`init_array`), never on world size, rank or strategy. Values are drawn in
float64 on the host and then cast, so a float32 model starts as the rounded
float64 model, and a sharded model starts bit-identical to the unsharded one.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from mpishard.autodiff.tensor import Tensor

__all__ = ["Parameter", "ShardSpec", "FlatPlacement", "Normal", "Constant", "init_array",
           "rng_for"]


@dataclass(frozen=True)
class Normal:
    """Initialise from N(0, std^2)."""

    std: float = 0.02


@dataclass(frozen=True)
class Constant:
    """Initialise every element to ``value`` (0 for biases, 1 for norm weights)."""

    value: float = 0.0


def rng_for(seed: int, name: str) -> np.random.Generator:
    """A NumPy generator determined by ``(seed, name)`` alone."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    words = np.frombuffer(digest, dtype=np.uint32).tolist()
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed)] + words)))


def init_array(init, shape: tuple, seed: int, name: str) -> np.ndarray:
    """The float64 initial value of parameter ``name``. See [Note: deterministic init]."""
    if isinstance(init, Normal):
        return rng_for(seed, name).standard_normal(shape) * init.std
    if isinstance(init, Constant):
        return np.full(shape, float(init.value))
    raise TypeError(f"unknown initialiser {init!r} for parameter {name!r}")


@dataclass(frozen=True)
class FlatPlacement:
    """Where a parameter sits in a ZeRO unit's flat buffer, and what this rank owns.

    Attributes:
        unit: name of the unit (the module path, ``""`` for the root remainder).
        offset: element offset of the (flattened, local) parameter in the unit buffer.
        numel: number of elements of the local parameter.
        shard_start, shard_stop: the unit-buffer range this dp rank owns.
    """

    unit: str
    offset: int
    numel: int
    shard_start: int
    shard_stop: int

    @property
    def owned(self) -> tuple:
        """``(start, stop)`` of this rank's elements in the flattened parameter (may be empty)."""
        start = min(max(self.shard_start - self.offset, 0), self.numel)
        stop = min(max(self.shard_stop - self.offset, 0), self.numel)
        return start, max(start, stop)


@dataclass(frozen=True)
class ShardSpec:
    """Where this rank's piece of a parameter sits in the global tensor.

    Attributes:
        global_shape: shape of the whole parameter in the unsharded model.
        dtype: dtype name, e.g. ``"float32"``.
        tp_dim: dimension split across tensor-parallel ranks (``None`` when the
            parameter is replicated over tp).
        tp_blocks: ``(start, stop)`` ranges along ``tp_dim`` of the global
            tensor; the local tensor is their concatenation in this order.
        pp_stage: pipeline stage that owns the parameter (``None``: not pipelined).
        replica: this tensor is a copy of one held elsewhere (a tied weight on
            another pipeline stage): not saved, not counted in gradient norms.
        flat: ZeRO placement over the dp axis (``None`` when not flattened).
        ep_range: ``(start, stop)`` of the experts (dimension 0) this rank holds
            under expert parallelism (``None``: all of them, or not an expert
            tensor). Experts are replicated over tp, so ``tp_dim`` is then ``None``.
    """

    global_shape: tuple
    dtype: str
    tp_dim: int | None = None
    tp_blocks: tuple = ()
    pp_stage: int | None = None
    replica: bool = False
    flat: FlatPlacement | None = None
    ep_range: tuple | None = None

    def _split(self) -> tuple:
        """``(dimension, blocks)`` of the one split this piece has (``(None, ())``: whole)."""
        if self.ep_range is not None:
            return 0, (tuple(self.ep_range),)
        return self.tp_dim, self.tp_blocks

    @property
    def local_shape(self) -> tuple:
        """Shape of this rank's (tensor- or expert-parallel) piece before any ZeRO
        flattening."""
        dim, blocks = self._split()
        if dim is None:
            return tuple(self.global_shape)
        shape = list(self.global_shape)
        shape[dim] = sum(stop - start for start, stop in blocks)
        return tuple(shape)

    def global_runs(self, flat_range: tuple | None = None) -> list:
        """This rank's piece as runs of the *global* tensor's row-major flat index.

        The local tensor (the tp blocks of the global one, concatenated along
        ``tp_dim``), flattened row-major and cut to ``flat_range`` (a ZeRO
        shard's ``FlatPlacement.owned``; default: all of it), is the
        concatenation of the returned ``(start, stop)`` runs of the global
        flattened tensor, in order. Checkpoints store and re-shard pieces
        through these runs alone, so any layout maps onto any other.
        """
        shape = tuple(self.global_shape)
        d, blocks = self._split()
        if d is None:
            segments = [(0, int(np.prod(shape, dtype=np.int64)))]
        else:
            inner = int(np.prod(shape[d + 1:], dtype=np.int64))
            outer = int(np.prod(shape[:d], dtype=np.int64))
            segments = [((o * shape[d] + start) * inner, (o * shape[d] + stop) * inner)
                        for o in range(outer) for start, stop in blocks]
        if flat_range is None:
            return [s for s in segments if s[1] > s[0]]
        lo, hi = flat_range
        runs, pos = [], 0
        for start, stop in segments:
            n = stop - start
            a, b = max(lo, pos), min(hi, pos + n)
            if b > a:
                runs.append((start + a - pos, start + b - pos))
            pos += n
            if pos >= hi:
                break
        return runs

    def local_slice_of(self, full: np.ndarray) -> np.ndarray:
        """Cut this rank's piece out of the full global array."""
        dim, blocks = self._split()
        if dim is None:
            return full
        parts = []
        for start, stop in blocks:
            index = [slice(None)] * full.ndim
            index[dim] = slice(start, stop)
            parts.append(full[tuple(index)])
        return np.concatenate(parts, axis=dim)


#: dtypes a Parameter may have (16-bit compute is the strategies' ``precision``)
MASTER_DTYPES = ("float32", "float64")


class Parameter(Tensor):
    """A trainable leaf tensor with an init rule, a weight-decay flag and a shard spec.

    Args:
        shape: the local unsharded shape (see [Note: one layout source of truth]).
        init: :class:`Normal` or :class:`Constant`.
        decay: whether weight decay applies (True for matrices and embeddings,
            False for biases and norm weights, following nanoGPT).
        dtype: dtype name of the parameter.

    ``data`` is ``None`` until the owning model is materialised (see
    :func:`mpishard.nn.materialize`).
    """

    __slots__ = ("init", "decay", "spec", "_shape")

    def __init__(self, shape, init=Normal(), decay: bool = True, dtype: str = "float32"):
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
        if name not in MASTER_DTYPES:
            raise ValueError(
                f"parameter dtype {name!r}: parameters (the master weights the optimizer "
                f"updates) are float32 or float64; for 16-bit compute build the model in "
                f"float32 and wrap it with precision='float16' or 'bfloat16'")
        super().__init__(np.empty(0, dtype=dtype), requires_grad=True)
        self.data = None
        self._shape = tuple(int(n) for n in shape)
        self.init = init
        self.decay = bool(decay)
        self.spec = ShardSpec(self._shape, str(np.dtype(dtype)))

    @property
    def shape(self) -> tuple:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return math.prod(int(d) for d in self._shape)

    @property
    def dtype(self):
        return np.dtype(self.spec.dtype)

    @property
    def decay_ranges(self) -> tuple:
        """Flat element ranges that get weight decay (all or nothing for a plain parameter)."""
        return ((0, self.size),) if self.decay else ()

    def __repr__(self) -> str:
        state = "unmaterialised" if self.data is None else f"data {tuple(self.data.shape)}"
        return f"Parameter(shape={self._shape}, dtype={self.spec.dtype}, {state})"

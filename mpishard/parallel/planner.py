"""Memory planner: per-rank bytes by category before spending any compute.

``plan_memory`` asks the registered strategy (see [Note: strategy contract])
for its plan; each strategy reads the same layout it builds (ZeRO: the units of
[Note: flat unit layout]) from an unmaterialised model, so the figures are the
ledger's figures: steady-state bytes for parameters, gradients and optimizer
state, and peaks for the transient categories (gathered units, communication
buffers). It also predicts the bus bytes each rank moves per step.

    >>> plan = plan_memory(GPT(cfg, materialize_now=False), "zero3", dp_size=4)
    >>> print(plan.format())
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..dtypes import resolve_dtype
from .precision import Precision
from .strategy import strategy_entry

__all__ = ["MemoryPlan", "PlanSizes", "plan_memory", "OPTIMIZER_STATES", "window_peak"]

#: flat state arrays per parameter element
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1}


@dataclass
class MemoryPlan:
    """Predicted per-rank bytes (dp rank 0; every dp rank holds the same sizes)."""

    strategy: str
    dp_size: int
    n_params: int
    itemsize: int
    steady: dict = field(default_factory=dict)   # params, grads, optim
    peak: dict = field(default_factory=dict)     # gathered, comm
    bus_bytes_per_step: int = 0
    precision: str | None = None                 # e.g. "float16 compute, float32 gradients"

    @property
    def model_state_bytes(self) -> int:
        """Parameters + gradients + optimizer state held between steps."""
        return sum(self.steady.values())

    @property
    def total_peak_bytes(self) -> int:
        return self.model_state_bytes + sum(self.peak.values())

    def format(self) -> str:
        def mib(n):
            return f"{n / 2**20:10.2f} MiB"
        mixed = f" ({self.precision})" if self.precision else ""
        rows = [f"{self.strategy} on dp={self.dp_size}: {self.n_params:,} parameters, "
                f"{self.itemsize}-byte masters{mixed}; per rank:"]
        for k, v in self.steady.items():
            rows.append(f"  {k:<10}{mib(v)}")
        for k, v in self.peak.items():
            rows.append(f"  {k:<10}{mib(v)}  (peak, transient)")
        rows.append(f"  {'total':<10}{mib(self.total_peak_bytes)}  (model state "
                    f"{self.model_state_bytes / 2**20:.2f} MiB)")
        rows.append(f"  comm      {self.bus_bytes_per_step / 2**20:10.2f} MiB bus bytes per step")
        return "\n".join(rows)


@dataclass(frozen=True)
class PlanSizes:
    """What every strategy's memory formula reads (handed to ``Strategy.plan_memory``).

    Attributes:
        strategy: the registered name being planned.
        dp_size: the data-parallel size ``N``.
        n_params: parameter elements on this rank before sharding.
        itemsize: bytes of a master element (and of optimizer state).
        compute_itemsize: bytes of a compute-copy element (``itemsize`` unless mixed).
        reduce_itemsize: bytes of a gradient element in reduction.
        mixed: whether a 16-bit compute copy exists.
        n_states: optimizer state arrays per element.
        precision: a description for the plan's header, or ``None``.
        micro_batches: forward/backward passes per step (ZeRO-3 gathers in each).
    """

    strategy: str
    dp_size: int
    n_params: int
    itemsize: int
    compute_itemsize: int
    reduce_itemsize: int
    mixed: bool
    n_states: int
    precision: str | None = None
    micro_batches: int = 1

    @property
    def factor(self) -> float:
        """``(N - 1) / N``: the share of a buffer a reduce-scatter or all-gather moves."""
        return (self.dp_size - 1) / self.dp_size

    def new_plan(self) -> MemoryPlan:
        """An empty :class:`MemoryPlan` with this header, for a strategy to fill."""
        return MemoryPlan(self.strategy, self.dp_size, self.n_params, self.itemsize,
                          precision=self.precision)


def window_peak(sizes: list, window: int) -> int:
    """Largest sum of ``window`` consecutive entries (buffers alive together)."""
    if not sizes:
        return 0
    window = min(window, len(sizes))
    return max(sum(sizes[i:i + window]) for i in range(len(sizes) - window + 1))


def plan_memory(model, strategy: str, dp_size: int, optimizer: str = "adamw",
                dtype: str | None = None, precision=None, micro_batches: int = 1) -> MemoryPlan:
    """Predict per-rank bytes by ledger category for ``model`` under ``strategy``.

    Args:
        model: a model (materialised or not; only shapes are read). Its
            parameters' ``spec.flat`` is overwritten by ZeRO's unit layout.
        strategy: a name registered in :data:`~mpishard.parallel.STRATEGIES`.
        dp_size: data-parallel size.
        optimizer: key of :data:`OPTIMIZER_STATES`.
        dtype: element dtype (default: the parameters').
        precision: mixed precision as the strategy gets it (``"float16"``, a
            :class:`Precision`): masters and optimizer state in ``dtype``, a
            compute copy in ``param_dtype``, gradient buffers in ``reduce_dtype``.
        micro_batches: forward and backward passes per step (gradients are
            still reduced once).
    """
    entry = strategy_entry(strategy)
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {list(OPTIMIZER_STATES)}")
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    params = model.parameters()
    b = np.dtype(dtype or params[0].dtype).itemsize
    policy = Precision.of(precision)
    mixed = policy.mixed
    sizes = PlanSizes(
        strategy, dp_size, sum(p.size for p in params), b,
        compute_itemsize=resolve_dtype(policy.param_dtype).itemsize if mixed else b,
        reduce_itemsize=resolve_dtype(policy.reduce_dtype).itemsize if mixed else b,
        mixed=mixed, n_states=OPTIMIZER_STATES[optimizer],
        precision=(f"{policy.param_dtype} compute, {policy.reduce_dtype} gradients"
                   if mixed else None), micro_batches=micro_batches)
    return entry.cls.plan_memory(model, sizes, **entry.options)

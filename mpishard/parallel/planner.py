"""Memory planner: per-rank bytes by category before spending any compute.

``plan_memory`` reads the same unit layout the strategies build (see
[Note: flat unit layout]) from an unmaterialised model, so its figures are the
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
from .zero import ZeRO, plan_units

__all__ = ["MemoryPlan", "plan_memory", "STRATEGIES", "OPTIMIZER_STATES"]

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
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


def _window_peak(sizes: list, window: int) -> int:
    """Largest sum of ``window`` consecutive entries (buffers alive together)."""
    if not sizes:
        return 0
    window = min(window, len(sizes))
    return max(sum(sizes[i:i + window]) for i in range(len(sizes) - window + 1))


def plan_memory(model, strategy: str, dp_size: int, optimizer: str = "adamw",
                dtype: str | None = None, precision=None) -> MemoryPlan:
    """Predict per-rank bytes by ledger category for ``model`` under ``strategy``.

    Args:
        model: a model (materialised or not; only shapes are read). Its
            parameters' ``spec.flat`` is overwritten by the unit layout.
        strategy: ``"ddp"``, ``"zero1"``, ``"zero2"`` or ``"zero3"``.
        dp_size: data-parallel size.
        optimizer: key of :data:`OPTIMIZER_STATES`.
        dtype: element dtype (default: the parameters').
        precision: mixed precision as the strategy gets it (``"float16"``, a
            :class:`Precision`): masters and optimizer state in ``dtype``, a
            compute copy in ``param_dtype``, gradient buffers in ``reduce_dtype``.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {list(OPTIMIZER_STATES)}")
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    params = model.parameters()
    b = np.dtype(dtype or params[0].dtype).itemsize
    policy = Precision.of(precision)
    mixed = policy.mixed
    cb = resolve_dtype(policy.param_dtype).itemsize if mixed else b    # compute copy
    rb = resolve_dtype(policy.reduce_dtype).itemsize if mixed else b   # gradient buffers
    n = sum(p.size for p in params)
    n_states = OPTIMIZER_STATES[optimizer]
    factor = (dp_size - 1) / dp_size
    plan = MemoryPlan(strategy, dp_size, n, b,
                      precision=f"{policy.param_dtype} compute, {policy.reduce_dtype} gradients"
                      if mixed else None)
    if strategy == "ddp":
        plan.steady = {"params": n * b + (n * cb if mixed else 0),
                       "grads": n * rb if dp_size > 1 else 0,
                       "optim": n_states * n * b}
        plan.peak = {"gathered": 0, "comm": 0}
        plan.bus_bytes_per_step = int(round(2 * factor * n * rb))
        return plan
    stage = int(strategy[-1])
    names = list(getattr(model, "shard_units", lambda: [])())
    units = plan_units(model, names, dp_size, 0)
    padded_n = sum(u.padded for u in units)
    shards_n = sum(u.shard_size for u in units)
    blocks = [u.padded * cb for u in units if u.module is not None]     # gathered, compute dtype
    root = sum(u.padded * cb for u in units if u.module is None)
    # A reduction in flight holds its flat buffer, plus a receive buffer when the
    # reduce dtype is not the shard's (mixed precision).
    # Stage 1 reduces from its full gradient buffer (counted as grads), in backward's order.
    order = [u for u in units if u.module is not None][::-1] + [u for u in units if u.module is None]
    in_flight = [(0 if stage == 1 else u.padded * rb) + (u.shard_size * rb if rb != b else 0)
                 for u in order]
    comm_peak = _window_peak(in_flight, ZeRO.max_inflight_reductions + 1)
    copy = padded_n * cb if stage < 3 else (shards_n * cb if mixed else 0)
    plan.steady = {"params": (shards_n * b if stage == 3 or mixed else 0) + copy,
                   "grads": shards_n * b + (padded_n * rb if stage == 1 else 0),
                   "optim": n_states * shards_n * b}
    gathered = 0
    if stage == 3:
        pair = max((blocks[i] + blocks[i + 1] for i in range(len(blocks) - 1)),
                   default=blocks[0] if blocks else 0)
        gathered = root + pair
    plan.peak = {"gathered": gathered, "comm": comm_peak}
    if stage < 3:  # reduce-scatter the gradients, all-gather the compute copy
        plan.bus_bytes_per_step = int(round(factor * padded_n * (rb + cb)))
    else:  # gather every block twice (forward, backward), the root once, reduce-scatter all
        plan.bus_bytes_per_step = int(round(factor * (2 * sum(blocks) + root + padded_n * rb)))
    return plan

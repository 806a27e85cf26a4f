"""Parallel strategies: where math meets communication.

``DataParallel`` (replicate, average gradients in buckets) and ``ZeRO``
(stages 1/2/3: shard optimizer state, gradients, parameters) over ``mesh.dp``.
"""
from .base import StepResult, Strategy
from .data_parallel import DataParallel, check_replicas_equal
from .flat import FlatShard, FlatUnit
from .planner import STRATEGIES, MemoryPlan, plan_memory
from .zero import ZeRO, plan_units

__all__ = ["Strategy", "StepResult", "DataParallel", "ZeRO", "FlatUnit", "FlatShard",
           "plan_units", "check_replicas_equal", "MemoryPlan", "plan_memory", "STRATEGIES"]

"""Modules, parameters, layers and parallel plans (no communication here: see mpishard.parallel)."""
from .init import materialize, seed_dropout
from .layers import CrossEntropyLoss, Dropout, Embedding, LayerNorm, Linear, unbiased
from .module import Module, ModuleDict, ModuleList, StateDictError
from .parameter import (Constant, FlatPlacement, Normal, Parameter, ShardSpec, init_array,
                        rng_for)
from .plan import (ColumnParallel, ParallelPlan, PipelinePlan, RowParallel, VocabParallel,
                   VocabParallelLoss, plan_of)

__all__ = [
    "Module", "ModuleList", "ModuleDict", "StateDictError", "Parameter", "ShardSpec",
    "FlatPlacement",
    "Normal", "Constant", "init_array", "rng_for", "materialize", "seed_dropout",
    "Linear", "Embedding", "LayerNorm", "Dropout", "CrossEntropyLoss", "unbiased",
    "ParallelPlan", "PipelinePlan", "ColumnParallel", "RowParallel", "VocabParallel",
    "VocabParallelLoss", "plan_of",
]

"""Modules, parameters, layers and parallel plans (no communication here: see mpishard.parallel)."""
from mpishard.nn.init import materialize, seed_dropout
from mpishard.nn.layers import CrossEntropyLoss, Dropout, Embedding, LayerNorm, Linear, unbiased
from mpishard.nn.module import Module, ModuleDict, ModuleList, StateDictError
from mpishard.nn.parameter import (Constant, FlatPlacement, Normal, Parameter, ShardSpec, init_array,
                        rng_for)
from mpishard.nn.sharding import (ColumnParallel, ShardingPlan, PipelinePlan, RowParallel, VocabParallel,
                   VocabParallelLoss, plan_of)

__all__ = [
    "Module", "ModuleList", "ModuleDict", "StateDictError", "Parameter", "ShardSpec",
    "FlatPlacement",
    "Normal", "Constant", "init_array", "rng_for", "materialize", "seed_dropout",
    "Linear", "Embedding", "LayerNorm", "Dropout", "CrossEntropyLoss", "unbiased",
    "ShardingPlan", "PipelinePlan", "ColumnParallel", "RowParallel", "VocabParallel",
    "VocabParallelLoss", "plan_of",
]

"""Parallel strategies: where math meets communication.

``DataParallel`` (replicate, average gradients in buckets) and ``ZeRO``
(stages 1/2/3: shard optimizer state, gradients, parameters) over ``mesh.dp``;
tensor parallelism over ``mesh.tp`` and pipeline stages over ``mesh.pp``;
``ParallelGPT`` composes them all on one mesh.
"""
from .base import StepResult, Strategy
from .compose import ParallelGPT, build_stage, wrap_model
from .data_parallel import DataParallel, check_replicas_equal
from .flat import FlatLayout, FlatShard, padded_size
from .units import FlatUnit
from .pieces import Piece, gather_full_params, load_pieces, pieces_of
from .pipeline import Pipeline, bubble_fraction, partition_blocks
from .precision import PRECISIONS, LossScaler, Precision
from .planner import STRATEGIES, MemoryPlan, plan_memory
from .tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                              parallelize_gpt, vocab_parallel_cross_entropy)
from .zero import ZeRO, plan_units

__all__ = ["Strategy", "StepResult", "DataParallel", "ZeRO", "FlatUnit", "FlatShard", "FlatLayout", "padded_size",
           "plan_units", "check_replicas_equal", "MemoryPlan", "plan_memory", "STRATEGIES",
           "Piece", "pieces_of", "load_pieces", "gather_full_params", "ParallelGPT",
           "build_stage", "wrap_model", "Pipeline",
           "bubble_fraction", "partition_blocks", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "parallelize_gpt", "vocab_parallel_cross_entropy",
           "Precision", "LossScaler", "PRECISIONS"]

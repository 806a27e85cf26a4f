"""Parallel strategies: where math meets communication.

Every strategy answers one contract (:class:`Strategy`, see [Note: strategy
contract] in strategy.py) and is listed once in :data:`STRATEGIES`:
``DataParallel`` (``ddp``: replicate, average gradients in buckets) and
``ZeRO`` (``zero1``/``zero2``/``zero3``: shard optimizer state, gradients,
parameters) over the ranks holding the same parameters (``mesh.dp_cp``; ZeRO
shards over ``dp_shard x cp`` and averages across ``dp_replicate``). Tensor
parallelism over ``mesh.tp`` (with sequence parallelism), context parallelism
over ``mesh.cp`` and pipeline stages over ``mesh.pp`` apply a model's own
parallel plan; ``ParallelModel`` composes them all on one mesh.
"""
from mpishard.parallel.data.ddp import DataParallel      # registers ddp
from mpishard.parallel.zero import ZeRO                  # registers zero1, zero2, zero3
from mpishard.parallel.compose import ParallelModel, build_stage, stage_blocks, wrap_model
from mpishard.parallel.context.apply import CP_MODES, SequenceShard, apply_context_plan
from mpishard.parallel.context.attention import (heads_to_seq, ring_attention, ring_kv_bytes, seq_to_heads,
                     ulysses_attention, zigzag_positions, zigzag_slice)
from mpishard.parallel.tensor.sequence import gather_from_sp, reduce_scatter_to_sp, scatter_to_sp, sp_rows
from mpishard.parallel.flat import FlatIndex, FlatShard, padded_size
from mpishard.parallel.plans import split_range
from mpishard.parallel.replicas import check_replicas_equal
from mpishard.parallel.pieces import Piece, gather_full_params, load_pieces, pieces_of
from mpishard.parallel.pipeline.schedule import Pipeline, bubble_fraction, partition_blocks
from mpishard.parallel.precision import PRECISIONS, LossScaler, MasterCopies, Precision
from mpishard.parallel.strategy import (STRATEGIES, Sharded, StepResult, Strategy, StrategyEntry,
                                       register_strategy)
from mpishard.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelCrossEntropy,
                              VocabParallelEmbedding, apply_tensor_plan, tie_parameters)
from mpishard.parallel.tensor.ops import copy_to_tp, reduce_from_tp, vocab_parallel_cross_entropy
from mpishard.parallel.zero.base import ZeroStrategy, ZeroUnit
from mpishard.parallel.zero.units import FlatUnit, build_units

__all__ = ["Strategy", "StepResult", "Sharded", "StrategyEntry", "STRATEGIES", "register_strategy",
           "DataParallel", "ZeRO", "ZeroStrategy", "ZeroUnit", "FlatUnit", "FlatShard",
           "FlatIndex", "padded_size", "build_units", "check_replicas_equal",
           "Piece", "pieces_of", "load_pieces", "gather_full_params",
           "ParallelModel", "build_stage", "stage_blocks", "wrap_model", "Pipeline", "bubble_fraction",
           "partition_blocks", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "VocabParallelCrossEntropy", "apply_tensor_plan",
           "tie_parameters", "split_range", "copy_to_tp", "reduce_from_tp",
           "vocab_parallel_cross_entropy", "SequenceShard", "apply_context_plan", "CP_MODES",
           "ring_attention", "ulysses_attention", "seq_to_heads", "heads_to_seq",
           "ring_kv_bytes", "zigzag_positions", "zigzag_slice", "gather_from_sp",
           "reduce_scatter_to_sp", "scatter_to_sp", "sp_rows",
           "Precision", "LossScaler", "MasterCopies", "PRECISIONS"]

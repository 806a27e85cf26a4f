"""A GPU's time for one micro-batch of a stage: every kernel's FLOPs and bytes at shape-dependent rates.

    ops = stage_ops(stage, layout, itemsize=2)
    times = micro_batch_times(ops, load_machine("a100-80gb"), "float16", layout)
    times["forward"], times["backward"], times["recompute"], times["by class"]

[Note: GPU kernel model]
Each kernel a stage's forward and backward launch is an :class:`Op`: its FLOPs and
the bytes it reads and writes, forward and backward, read from the built stage
(its modules' local shapes, so tensor, sequence and context parallelism are in
them). Its time is the time of its FLOPs at the engine's rate plus the time of
its bytes at the memory's, one after the other (Calculon's ``no_overlap``
processing mode, calculon-ai/calculon ``calculon/system.py``), plus one launch:

* a matrix product (``2 M N K`` FLOPs, ``M K + K N + M N`` elements) on the
  tensor cores at ``peak x`` an efficiency that depends on the product's size
  (the machine's ``matmul_efficiency_table``, GFLOP -> efficiency, first row
  the op reaches), at most the ``matmul_efficiency`` measured at the best shape
  (the maximum achievable matmul FLOP/s); backward is two such products (the input's and the
  weight's gradients);
* attention's two batched products over ``B x heads`` of ``T_local x T x hs``,
  their softmax over the ``T x T`` scores and its dropout (unfused, as
  Megatron-LM runs them), or one fused kernel (flash attention: the causal
  half of the products at the machine's ``flash_attention_efficiency``,
  only Q, K, V and the output through memory);
* memory-bound kernels (norms, the MLP's activation, dropout fused with the
  residual add, the embedding lookup, the loss's softmax) on the vector
  units at ``vector_flops x`` their table's efficiency, and their bytes at
  ``memory_bandwidth x`` the ``memory_efficiency_table``'s (MB ->
  efficiency). Under sequence parallelism norms, dropouts and residual adds
  see ``rows / tp``, otherwise every tp rank repeats them on all rows.

Recomputation adds forward kernels: the blocks' (full) or attention's core
(``core`` ops: its products, softmax and dropout; selective). What it leaves
out: bias adds (fused into the next kernel), kernel fusion beyond the above,
and GEMM tile quantisation.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpishard.models import spec_of
from mpishard.nn.sharding import plan_of
from mpishard.parallel.plans import matching_modules

__all__ = ["Op", "stage_ops", "micro_batch_times", "moe_rows", "OP_CLASSES"]

#: the op classes of a breakdown, in the order they are printed
OP_CLASSES = ("matmul", "attention", "norm", "activation", "dropout+residual", "embedding",
              "loss")


def moe_rows(module, rows: int) -> int:
    """The rows a mixture of experts' layer routes to its experts: ``top_k`` per row,
    capped by each expert's capacity (even routing)."""
    k, E = module.top_k, module.n_experts
    if module.capacity is None:
        return rows * k
    return min(rows * k, E * int(np.ceil(module.capacity * rows * k / E)))


@dataclass(frozen=True)
class Op:
    """One kernel of a micro-batch: FLOPs and bytes forward and backward (see
    [Note: GPU kernel model]); ``block``: inside the pipelined blocks (recomputed under
    full checkpointing), ``core``: attention's core (recomputed under selective)."""

    cls: str
    fw_flops: float
    fw_bytes: float
    bw_flops: float
    bw_bytes: float
    matrix: bool = False
    block: bool = False
    core: bool = False
    fw_kernels: int = 1
    bw_kernels: int = 2
    flash: bool = False


def _gemm(cls, m, n, k, s, block, core=False, batch=1) -> Op:
    flops = 2.0 * batch * m * n * k
    nbytes = float(batch) * (m * k + k * n + m * n) * s
    return Op(cls, flops, nbytes, 2 * flops, 2 * nbytes, True, block, core)


def _vector(cls, elements, s, fw_flops, bw_flops, fw_passes, bw_passes, block,
            core=False, extra_bytes=0.0) -> Op:
    """A memory-bound kernel over ``elements`` of ``s`` bytes: ``fw_passes`` reads and
    writes of them forward, ``bw_passes`` backward (``extra_bytes``: a dropout mask)."""
    return Op(cls, fw_flops * elements, fw_passes * elements * s + extra_bytes,
              bw_flops * elements, bw_passes * elements * s + extra_bytes,
              False, block, core, 1, 1)


def _dropout(stage) -> float:
    return float(getattr(getattr(stage, "config", None), "dropout", 0.0) or 0.0)


def stage_ops(stage, layout, itemsize: int, flash: bool = False) -> list:
    """The kernels of one micro-batch of ``stage`` (built for ``layout``'s split) with
    activations of ``itemsize`` bytes (see [Note: GPU kernel model])."""
    plan = plan_of(stage)
    blocks = plan.pipeline.blocks + "." if plan.pipeline is not None else None
    rows = layout.batch_size * layout.local_seq_len            # a Linear's rows (gathered)
    sp = layout.sequence_parallel and layout.tp > 1
    split_rows = rows / layout.tp if sp else rows              # norms, dropouts, adds
    p, s = _dropout(stage), itemsize
    mask = 1.0 if p > 0 else 0.0                               # a byte per element kept
    ops = []
    for path, m in stage.named_modules():
        in_block = bool(blocks) and path.startswith(blocks)
        name = type(m).__name__
        weight = m._parameters.get("weight")
        if weight is not None and len(weight.shape) == 2 and name.endswith("Linear"):
            out, inp = weight.shape
            ops.append(_gemm("matmul", rows, out, inp, s, in_block))
            if blocks and not in_block:
                # outside the blocks, the head: its logits feed the loss (max, sum of
                # exponentials, gradient;
                # float32 rows for 16-bit logits, as the vocabulary-parallel loss keeps)
                ops.append(_vector("loss", rows * out, max(s, 4), 5, 3, 3, 2, False))
        elif weight is not None and len(weight.shape) == 1 and "Norm" in name:
            n = split_rows * weight.shape[0]
            ops.append(_vector("norm", n, s, 9, 21, 2, 3, in_block))
            if in_block:         # each norm opens a residual branch: dropout + add closes it
                ops.append(_vector("dropout+residual", n, s, 1 + mask, mask + 1, 3, 2,
                                   in_block, extra_bytes=mask * n))
        elif weight is not None and len(weight.shape) == 2 and "Embedding" in name:
            n = split_rows * weight.shape[1]
            ops.append(_vector("embedding", n, s, 1, 1, 2, 2, in_block))
        elif name.endswith("MLP"):
            linears = [c for c in m._modules.values() if type(c).__name__.endswith("Linear")]
            if len(linears) >= 2:
                inputs = len(linears) - 1                    # GELU: 1, SwiGLU: gate and up
                n = rows * linears[0].weight.shape[0]
                ops.append(_vector("activation", n, s, 8, 13, inputs + 1, 2 * inputs + 1,
                                   in_block))
        if hasattr(m, "n_experts") and "experts" in m._modules:
            routed = moe_rows(m, rows)
            for w in m.experts._parameters.values():
                if w is not None and len(w.shape) == 3:
                    ops.append(_gemm("matmul", routed / w.shape[0], w.shape[2], w.shape[1], s,
                                     in_block, batch=w.shape[0]))
    for pattern in plan.attention:
        for path, m in matching_modules(stage, pattern):
            in_block = bool(blocks) and path.startswith(blocks)
            heads, hs = spec_of(stage).attention_heads(m)
            B, Tl, T = layout.batch_size, layout.local_seq_len, layout.seq_len
            ops += _attention(B * heads, Tl, T, hs, s, p, in_block, flash)
    return ops


def _attention(bh, Tl, T, hs, s, p, block, flash) -> list:
    """Attention's core over ``bh`` (batch x local heads) of ``Tl`` queries and ``T`` keys."""
    if flash:           # one kernel forward, one backward; the causal half of the tiles
        flops = 2.0 * 2 * bh * Tl * T * hs / 2
        io = 4.0 * bh * Tl * hs * s
        return [Op("attention", flops, io, 2.5 * flops, 2.5 * io, True, block, True, 1, 1,
                   flash=True)]
    scores = float(bh) * Tl * T
    mask = scores if p > 0 else 0.0
    ops = [_gemm("attention", Tl, T, hs, s, block, True, batch=bh),          # q k^T
           _vector("attention", scores, s, 5, 8, 2, 3, block, True)]        # scale, mask, softmax
    if p > 0:
        ops.append(_vector("attention", scores, s, 1, 1, 2, 2, block, True, extra_bytes=mask))
    ops.append(_gemm("attention", Tl, hs, T, s, block, True, batch=bh))      # probs v
    return ops


def _table(table, size: float) -> float:
    for threshold, efficiency in table:
        if size >= threshold:
            return float(efficiency)
    return float(table[-1][1])


def op_seconds(op: Op, machine, dtype: str) -> tuple:
    """``(forward, backward)`` seconds of ``op`` on ``machine`` (see [Note: GPU kernel model])."""
    peak = machine.peak(dtype)

    def one(flops, nbytes, kernels):
        if not flops and not nbytes:
            return 0.0
        per_flops, per_bytes = flops / kernels, nbytes / kernels
        if op.flash:
            rate = peak * machine.flash_attention_efficiency
        elif op.matrix:
            rate = peak * min(machine.matmul_efficiency,     # the best shape measured
                              _table(machine.matmul_efficiency_table, per_flops / 1e9))
        else:
            rate = machine.vector_peak(dtype) * _table(machine.vector_efficiency_table,
                                                       per_flops / 1e9)
        memory = machine.memory_bandwidth * _table(machine.memory_efficiency_table,
                                                   per_bytes / 1e6)
        return kernels * (per_flops / rate + per_bytes / memory + machine.launch_s)
    return one(op.fw_flops, op.fw_bytes, op.fw_kernels), one(op.bw_flops, op.bw_bytes,
                                                             op.bw_kernels)


def micro_batch_times(ops: list, machine, dtype: str, layout) -> dict:
    """One micro-batch's seconds: ``forward``, ``backward``, ``recompute`` (the forward
    kernels checkpointing repeats), ``attention`` (its core, both ways) and ``by
    class`` (forward + backward + recompute per op class)."""
    forward = backward = recompute = attention = 0.0
    by_class = dict.fromkeys(OP_CLASSES, 0.0)
    for op in ops:
        fw, bw = op_seconds(op, machine, dtype)
        again = fw if (layout.activation_checkpointing and op.block) or \
            (layout.selective and op.core) else 0.0
        forward, backward, recompute = forward + fw, backward + bw, recompute + again
        if op.core:
            attention += fw + bw
        by_class[op.cls] = by_class.get(op.cls, 0.0) + fw + bw + again
    return {"forward": forward, "backward": backward, "recompute": recompute,
            "attention": attention, "by class": by_class,
            "kernels": sum(op.fw_kernels + op.bw_kernels for op in ops)}

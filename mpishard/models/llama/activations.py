"""What one forward pass of a Llama (or a stage of it) keeps alive for backward, in bytes.

Counted as for the GPT (see [Note: activation bytes] in models/gpt/activations.py, where
``c`` and ``f`` are defined), per micro-batch of ``N = B * T`` rows, with ``h``
and ``h_kv`` this rank's query and key/value heads, ``hs`` the head size and
``F`` this rank's share of the MLP width:

==========================  =========================================================
RMS norm                    output ``N C c``, 1/rms ``N f`` (backward normalises again)
q, k, v projections         none: read by the packing alone, let go of once packed
rotary q, k and packing     packed q|k|v for attention ``3 N h hs c`` (backward reads
                            the model's tables again: none of its own)
attention                   weights ``B h T^2 f``, output ``N h hs c``
o / down projections        none: the residual add lets go of them (tp > 1: of the summed
                            rows too, this rank's partial products let go, see the GPT's
                            table)
gate, up; SwiGLU            ``2 N F c``; output ``N F c`` (backward computes the sigmoid
                            again)
residual adds               ``2 N C c``
==========================  =========================================================

The first stage keeps the looked-up token rows (vocabulary-parallel: as the
GPT's), the last the final norm, logits and loss as the GPT's; a stage that sends
its output on keeps none of it, as the GPT's. Context and
sequence parallelism change what they change in the GPT (see its note): the
attention term, and ``N / sp`` rows for norms, adds and reduce-scattered outputs;
a key/value projection kept whole (tp does not divide ``n_kv_head``) keeps the
input it all-gathered, ``N C c`` each (without sequence parallelism its output, ``N
h_kv hs c``, which the op summing its gradient over tp holds). Where the attention
takes the one-op path (whole sequences, plain projections:
:func:`~mpishard.autodiff.gqa_attention.gqa_attention`),
the q, k, v and packing rows are instead the rotated q, k and the values,
``N hs (h + 2 h_kv)`` in the products' dtype (``f`` on NumPy, whose 16-bit products
run in float32; ``c`` on a device), and on a device the rotations' conjugates, ``T hs
(h + h_kv) f`` (NumPy's backward makes them again); on a device whose flash kernels
take the heads (``MPISHARD_ATTENTION=fused``) the per-projection path runs instead,
its attention keeping the head-major output and the log-sum-exp, not the ``T x T``
weights the one op keeps.
"""
from __future__ import annotations

import numpy as np

from mpishard.kernels import fused_attention
from mpishard.models.activations import (attention_bytes, graph_objects, head_and_loss,
                                         micro_batch, routing_indices, row_parallel,
                                         stage_input, width)

__all__ = ["llama_activation_bytes"]


def _row_split(linear) -> bool:
    """Whether tp splits the output features (a column-parallel layer)."""
    return width(linear) != int(linear.out_features)

def _mlp_bytes(mlp, N: int, Ns: int, C: int, c: int, f: int) -> int:
    """The MLP's share: SwiGLU's, or a mixture of experts' (router logits and
    probabilities ``2 N E c``, top-k and weights ``2 N k c``, and for the ``M = N k``
    routed rows (dropless; fewer with a capacity) their gathered input ``M C c``, the
    experts' gate|up ``2 M F c``, outputs and weighted outputs ``2 M C c``, weights
    ``M c``; the combined rows ``N C c``; under expert parallelism also the rows
    received, put in expert order, put back and returned, ``4 M C c`` when the
    routing is even)."""
    if hasattr(mlp, "experts"):
        E, k = mlp.n_experts, mlp.top_k
        F = int(mlp.experts.down_proj.shape[2])
        M = N * k
        shared = mlp._modules.get("shared_expert")
        router = 2 * N * E * c if mlp.router == "softmax" else 5 * N * E * c   # sigmoid's steps
        exchanged = 4 * M * C * c if mlp.dispatch is not None else 0
        # the combined rows are the block's residual branch (let go of) unless a shared
        # expert's output is added to them; then they and its down projection's output
        # are kept by that add, and the sum let go of
        return router + 2 * N * k * c + M * C * c + 2 * M * F * c + 2 * M * C * c \
            + M * c + exchanged + routing_indices(N, E, k, c) + _MOE_OBJECTS + (
                N * C * c + _mlp_bytes(shared, N, Ns, C, c, f) + _MOE_OBJECTS
                + (Ns if row_parallel(shared.down_proj) else N) * C * c
                if shared is not None else 0)
    F = width(mlp.gate_proj)
    return 2 * N * F * c + N * F * c                                      # gate, up; SwiGLU


#: the graph's Python objects per block (tensors, closures): measured, bytes; and those
#: the per-projection path's attention adds (three products, reshapes and the packing
#: in place of one op): measured, 7-8 KiB on CPython 3.11
_OBJECTS_PER_BLOCK = 14 << 10
_OBJECTS_PER_PROJECTION_PATH = 7 << 10
#: and those of a mixture of experts' routing ops (the router's softmax, top-k, the
#: gathers, weights and scatter), and again of a shared expert and its add: measured
#: (3-5 KiB and 4-5 KiB more, float32 and bfloat16, on CPython 3.11)
_MOE_OBJECTS = 4 << 10


def llama_activation_bytes(model, batch_size: int, seq_len: int, dtype="float32",
                           checkpointing: bool | None = None, *, cp: int | None = None,
                           cp_mode: str | None = None, sp: int | None = None,
                           lean: bool | None = None) -> int:
    """Bytes ``model`` keeps for backward after one micro-batch ``(batch_size, seq_len)``;
    the arguments are :func:`~mpishard.models.gpt.activations.gpt_activation_bytes`'s."""
    cfg = model.config
    blocks = list(model.model.layers.values())
    m = micro_batch(model, blocks, batch_size, seq_len, dtype, checkpointing, cp, cp_mode, sp,
                    lean)
    B, T, N, Ns, C, c, f, cp, sp = m.B, m.T, m.N, m.Ns, m.C, m.c, m.f, m.cp, m.sp
    hs = cfg.head_size
    total = graph_objects(len(blocks), m.checkpointing, sp, cp, m.cp_mode, _OBJECTS_PER_BLOCK)
    total += stage_input(model.model.embed_tokens if model.first_stage else None, m)
    norm = m.norm(Ns) + Ns * f                        # and 1/rms
    for block in blocks:
        if m.checkpointing:
            total += Ns * C * c
            if getattr(block, "keep_products", False):   # "op": q, v, gate and down
                attn, mlp = block.self_attn, block.mlp    # (its partial sums over tp)
                total += N * (width(attn.q_proj) + width(attn.v_proj)
                              + width(mlp.gate_proj) + C) * c
            continue
        attn, mlp = block.self_attn, block.mlp
        h, h_kv = width(attn.q_proj) // hs, width(attn.k_proj) // hs
        total += 2 * norm
        whole = sum(not _row_split(p) for p in (attn.k_proj, attn.v_proj))
        if sp > 1:   # the whole key/value projections' gathered inputs
            total += N * C * c * whole
        elif _row_split(attn.q_proj):   # tp > 1: their outputs, read by the summing op
            total += N * hs * h_kv * c * whole        # (copy_to_tp) the packing lets go of
        one_op = attn.takes_one_op_path(model.backend.xp)
        total += 0 if cp == sp == 1 and one_op else _OBJECTS_PER_PROJECTION_PATH
        fused = not one_op and fused_attention(model.backend.xp, hs, False)
        if attn.recompute_core and not fused:   # selective: the recomputed op's output
            total += N * h * hs * c             # (and outside the one op, the packed
            if not (cp == sp == 1 and one_op):                    # rows it reads)
                total += 3 * N * h * hs * c
        else:
            if cp == sp == 1 and one_op:   # rotated q, k, v (in the products' dtype:
                kd = f if model.backend.xp is np else c     # float32 on NumPy for 16-bit
                total += N * hs * (h + 2 * h_kv) * kd + (      # rows); on a device
                    0 if m.lean else T * hs * (h + h_kv) * f)    # the rotations' conjugates
            else:
                total += 3 * N * h * hs * c              # the packed rows (rope_qkv keeps
                #                                          no tables: it reads the model's)
            total += attention_bytes(B, h, T, hs, c, f, cp, m.cp_mode, fused)   # attention
        total += _mlp_bytes(mlp, N, Ns, C, c, f)
        total += 2 * Ns * C * c                                           # residual adds
    if model.last_stage:
        total += norm + head_and_loss(model.lm_head, N, c, f)
    else:      # its output (a residual add's): sent on and let go of, as a GPT's
        total -= Ns * C * c
    return int(total)

"""What one forward pass of a GPT (or a stage of it) keeps alive for backward, in bytes.

[Note: activation bytes]
Counted per micro-batch of ``N = B * T`` rows from the ops in
mpishard/autodiff (what each output is, and what each backward closure holds;
``c`` is the activation dtype's size, ``f`` the size reductions are kept in:
float32 for 16-bit activations, else ``c``):

===================  ===============================================================
layer norm (width W) output ``N W c``, normalised input ``N W f``, 1/std ``N f``
linear (out O)       output ``N O c`` (its input is the previous op's output)
attention            weights ``B h T^2 f`` (``h`` this rank's heads), output ``N A c``
                     (``A = h * head_size``); with dropout the mask, ``B h T^2 f``
GELU (width F)       output ``N F c``, tanh ``N F f``
residual add         ``N C c``; dropout (``p > 0``): mask and output, ``2 N C c``
row-parallel linear  tp > 1: the summed copy after the all-reduce, ``N C c`` more,
                     and the bias added after it, ``N C c`` more
embeddings           tokens ``N C c`` (tp > 1: rows, mask, product, sum, ids:
                     ``3 N C c + N c + 8 N``), positions ``T C c + 8 T``, sum ``N C c``
loss                 logits ``N V c``; exp-shifted logits ``N V f`` (+ their float32
                     copy ``N V 4`` for 16-bit logits on one rank), ``~18 N`` of
                     per-row indices, flags and sums
a later stage        the received activations, ``N C c``
===================  ===============================================================

With activation checkpointing a block keeps only its output, ``N C c`` (its
input is the previous block's output). The graph's own Python objects (tensors,
closures) add a few KiB per block, counted as measured on CPython 3.11. The ledger measures the same quantity
(``MemoryLedger.measure_activations``); tests/test_layout_plan.py holds the two
together. Backward needs one block's worth more for a moment (its recompute,
under checkpointing) and the gradients, which this does not count.
"""
from __future__ import annotations

import numpy as np

__all__ = ["gpt_activation_bytes"]

#: the graph's Python objects (tensors, closures): measured, bytes
_OBJECTS_BASE, _OBJECTS_PER_BLOCK, _OBJECTS_PER_CHECKPOINTED_BLOCK = 8 << 10, 8 << 10, 1536


def _width(linear) -> int:
    """This rank's output features of a (possibly column-parallel) linear layer."""
    return int(linear.weight.shape[0])


def _row_parallel(linear) -> bool:
    return int(linear.weight.shape[1]) != int(linear.in_features)


def gpt_activation_bytes(model, batch_size: int, seq_len: int, dtype="float32",
                         checkpointing: bool | None = None) -> int:
    """Bytes ``model`` (a GPT or one pipeline stage, tensor-parallel or not) keeps for
    backward after the forward of one micro-batch ``(batch_size, seq_len)`` with
    activations in ``dtype``; see [Note: activation bytes].

    ``checkpointing``: whether blocks recompute in backward (default: as the
    model is set).
    """
    cfg = model.config
    c = np.dtype(dtype).itemsize
    f = 4 if c == 2 else c
    B, T, C = batch_size, seq_len, cfg.n_embd
    N = B * T
    blocks = list(model.transformer.h.values())
    if checkpointing is None:
        checkpointing = any(b.activation_checkpointing for b in blocks)
    total = _OBJECTS_BASE + len(blocks) * (_OBJECTS_PER_CHECKPOINTED_BLOCK if checkpointing
                                            else _OBJECTS_PER_BLOCK)
    if model.first_stage:
        wte = model.transformer.wte
        split_vocab = int(wte.weight.shape[0]) != int(wte.num_embeddings)
        tokens = 3 * N * C * c + N * c + 8 * N if split_vocab else N * C * c
        total += tokens + T * C * c + 8 * T + N * C * c
        if cfg.dropout > 0:
            total += 2 * N * C * c
    else:
        total += N * C * c                                  # the received activations
    for block in blocks:
        if checkpointing:
            total += N * C * c
            continue
        attn, mlp = block.attn, block.mlp
        qkv = _width(attn.c_attn)
        heads = qkv // (3 * attn.head_size)
        norms = 2 * (N * C * (c + f) + N * f)
        linears = N * qkv * c + N * C * c + N * _width(mlp.c_fc) * c + N * C * c
        reduced = N * C * c * sum((1 + (lin.bias is not None)) * _row_parallel(lin)
                                  for lin in (attn.c_proj, mlp.c_proj))
        attention = B * heads * T * T * f + N * (qkv // 3) * c
        gelu = N * _width(mlp.c_fc) * (c + f)
        adds = 2 * N * C * c
        dropouts = (4 * N * C * c + B * heads * T * T * f) if cfg.dropout > 0 else 0
        total += norms + linears + reduced + attention + gelu + adds + dropouts
    if model.last_stage:
        vocab = _width(model.lm_head)
        split_vocab = vocab != int(model.lm_head.out_features)
        total += N * C * (c + f) + N * f                    # ln_f
        total += N * vocab * c + N * vocab * f              # logits, exp-shifted logits
        if c == 2 and not split_vocab:
            total += N * vocab * 4                          # their float32 copy, kept
        total += N * (18 + f)                               # per-row ids, flags, sums
    return int(total)

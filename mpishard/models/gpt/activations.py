"""What one forward pass of a GPT (or a stage of it) keeps alive for backward, in bytes.

[Note: activation bytes]
Counted per micro-batch of ``N = B * T`` rows from the ops in
mpishard/autodiff (what each output is, and what each backward closure holds;
``c`` is the activation dtype's size, ``f`` the size reductions are kept in:
float32 for 16-bit activations, else ``c``):

===================  ===============================================================
layer norm (width W) output ``N W c`` (backward normalises its input again, see
                     [Note: what ops keep] in mpishard/autodiff/rows.py)
linear (out O)       output ``N O c`` (its input is the previous op's output); the
                     last of a residual branch (attention's and the MLP's ``c_proj``)
                     none: the residual add lets go of it (``Dropout.add_to``), and a
                     row-parallel one (tp > 1) of its partial product and, under
                     sequence parallelism, of its reduce-scattered rows before the
                     bias's add (the bias's use is summed over tp in a forward hook)
attention            weights ``B h T^2 f`` (``h`` this rank's heads), output ``N A c``
                     (``A = h * head_size``); with dropout its mask, ``B h T^2`` (a
                     byte each; a device: its float32 draws, four); a GPU's fused kernels (``MPISHARD_ATTENTION=fused``,
                     no dropout): instead of the weights the head-major output ``N A c``
                     and a log-sum-exp per row ``B h T f``
GELU (width F)       output ``N F c`` (backward computes its tanh again)
residual add         ``N C c``; with its branch's dropout (``p > 0``, one fused op)
                     the mask, ``N C`` (a byte each); a dropout alone: mask and output
embeddings           ids ``8 T`` of the positions (tp > 1: the tokens' local ids and
                     mask, ``8 N + N c``), the sum ``N C c`` (the lookups let go of);
                     with dropout instead its mask and output, ``N C (1 + c)``
                     (under sequence parallelism on this rank's rows, ``N / sp``)
loss                 logits ``N V c`` and ``(9 + 2 f) N`` of per-row target ids,
                     flags, maxima and sums of exponentials (backward recomputes the
                     softmax block by block); vocabulary-parallel (tp > 1): ``(18 +
                     2 f) N`` (row ids and its own target flags too)
a later stage        the received activations, ``N C c``
a stage's output     none where a later stage takes it: sent there and let go of
                     (see [Note: sent outputs] in mpishard/parallel/pipeline/schedule.py)
===================  ===============================================================

Under context parallelism ``T`` is this rank's rows of each sequence (``T_global
/ cp``) and attention keeps, instead of its ``T x T`` weights: ring attention a
per-row log-sum-exp, ``B h T f``, beside its output (backward recomputes the scores
block by block, and reads the output for FlashAttention's ``rowsum(dO * O)``);
all-to-all (Ulysses) the head-split copy of q, k and v,
``3 N A c``, the weights of its ``h / cp`` heads over the whole sequence, ``B h
cp T^2 f``, and the output back in the sequence split, ``N A c`` more. Under
sequence parallelism (``sp`` = tp ranks) the rows outside the tensor-parallel
layers are ``N / sp``: norms, residual adds, dropouts (the embeddings' too: it
drops the cut rows), the received activations, the embeddings' cut rows (``N C c
/ sp`` more; the whole rows let go). A
column-parallel layer keeps only its own rows of the input it all-gathers
(backward gathers them again); a layer the plan keeps whole keeps the gathered
input, ``N C c``.

With activation checkpointing a block keeps only its output, ``N C c`` (its
input is the previous block's output); recomputed by op (``"op"``, see [Note:
recomputation by op] in mpishard/models/checkpointing.py) also the outputs of its
q/k/v and first MLP products, ``N (3A + F) c`` (this rank's widths). The graph's own Python objects (tensors,
closures) add a few KiB per block (more under sequence and context parallelism),
counted as measured on CPython 3.11. The ledger measures the same quantity
(``MemoryLedger.measure_activations``); tests/planning/test_layout_plan.py holds the two
together. Backward needs one block's worth more for a moment (its recompute,
under checkpointing) and the gradients, which this does not count.
"""
from __future__ import annotations

from mpishard.kernels import fused_attention
from mpishard.models.activations import (attention_bytes, graph_objects, head_and_loss,
                                         micro_batch, routing_indices, stage_input, width)

__all__ = ["gpt_activation_bytes"]

#: a mixture-of-experts block's graph has more (the router's and the dispatch's steps)
_OBJECTS_MOE_PER_BLOCK = 11 << 10


def gpt_activation_bytes(model, batch_size: int, seq_len: int, dtype="float32",
                         checkpointing: bool | None = None, *, cp: int | None = None,
                         cp_mode: str | None = None, sp: int | None = None,
                         lean: bool | None = None) -> int:
    """Bytes ``model`` (a GPT or one pipeline stage, tensor-parallel or not) keeps for
    backward after the forward of one micro-batch ``(batch_size, seq_len)`` with
    activations in ``dtype``; see [Note: activation bytes].

    ``seq_len`` is this rank's rows of each sequence (under context parallelism
    ``1 / cp`` of it). ``checkpointing``: whether blocks recompute in backward
    (default: as the model is set). ``cp``, ``cp_mode`` (``"ring"`` or
    ``"all-to-all"``) and ``sp`` (the tp ranks sequence parallelism splits rows
    over, 1 without it): default as the model is set
    (:func:`~mpishard.models.activations.split_of`). ``lean``: whether the ops keep the
    least (default: as they do on the model's array module; ``False`` counts what a
    device's kernels keep, see [Note: what ops keep] in mpishard/autodiff/rows.py).
    """
    cfg = model.config
    blocks = list(model.transformer.h.values())
    m = micro_batch(model, blocks, batch_size, seq_len, dtype, checkpointing, cp, cp_mode, sp,
                    lean)
    B, T, N, Ns, C, c, f, cp, sp = m.B, m.T, m.N, m.Ns, m.C, m.c, m.f, m.cp, m.sp
    total = graph_objects(len(blocks), m.checkpointing, sp, cp, m.cp_mode)
    total += stage_input(model.transformer.wte if model.first_stage else None, m, rows=False)
    if model.first_stage:      # the positions' ids; the sum (the blocks' input without
        total += 8 * T         # dropout), else the dropout's mask and output (under sp
        if cfg.dropout > 0:    # it drops the cut rows, counted as the stage's input)
            total += Ns * C * m.mask + (N * C * c if sp == 1 else 0)
        elif sp == 1:
            total += N * C * c
    if not model.last_stage:   # its output (a residual add's): sent on, let go of
        total -= Ns * C * c
    for block in blocks:
        if m.checkpointing:
            total += Ns * C * c
            if getattr(block, "keep_products", False):   # "op": the q/k/v and first MLP
                total += N * (width(block.attn.c_attn) + width(block.mlp.c_fc)) * c  # products
            continue
        attn, mlp = block.attn, block.mlp
        qkv = width(attn.c_attn)
        heads = qkv // (3 * attn.head_size)
        norms = 2 * m.norm(Ns)
        if hasattr(mlp, "experts"):   # a mixture of GELU experts (as Llama's, with 4C)
            E, k, H = mlp.n_experts, mlp.top_k, int(mlp.experts.c_fc_weight.shape[1])
            M = N * k
            linears = N * qkv * c + 2 * N * E * c + 2 * N * k * c + M * C * c \
                + 2 * M * C * c + M * c + N * C * c
            if mlp.router != "softmax":
                linears += 3 * N * E * c                    # sigmoid's steps
            if mlp.dispatch is not None:                    # expert parallel, even routing
                linears += 4 * M * C * c                    # (see models/llama/activations.py)
            linears += routing_indices(N, E, k, c) + _OBJECTS_MOE_PER_BLOCK
            if "shared_expert" in mlp._modules:             # a GPT MLP every row goes
                linears += 2 * N * C * c + 2 * N * H * c
            gelu = M * H * c
        else:
            linears = N * qkv * c + N * width(mlp.c_fc) * c
            gelu = N * width(mlp.c_fc) * c
        fused = fused_attention(model.backend.xp, attn.head_size, cfg.dropout > 0)
        selective = attn.recompute_core and not fused     # the core kept as its output only
        attention = N * heads * attn.head_size * c if selective else \
            attention_bytes(B, heads, T, attn.head_size, c, f, cp, m.cp_mode, fused)
        adds = 2 * Ns * C * c
        # the residual branches' draws: attention's and the MLP's (a mixture of experts'
        # output has none; its shared expert, a GPT MLP, has its own), and the weights'
        branches = 2 if not hasattr(mlp, "experts") or "shared_expert" in mlp._modules else 1
        weights = 0 if selective else B * heads * T * T
        dropouts = (branches * Ns * C + weights) * m.mask if cfg.dropout > 0 else 0
        total += norms + linears + attention + gelu + adds + dropouts
    if model.last_stage:
        total += m.norm(Ns)                                 # ln_f
        total += head_and_loss(model.lm_head, N, c, f)
    return int(total)

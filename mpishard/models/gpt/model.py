"""GPT, after nanoGPT's ``model.py``: same config fields, same parameter names.

Weights are stored ``[out, in]`` and named as in nanoGPT
(``transformer.wte.weight``, ``transformer.h.0.attn.c_attn.weight``, ...), so a
state dict exported from here loads into a PyTorch nanoGPT model. Activations
stay 2-D, ``(B*T, C)``, between blocks: BLAS is fastest on 2-D operands (a 3-D
activation times a 2-D weight was measured slower than the same product on the
flattened activation).

    >>> cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
    >>> model = GPT(cfg, seed=0)
    >>> logits, loss = model(idx, targets)      # idx, targets: (B, T) int arrays
    >>> model.set_activation_checkpointing(True)  # recompute blocks in backward
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mpishard.autodiff import nn_ops, softmax_ops
from mpishard.autodiff.recompute import every_second, recompute
from mpishard.autodiff.rows import release_values
from mpishard.autodiff.tensor import Tensor, is_grad_enabled
from mpishard.core.backend import Backend, xp_of
from mpishard.nn import (CrossEntropyLoss, Dropout, Embedding, LayerNorm, Linear, Module, ModuleDict,
                  unbiased)
from mpishard.nn.init import materialize
from mpishard.models.checkpointing import attend_core, check_op_mode, checkpointing_mode
from mpishard.models.generate import generate
from mpishard.models.gpt.activations import gpt_activation_bytes
from mpishard.models.moe import (GELUExperts, MoE, check_moe_checkpointing, check_moe_fields,
                  check_moe_layout, is_moe_block, with_router_losses)
from mpishard.nn.sharding import (ColumnParallel, ShardingPlan, PipelinePlan, RowParallel, VocabParallel,
                       VocabParallelLoss)

__all__ = ["GPTConfig", "GPT", "Block", "CausalSelfAttention", "MLP"]


@dataclass
class GPTConfig:
    """nanoGPT's model configuration."""

    block_size: int = 1024    # longest sequence the position table covers
    vocab_size: int = 50304   # tokens (GPT-2's 50257 padded to a multiple of 64)
    n_layer: int = 12         # transformer blocks
    n_head: int = 12          # attention heads per block
    n_embd: int = 768         # model width C; each head gets C // n_head
    dropout: float = 0.0      # dropout probability (0 for pretraining)
    bias: bool = True         # biases in Linear and LayerNorm layers
    # mixture of experts: GELU MLPs as experts (see LlamaConfig for the fields)
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_every: int = 1
    moe_capacity: float = 0.0
    moe_aux_coef: float = 0.001
    moe_z_coef: float = 0.0
    moe_router: str = "softmax"
    moe_shared_expert: bool = False

    def is_moe_block(self, i: int) -> bool:
        """Whether block ``i`` has a mixture of experts for its MLP."""
        return is_moe_block(self, i)

    def __post_init__(self):
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                f"pick n_embd a multiple of n_head (e.g. n_embd="
                f"{(self.n_embd // self.n_head + 1) * self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        check_moe_fields(self)


class CausalSelfAttention(Module):
    """Multi-head causal self-attention: ``c_attn`` -> attention -> ``c_proj``."""

    def __init__(self, config: GPTConfig, dtype: str = "float32"):
        super().__init__()
        C = config.n_embd
        proj_std = 0.02 / math.sqrt(2 * config.n_layer)  # GPT-2's scaled residual init
        self.c_attn = Linear(C, 3 * C, config.bias, dtype=dtype)
        self.c_proj = Linear(C, C, config.bias, init_std=proj_std, dtype=dtype)
        self.resid_dropout = Dropout(config.dropout)
        self.attn_dropout = Dropout(config.dropout)
        self.head_size = C // config.n_head
        self.sequence = None   # set under context parallelism (the plan's ``attention``)
        self.recompute_core = False   # selective recomputation (models/checkpointing.py)

    def forward(self, x, batch_size: int, residual=None):
        """The attention output; with ``residual``, ``residual +`` it (one fused
        dropout-and-add kernel, :func:`~mpishard.autodiff.dropout_add`)."""
        if self.sequence is None:  # c_attn's bias added in attention's first kernel
            qkv, bias = unbiased(self.c_attn, x)                   # (B*T, 3 * nh * hs)
            extra = {"bias": bias} if bias is not None else {}
            attend = softmax_ops.causal_self_attention
        else:
            qkv, extra, attend = self.c_attn(x), {}, self.sequence.attention
        n_head = qkv.shape[-1] // (3 * self.head_size)             # this rank's heads under tp
        y = attend_core(attend, qkv, n_head, batch_size, self.attn_dropout.p,
                        self.attn_dropout.rng, self.training, bias=extra.get("bias"),
                        selective=self.recompute_core)             # (B*T, nh * hs)
        return self.resid_dropout.add_to(residual, *unbiased(self.c_proj, y))


class MLP(Module):
    """``c_fc`` (C -> 4C), GELU, ``c_proj`` (4C -> C), dropout."""

    def __init__(self, config: GPTConfig, dtype: str = "float32"):
        super().__init__()
        C = config.n_embd
        self.c_fc = Linear(C, 4 * C, config.bias, dtype=dtype)
        self.c_proj = Linear(4 * C, C, config.bias,
                             init_std=0.02 / math.sqrt(2 * config.n_layer), dtype=dtype)
        self.dropout = Dropout(config.dropout)

    def forward(self, x, residual=None):
        """The MLP's output; with ``residual``, ``residual +`` it (fused as in attention)."""
        h = nn_ops.gelu(*unbiased(self.c_fc, x))            # the biases added in the
        return self.dropout.add_to(residual, *unbiased(self.c_proj, h))  # next kernels


class Block(Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``.

    With ``activation_checkpointing`` on (and grad mode on), the block keeps
    only its input for backward and recomputes the rest there
    (:func:`mpishard.autodiff.recompute`). The recompute calls :meth:`compute`,
    not the block, so the block's own forward hooks (ZeRO-3 gathers and
    releases a unit in them) run once per forward, never during the recompute.
    """

    def __init__(self, config: GPTConfig, dtype: str = "float32", index: int = 0):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, config.bias, dtype=dtype)
        self.attn = CausalSelfAttention(config, dtype)
        self.ln_2 = LayerNorm(config.n_embd, config.bias, dtype=dtype)
        c, C = config, config.n_embd
        if c.is_moe_block(index):   # GELU experts of width 4C, no dropout inside
            experts = GELUExperts(c.moe_experts, C, 4 * C, c.bias, 0.02,
                                  0.02 / math.sqrt(2 * c.n_layer), dtype)
            self.mlp = MoE(C, 4 * C, c.moe_experts, c.moe_top_k, c.moe_capacity or None,
                           0.02, dtype, experts=experts, router=c.moe_router,
                           shared=MLP(config, dtype) if c.moe_shared_expert else None)
        else:
            self.mlp = MLP(config, dtype)
        self.activation_checkpointing = False
        self.keep_products = False    # "op": see [Note: recomputation by op]

    def forward(self, x, batch_size: int):
        if self.activation_checkpointing and is_grad_enabled():
            return recompute(self.compute, x, batch_size, rngs=self._dropout_rngs(),
                             keep=every_second if self.keep_products else None)
        return self.compute(x, batch_size)

    def compute(self, x, batch_size: int):
        """The block's math, ``(B*T, C) -> (B*T, C)``, without the block's own hooks."""
        x = self.attn(self.ln_1(x), batch_size, residual=x)
        if isinstance(self.mlp, MLP):
            return self.mlp(self.ln_2(x), residual=x)
        return x + self.mlp(self.ln_2(x))

    def _dropout_rngs(self) -> list:
        """Generators of the dropouts that draw in this forward (the recompute replays them)."""
        return [m.rng for _, m in self.named_modules()
                if isinstance(m, Dropout) and m.training and m.p > 0.0]


class GPT(Module):
    """The GPT language model, or one pipeline stage of it.

    Args:
        config: :class:`GPTConfig`.
        seed: initialisation seed (values depend on seed and parameter name only).
        dtype: parameter and activation dtype, ``"float32"`` (default) or ``"float64"``.
        backend: where arrays live; NumPy by default.
        materialize_now: build parameter values immediately (the default); pass
            False to leave them empty for a strategy to materialise in shards.
        blocks: which blocks this model holds (default: all); they keep their
            global names, ``transformer.h.<i>``.
        first_stage: holds the embeddings and takes token ids.
        last_stage: holds the final norm and the output projection and returns
            logits and loss. A model that is not both takes or returns the
            ``(B*T, C)`` activations (a pipeline stage, see mpishard.parallel).
    """

    def __init__(self, config: GPTConfig, seed: int = 0, dtype: str = "float32",
                 backend: Backend | None = None, materialize_now: bool = True,
                 blocks=None, first_stage: bool = True, last_stage: bool = True):
        super().__init__()
        self.config = config
        self.backend = backend or Backend()
        self.seed = seed
        self.dtype = dtype
        self.first_stage, self.last_stage = first_stage, last_stage
        self.block_ids = list(range(config.n_layer) if blocks is None else blocks)
        if any(not 0 <= i < config.n_layer for i in self.block_ids):
            raise ValueError(f"blocks {self.block_ids} out of range for n_layer={config.n_layer}")
        C = config.n_embd
        parts = {}
        if first_stage or last_stage:  # the last stage needs it for the tied output layer
            parts["wte"] = Embedding(config.vocab_size, C, dtype=dtype)
        if first_stage:
            parts["wpe"] = Embedding(config.block_size, C, dtype=dtype)
            parts["drop"] = Dropout(config.dropout)
        check_moe_layout(config, first_stage and last_stage)
        parts["h"] = ModuleDict(**{str(i): Block(config, dtype, i) for i in self.block_ids})
        if last_stage:
            parts["ln_f"] = LayerNorm(C, config.bias, dtype=dtype)
        self.transformer = ModuleDict(**parts)
        if last_stage:
            self.lm_head = Linear(C, config.vocab_size, bias=False, dtype=dtype)
            # Weight tying, as in nanoGPT: the output projection is the token table.
            self.lm_head.weight = self.transformer.wte.weight
            # (logits (N, V), targets (N,)) -> mean loss; the tensor-parallel plan
            # swaps in the vocabulary-parallel cross-entropy.
            self.loss = CrossEntropyLoss()
        self.sequence = None   # this rank's share of each sequence (context parallel)
        if materialize_now:
            materialize(self, seed, self.backend)

    def set_activation_checkpointing(self, enabled: bool | str = True) -> "GPT":
        """Recompute activations in backward instead of keeping them.

        ``True`` or ``"full"``: each block (it then keeps only its ``(B*T, C)``
        input), for about one extra forward per step. ``"selective"``: only
        attention's core, the ``T x T`` scores, softmax, dropout and product
        with v (see [Note: selective recomputation] in
        mpishard/models/checkpointing.py). ``"op"``: each block, keeping the outputs
        of its q/k/v and first MLP products (see [Note: recomputation by op]).
        ``False`` / ``"none"``: none of them.
        Gradients are bit-identical either way. Works with tensor parallelism,
        pipeline stages and ZeRO (see [Note: recompute] in
        mpishard/autodiff/recompute.py). Returns the model.
        """
        mode = checkpointing_mode(enabled)
        check_moe_checkpointing(self.config, mode in ("full", "op"))
        check_op_mode(self.config, mode)
        for block in self.transformer.h.values():
            block.activation_checkpointing = mode in ("full", "op")
            block.keep_products = mode == "op"
            block.attn.recompute_core = mode == "selective"
        return self

    def parallel_plan(self) -> ShardingPlan:
        """How the GPT is split (see [Note: parallel plans] in mpishard/nn/sharding.py).

        Tensor parallel as Megatron-LM: attention by heads (the fused q/k/v
        projection column-parallel in three head-split segments, the output
        projection row-parallel), the MLP by hidden features, the token table
        and the tied output layer by vocabulary, the loss from split logits.
        ZeRO units: one per block. Pipeline stages: runs of blocks, the first
        stage adding the embeddings, the last the final norm and the head.
        """
        head = self.config.n_embd // self.config.n_head
        return ShardingPlan(
            tensor=(("transformer.wte", VocabParallel()),
                    ("transformer.h.*.attn.c_attn", ColumnParallel(3, head, "n_head")),
                    ("transformer.h.*.attn.c_proj", RowParallel(head, "n_head")),
                    ("transformer.h.*.mlp.c_fc", ColumnParallel()),
                    ("transformer.h.*.mlp.c_proj", RowParallel()),
                    ("lm_head", ColumnParallel(groups="vocabulary")),
                    ("loss", VocabParallelLoss("lm_head"))),
            units=tuple(f"transformer.h.{i}" for i in self.block_ids),
            pipeline=PipelinePlan("transformer.h", first=("transformer.wte", "transformer.wpe"),
                                  last=("transformer.ln_f", "lm_head")),
            tied=(("lm_head.weight", "transformer.wte.weight"),),
            attention=("transformer.h.*.attn",), sequence_entry="transformer.drop")

    def pipeline_stage(self, blocks, first_stage: bool, last_stage: bool) -> "GPT":
        """A new, unmaterialised GPT holding ``blocks`` (and, first or last, what those
        stages add): see [Note: pipeline stage interface] in mpishard/nn/sharding.py."""
        return GPT(self.config, seed=self.seed, dtype=self.dtype, backend=self.backend,
                   materialize_now=False, blocks=blocks, first_stage=first_stage,
                   last_stage=last_stage)

    def activation_bytes(self, batch_size: int, seq_len: int, dtype="float32",
                         lean: bool | None = None) -> int:
        """Bytes one micro-batch's forward keeps for backward on this model or stage
        (see [Note: activation bytes] in mpishard/models/gpt/activations.py; ``lean``:
        :func:`~mpishard.models.gpt.activations.gpt_activation_bytes`'s)."""
        return gpt_activation_bytes(self, batch_size, seq_len, dtype, lean=lean)

    def activation_shape(self, batch_size: int, seq_len: int) -> tuple:
        """What one stage hands the next: ``(B*T, C)``."""
        return (batch_size * seq_len, self.config.n_embd)

    def forward(self, inputs, targets=None, batch_size: int | None = None):
        """Run this model (or stage).

        Args:
            inputs: ``(B, T)`` token ids on the first stage, else the previous
                stage's ``(B*T, C)`` activations.
            targets: ``(B, T)`` next-token ids (last stage).
            batch_size: ``B``, needed when ``inputs`` are activations.

        Returns:
            On the last stage ``(logits, loss)`` with logits ``(B, T, V)`` (``V``
            local to this rank under tensor parallelism) and the mean
            cross-entropy (``None`` without targets); otherwise the ``(B*T, C)``
            activations for the next stage.
        """
        if self.first_stage:
            idx = inputs.data if isinstance(inputs, Tensor) else inputs
            idx = self.backend.asarray(idx)                        # token ids onto the device
            B, T = idx.shape
            seq = self.sequence
            if (seq.global_length(T) if seq else T) > self.config.block_size:
                raise ValueError(f"sequence length {seq.global_length(T) if seq else T} "
                                 f"exceeds block_size {self.config.block_size}")
            xp = xp_of(self.transformer.wte.weight.data)
            tok = self.transformer.wte(idx)                        # (B, T, C)
            pos = self.transformer.wpe(seq.positions(T, xp) if seq else xp.arange(T))
            summed = tok + pos
            rows = summed.reshape(B * T, self.config.n_embd)       # (B*T, C)
            x = self.transformer.drop(rows)
            # backward reads none of these values (the lookups keep their ids, a
            # dropout its mask): let them go unless the sum is the blocks' input
            for spent in (tok, pos) + ((summed, rows) if x is not rows else ()):
                release_values(spent)
        else:
            if batch_size is None:
                raise ValueError("a stage that is not first needs batch_size")
            x, B = inputs, batch_size
            T = x.shape[0] * getattr(self, "sequence_parallel_size", 1) // B  # sp: 1/tp rows
        for block in self.transformer.h.values():
            x = block(x, B)
        if not self.last_stage:
            return x
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)                                   # (B*T, V)
        loss = None
        if targets is not None:
            targets = self.backend.asarray(targets.data if isinstance(targets, Tensor) else targets)
            loss = self.loss(logits, targets.reshape(B * T))
            loss = with_router_losses(loss, [b.mlp for b in self.transformer.h.values()],
                                      self.config)   # see [Note: load-balancing loss]
        return logits.reshape(B, T, logits.shape[-1]), loss

    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, rng=None):
        """Extend ``idx`` ``(B, T)`` by sampling ``max_new_tokens`` tokens (whole models only)."""
        return generate(self, idx, max_new_tokens, temperature, top_k, rng)

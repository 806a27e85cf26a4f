"""The Llama family (Llama 2 and 3, and the many models shaped like it), in Hugging Face's layout.

RMS norm, rotary position embeddings (theta, and Llama 3's frequency scaling),
a SwiGLU MLP, grouped-query attention (``n_kv_head <= n_head``), no biases (or,
with ``qkv_bias``, biases on the q, k and v projections, as Qwen2 has them), a
tied or untied output head. Parameter names and shapes are those of
``transformers``' ``LlamaForCausalLM`` (``model.layers.0.self_attn.q_proj.weight``,
weights ``[out, in]``, rotary embeddings on the two halves of each head), so
its weights load as they are (mpishard.hf). Activations stay 2-D, ``(B*T, C)``,
between blocks, as in the GPT.

    >>> cfg = LlamaConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_kv_head=2,
    ...                   n_embd=64)
    >>> model = Llama(cfg, seed=0)
    >>> logits, loss = model(idx, targets)      # idx, targets: (B, T) int arrays
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpishard.autodiff import softmax_ops
from mpishard.autodiff.gqa_attention import gqa_attention
from mpishard.autodiff.rms_rope_swiglu import rms_norm, rope_qkv, rope_tables, swiglu
from mpishard.autodiff.shape_ops import reshape
from mpishard.autodiff.recompute import every_second, recompute
from mpishard.autodiff.rows import release_branch, release_values
from mpishard.autodiff.tensor import Tensor, is_grad_enabled
from mpishard.core.backend import Backend, xp_of
from mpishard.kernels import fused_attention
from mpishard.nn import Constant, CrossEntropyLoss, Embedding, Linear, Module, ModuleDict, Parameter
from mpishard.nn.init import materialize
from mpishard.nn.sharding import (ColumnParallel, ShardingPlan, PipelinePlan, RowParallel, VocabParallel,
                       VocabParallelLoss)
from mpishard.models.checkpointing import attend_core, check_op_mode, checkpointing_mode
from mpishard.models.generate import generate
from mpishard.models.llama.activations import llama_activation_bytes
from mpishard.models.moe import (MoE, check_moe_checkpointing, check_moe_fields, check_moe_layout,
                  is_moe_block, with_router_losses)

__all__ = ["LlamaConfig", "Llama", "LlamaBlock", "LlamaAttention", "LlamaMLP", "RMSNorm"]


@dataclass
class LlamaConfig:
    """A Llama-shaped model's configuration (``transformers``' ``LlamaConfig`` names in
    comments)."""

    vocab_size: int = 32000        # vocab_size
    block_size: int = 2048         # the longest sequence trained (at most the reach below)
    n_layer: int = 16              # num_hidden_layers
    n_head: int = 16               # num_attention_heads
    n_kv_head: int = 0             # num_key_value_heads (0: n_head, no grouping)
    n_embd: int = 1024             # hidden_size C; each head gets C // n_head
    intermediate_size: int = 0     # the MLP's width (0: 8C/3 rounded up to a multiple of 256)
    rope_theta: float = 10000.0    # rope_theta
    rope_scaling: dict | None = None   # rope_scaling: None or Llama 3's {"rope_type": "llama3",
    #                                    "factor", "low_freq_factor", "high_freq_factor",
    #                                    "original_max_position_embeddings"}
    rms_eps: float = 1e-5          # rms_norm_eps
    tie_embeddings: bool = False   # tie_word_embeddings
    qkv_bias: bool = False         # biases on q_proj, k_proj and v_proj (Qwen2's; not o_proj)
    positions: int = 0             # max_position_embeddings: the context the model is made
    #                                for (0: block_size); a run trains at block_size, up to
    #                                it or, with llama3 scaling, to factor x the original
    init_std: float = 0.02         # initializer_range
    # mixture of experts (Mixtral's names): 0 experts is a dense model
    moe_experts: int = 0           # num_local_experts
    moe_top_k: int = 2             # num_experts_per_tok
    moe_every: int = 1             # every moe_every-th block is a mixture (1: all)
    moe_capacity: float = 0.0      # capacity factor (0: dropless)
    moe_aux_coef: float = 0.001    # router_aux_loss_coef (the load-balancing loss)
    moe_z_coef: float = 0.0        # router z-loss coefficient
    moe_router: str = "softmax"    # "softmax" (Mixtral) or "sigmoid" (DeepSeek-V3) scores
    moe_shared_expert: bool = False    # one more SwiGLU MLP every token goes through

    def is_moe_block(self, i: int) -> bool:
        """Whether block ``i`` has a mixture of experts for its MLP."""
        return is_moe_block(self, i)

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head
        if self.n_embd % self.n_head:
            raise ValueError(f"LlamaConfig: n_embd={self.n_embd} is not divisible by n_head="
                             f"{self.n_head}; pick n_embd a multiple of n_head")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(f"LlamaConfig: the head size {self.n_embd // self.n_head} is odd; "
                             f"rotary embeddings rotate pairs, pick an even n_embd / n_head")
        if not 1 <= self.n_kv_head <= self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"LlamaConfig: n_kv_head={self.n_kv_head} must divide n_head="
                             f"{self.n_head} (grouped-query attention: each key/value head "
                             f"serves n_head / n_kv_head query heads)")
        check_moe_fields(self)
        if self.intermediate_size == 0:
            self.intermediate_size = 256 * -(-(8 * self.n_embd // 3) // 256)
        scaling = self.rope_scaling
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind != "llama3":
                raise ValueError(f"LlamaConfig: rope_scaling type {kind!r} is not implemented; "
                                 f"mpishard has Llama 3's ('llama3') or none")
            keys = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")
            missing = [k for k in keys if k not in scaling]
            if missing:
                raise ValueError(f"LlamaConfig: rope_scaling lacks {', '.join(missing)}")
            self.rope_scaling = {"rope_type": "llama3", **{k: scaling[k] for k in keys}}
        if self.positions == 0:
            self.positions = self.block_size
        if self.block_size > self.reach:
            raise ValueError(f"LlamaConfig: block_size = {self.block_size} is beyond the "
                             f"{self.positions} positions the model is made for (positions, "
                             f"max_position_embeddings) and no rope scaling reaches it; "
                             f"train at --block-size {self.reach} or less")

    @property
    def reach(self) -> int:
        """The longest sequence the model takes: its positions, or as far as Llama 3's
        frequency scaling stretches the original context (``factor`` times it)."""
        scaling = self.rope_scaling
        stretched = 0 if scaling is None else int(
            scaling["factor"] * scaling["original_max_position_embeddings"])
        return max(self.positions, stretched)

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head


def plain_linears(*modules) -> bool:
    """Whether ``modules`` are all bias-free :class:`Linear` layers with no hooks: what
    the one-op attention path (mpishard/autodiff/gqa_attention.py) can stand in for. Tensor
    parallelism swaps them for its own layers or hooks them, and takes the
    per-projection path."""
    return all(type(m) is Linear and m.bias is None and not m._forward_pre_hooks
               and not m._forward_hooks for m in modules)


class RMSNorm(Module):
    """``x / rms(x) * weight`` over the last axis."""

    def __init__(self, dim: int, eps: float = 1e-5, dtype: str = "float32"):
        super().__init__()
        self.eps = eps
        self.weight = Parameter((dim,), Constant(1.0), False, dtype)

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class LlamaAttention(Module):
    """q/k/v projections (biased with ``qkv_bias``), rotary embeddings, grouped-query causal
    attention, ``o_proj``."""

    def __init__(self, config: LlamaConfig, dtype: str = "float32"):
        super().__init__()
        C, hs, std, bias = config.n_embd, config.head_size, config.init_std, config.qkv_bias
        self.q_proj = Linear(C, config.n_head * hs, bias, std, dtype)
        self.k_proj = Linear(C, config.n_kv_head * hs, bias, std, dtype)
        self.v_proj = Linear(C, config.n_kv_head * hs, bias, std, dtype)
        self.o_proj = Linear(config.n_head * hs, C, False, std, dtype)
        self.head_size, self.group = hs, config.n_head // config.n_kv_head
        self.sequence = None   # set under context parallelism (the plan's ``attention``)
        self.recompute_core = False   # selective recomputation (models/checkpointing.py)
        self.per_projection = False   # "op" recomputation: q/k/v as products of their own

    def _first_head(self, proj) -> int:
        """The global index of this rank's first head of ``proj`` (0 unless tp split it)."""
        blocks = proj.weight.spec.tp_blocks
        return blocks[0][0] // self.head_size if blocks else 0

    def takes_one_op_path(self, xp) -> bool:
        """Whether forward on arrays of ``xp`` runs :func:`gqa_attention` (whole sequences,
        plain projections), unless a device's flash kernels take the heads
        (``MPISHARD_ATTENTION=fused``): that op keeps the ``T x T`` softmax weights, the
        per-projection path's fused attention keeps none."""
        return self.sequence is None and not self.per_projection and \
            plain_linears(self.q_proj, self.k_proj, self.v_proj) and \
            not fused_attention(xp, self.head_size, False)

    def forward(self, x, batch_size: int, cos, sin):
        if self.takes_one_op_path(xp_of(getattr(x, "data", x))):
            if self.recompute_core and is_grad_enabled():   # the one op, recomputed whole
                return self.o_proj(recompute(self._one_op, x, batch_size, cos, sin))
            return self.o_proj(self._one_op(x, batch_size, cos, sin))
        hs, B = self.head_size, batch_size
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)        # (N, h hs), (N, h_kv hs)
        T = q.shape[0] // B       # all rows of the micro-batch (x may hold 1/tp of them)
        hq, hkv = q.shape[-1] // hs, k.shape[-1] // hs
        # query head j (global) reads key/value head j // group; k and v hold heads from
        # this rank's first one on (all of them when tp keeps them whole)
        first_q, first_kv = self._first_head(self.q_proj), self._first_head(self.k_proj)
        heads = [(first_q + j) // self.group - first_kv for j in range(hq)]
        heads4 = [reshape(t, (B, T, t.shape[-1] // hs, hs)) for t in (q, k, v)]
        packed = rope_qkv(*heads4, cos, sin, heads)                    # (N, 3 hq hs)
        for t in (q, k, v, *heads4):   # read by rope_qkv alone, whose backward (as the
            release_values(t)          # projections' and the reshapes') reads none
        attend = softmax_ops.causal_self_attention if self.sequence is None else \
            self.sequence.attention
        y = attend_core(attend, packed, hq, B, selective=self.recompute_core)
        return self.o_proj(y)                                           # (N, C)

    def _one_op(self, x, batch_size: int, cos, sin):
        """The heads' outputs ``(N, h hs)`` from one op: the q/k/v projections as one
        product, rotary embeddings and grouped-query attention (the arithmetic of
        ``forward``'s per-projection path)."""
        hq = self.q_proj.out_features // self.head_size
        return gqa_attention(x, self.q_proj.weight, self.k_proj.weight, self.v_proj.weight,
                             cos, sin, hq, hq // self.group, batch_size)


class LlamaMLP(Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig, dtype: str = "float32"):
        super().__init__()
        C, F, std = config.n_embd, config.intermediate_size, config.init_std
        self.gate_proj = Linear(C, F, False, std, dtype)
        self.up_proj = Linear(C, F, False, std, dtype)
        self.down_proj = Linear(F, C, False, std, dtype)

    def forward(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class LlamaBlock(Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (checkpointable)."""

    def __init__(self, config: LlamaConfig, dtype: str = "float32", index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, config.rms_eps, dtype)
        self.self_attn = LlamaAttention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.rms_eps, dtype)
        c = config
        self.mlp = MoE(c.n_embd, c.intermediate_size, c.moe_experts, c.moe_top_k,
                       c.moe_capacity or None, c.init_std, dtype, router=c.moe_router,
                       shared=LlamaMLP(config, dtype) if c.moe_shared_expert else None) \
            if c.is_moe_block(index) else LlamaMLP(config, dtype)
        self.activation_checkpointing = False
        self.keep_products = False    # "op": see [Note: recomputation by op]

    @property
    def keep_products(self) -> bool:
        """Recomputed by op (see [Note: recomputation by op]): the attention then takes
        its per-projection path, whose q/k/v products are the ones numbered."""
        return self.__dict__["_keep_products"]

    @keep_products.setter
    def keep_products(self, on: bool) -> None:
        self.__dict__["_keep_products"] = bool(on)
        self.self_attn.per_projection = bool(on)

    def forward(self, x, batch_size: int, cos, sin):
        if self.activation_checkpointing and is_grad_enabled():
            return recompute(self.compute, x, batch_size, cos, sin,
                             keep=every_second if self.keep_products else None)
        return self.compute(x, batch_size, cos, sin)

    def compute(self, x, batch_size: int, cos, sin):
        """The block's math without its own hooks (see GPT's Block.compute)."""
        x = _add_branch(x, self.self_attn(self.input_layernorm(x), batch_size, cos, sin))
        return _add_branch(x, self.mlp(self.post_attention_layernorm(x)))


def _add_branch(x, branch):
    """``x + branch``, letting go of the residual branch's output: the add reads it alone
    and no backward reads it (the add's nor its maker's: the output projection, the
    MLP's down projection, a mixture of experts' scatter or sum), as a GPT's
    ``Dropout.add_to`` does."""
    out = x + branch
    release_branch(branch)
    return out


class Llama(Module):
    """A Llama-shaped causal language model, or one pipeline stage of it.

    Args are those of :class:`mpishard.models.GPT` (``seed``, ``dtype``,
    ``backend``, ``materialize_now``, ``blocks``, ``first_stage``, ``last_stage``).
    """

    def __init__(self, config: LlamaConfig, seed: int = 0, dtype: str = "float32",
                 backend: Backend | None = None, materialize_now: bool = True,
                 blocks=None, first_stage: bool = True, last_stage: bool = True):
        super().__init__()
        self.config, self.seed, self.dtype = config, seed, dtype
        self.backend = backend or Backend()
        self.first_stage, self.last_stage = first_stage, last_stage
        self.block_ids = list(range(config.n_layer) if blocks is None else blocks)
        if any(not 0 <= i < config.n_layer for i in self.block_ids):
            raise ValueError(f"blocks {self.block_ids} out of range for n_layer={config.n_layer}")
        C = config.n_embd
        parts = {}
        if first_stage or (last_stage and config.tie_embeddings):
            parts["embed_tokens"] = Embedding(config.vocab_size, C, config.init_std, dtype)
        check_moe_layout(config, first_stage and last_stage)
        parts["layers"] = ModuleDict(**{str(i): LlamaBlock(config, dtype, i)
                                        for i in self.block_ids})
        if last_stage:
            parts["norm"] = RMSNorm(C, config.rms_eps, dtype)
        self.model = ModuleDict(**parts)
        if last_stage:
            self.lm_head = Linear(C, config.vocab_size, False, config.init_std, dtype)
            if config.tie_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight
            self.loss = CrossEntropyLoss()
        self._tables: dict = {}
        self.sequence = None   # this rank's share of each sequence (context parallel)
        if materialize_now:
            materialize(self, seed, self.backend)

    # -- the plan and the stage interface (see mpishard/nn/sharding.py) -----------------
    def parallel_plan(self) -> ShardingPlan:
        """Megatron-style: q/k/v and gate/up column-parallel (q by heads, k/v by key/value
        heads when tp divides n_kv_head, else whole on every rank with their gradients
        summed over tp), o and down row-parallel, vocabulary-parallel embedding, head and
        loss; one ZeRO unit per block; blocks as pipeline stages."""
        hs = self.config.head_size
        kv = ColumnParallel(unit=hs, groups="n_kv_head", replicate_unless_divisible=True)
        return ShardingPlan(
            tensor=(("model.embed_tokens", VocabParallel()),
                    ("model.layers.*.self_attn.q_proj", ColumnParallel(unit=hs, groups="n_head")),
                    ("model.layers.*.self_attn.k_proj", kv),
                    ("model.layers.*.self_attn.v_proj", kv),
                    ("model.layers.*.self_attn.o_proj", RowParallel(unit=hs, groups="n_head")),
                    ("model.layers.*.mlp.gate_proj", ColumnParallel()),
                    ("model.layers.*.mlp.up_proj", ColumnParallel()),
                    ("model.layers.*.mlp.down_proj", RowParallel()),
                    ("lm_head", ColumnParallel(groups="vocabulary")),
                    ("loss", VocabParallelLoss("lm_head"))),
            units=tuple(f"model.layers.{i}" for i in self.block_ids),
            pipeline=PipelinePlan("model.layers", first=("model.embed_tokens",),
                                  last=("model.norm", "lm_head")),
            tied=(("lm_head.weight", "model.embed_tokens.weight"),)
            if self.config.tie_embeddings else (),
            attention=("model.layers.*.self_attn",), sequence_entry="model.embed_tokens")

    def pipeline_stage(self, blocks, first_stage: bool, last_stage: bool) -> "Llama":
        return Llama(self.config, seed=self.seed, dtype=self.dtype, backend=self.backend,
                     materialize_now=False, blocks=blocks, first_stage=first_stage,
                     last_stage=last_stage)

    def activation_shape(self, batch_size: int, seq_len: int) -> tuple:
        return (batch_size * seq_len, self.config.n_embd)

    def activation_bytes(self, batch_size: int, seq_len: int, dtype="float32",
                         lean: bool | None = None) -> int:
        """Bytes one micro-batch's forward keeps for backward (models/llama/activations.py;
        ``lean``: as the GPT's)."""
        return llama_activation_bytes(self, batch_size, seq_len, dtype, lean=lean)

    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, rng=None):
        """Extend ``idx`` ``(B, T)`` by sampling ``max_new_tokens`` tokens (whole models only)."""
        return generate(self, idx, max_new_tokens, temperature, top_k, rng)

    def set_activation_checkpointing(self, enabled: bool | str = True) -> "Llama":
        """Recompute in backward instead of keeping activations: each block (``True`` /
        ``"full"``), attention's core (``"selective"``), each block keeping its q, v,
        gate and down products' outputs (``"op"``), or nothing (``False`` / ``"none"``);
        see GPT's."""
        mode = checkpointing_mode(enabled)
        check_moe_checkpointing(self.config, mode in ("full", "op"))
        check_op_mode(self.config, mode)
        for block in self.model.layers.values():
            block.activation_checkpointing = mode in ("full", "op")
            block.keep_products = mode == "op"
            block.self_attn.recompute_core = mode == "selective"
        return self

    # -- forward ------------------------------------------------------------------------
    def rope_tables(self, seq_len: int, dtype):
        """``(cos, sin)`` for the ``seq_len`` local rows of a sequence in ``dtype`` (cached
        per length): positions ``0..seq_len-1``, or under context parallelism this
        rank's global positions."""
        key = (seq_len, np.dtype(dtype).name)
        if key not in self._tables:
            cfg, seq = self.config, self.sequence
            full = seq.global_length(seq_len) if seq else seq_len
            cos, sin = rope_tables(full, cfg.head_size, cfg.rope_theta, cfg.rope_scaling,
                                   key[1], self.backend.xp)
            if seq is not None:
                rows = seq.positions(seq_len, self.backend.xp)
                cos, sin = cos[rows], sin[rows]
            self._tables[key] = (cos, sin)
        return self._tables[key]

    def forward(self, inputs, targets=None, batch_size: int | None = None):
        """As :meth:`mpishard.models.GPT.forward`: ``(logits, loss)`` on the last stage,
        the ``(B*T, C)`` activations otherwise."""
        if self.first_stage:
            idx = self.backend.asarray(inputs.data if isinstance(inputs, Tensor) else inputs)
            B, T = idx.shape
            full = self.sequence.global_length(T) if self.sequence else T
            if full > self.config.block_size:
                raise ValueError(f"sequence length {full} exceeds block_size "
                                 f"{self.config.block_size}")
            # (-1, C): under sequence parallelism the embeddings return this rank's rows
            x = reshape(self.model.embed_tokens(idx), (-1, self.config.n_embd))
        else:
            if batch_size is None:
                raise ValueError("a stage that is not first needs batch_size")
            x, B = inputs, batch_size
            T = x.shape[0] * getattr(self, "sequence_parallel_size", 1) // B  # sp: 1/tp rows
        cos, sin = self.rope_tables(T, "float64" if x.data.dtype == np.float64 else "float32")
        for block in self.model.layers.values():
            x = block(x, B, cos, sin)
        if not self.last_stage:
            return x
        logits = self.lm_head(self.model.norm(x))                       # (B*T, V)
        loss = None
        if targets is not None:
            targets = self.backend.asarray(targets.data if isinstance(targets, Tensor) else targets)
            loss = self.loss(logits, targets.reshape(B * T))
            loss = with_router_losses(loss, [b.mlp for b in self.model.layers.values()],
                                      self.config)   # see [Note: load-balancing loss]
        return logits.reshape(B, T, logits.shape[-1]), loss

"""The GPT's spec (``--model gpt``): nanoGPT's GPT-2, see [Note: model specs]."""
from __future__ import annotations

from mpishard.models.gpt.activations import gpt_activation_bytes
from mpishard.models.gpt.hf import GPT2
from mpishard.models.gpt.model import GPT, GPTConfig
from mpishard.models.moe import MOE_KEYS, check_moe_split, moe_fields
from mpishard.models.spec import TEXT_KEYS, AxisSizes, ModelKey, ModelSpec, split_counts

__all__ = ["GPT_SPEC"]


def build_config(keys: dict) -> GPTConfig:
    """A :class:`GPTConfig` from ``[model]`` keys."""
    return GPTConfig(**{k: keys[k] for k in TEXT_KEYS}, dropout=keys["dropout"],
                     bias=keys["bias"], **moe_fields(keys))


def check_split(config: GPTConfig, sizes: AxisSizes) -> list:
    """What the GPT cannot do on a split: dropout in context-parallel attention, and
    the mixture of experts' limits (:func:`~mpishard.models.moe.check_moe_split`); a
    note on heads that tp splits unevenly."""
    if config.dropout > 0 and sizes.cp > 1:
        raise ValueError(f"dropout = {config.dropout} with cp = {sizes.cp}: context-parallel "
                         f"attention has no dropout; use dropout = 0, or cp = 1")
    check_moe_split(config, sizes)
    if sizes.tp > 1 and config.n_head % sizes.tp:
        return [f"tp = {sizes.tp}: heads {split_counts(config.n_head, sizes.tp)} of n_head = "
                f"{config.n_head} per tensor-parallel rank"]
    return []


def attention_heads(attention) -> tuple:
    """``(heads, head size)`` of one attention on this tp rank (its fused q | k | v)."""
    hs = int(attention.head_size)
    return int(attention.c_attn.weight.shape[0]) // (3 * hs), hs


#: OpenAI's GPT-2 shapes (vocabulary 50257, context 1024), and a small one for CPUs
#: (its vocabulary from the data)
PRESETS = {
    "gpt2": dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(vocab_size=50257, block_size=1024, n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(vocab_size=50257, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
    "gpt-tiny": dict(block_size=64, n_layer=2, n_head=4, n_embd=64),
}

GPT_SPEC = ModelSpec(
    name="gpt", summary="nanoGPT's GPT-2: learned positions, LayerNorm, GELU MLP, tied head",
    task="text", model_class=GPT, config_class=GPTConfig,
    keys=(ModelKey("dropout", 0.0, "dropout probability", low=0.0, high=1.0),
          ModelKey("bias", True, "biases in linear and layer-norm layers", estimate=True,
                   shapes=True),
          *MOE_KEYS),
    build_config=build_config, presets=PRESETS, sharding=GPT.parallel_plan,
    activations=gpt_activation_bytes, attention_heads=attention_heads,
    check_split=check_split, hf=GPT2)

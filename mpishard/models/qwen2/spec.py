"""Qwen2 (``--model qwen2``, ``Qwen2ForCausalLM``): the Llama family's module with biases
on the q, k and v projections, see [Note: model specs].

Qwen2 is transformers' Llama but for those biases (``attention_bias`` of its
config is not a key: they are always there), a sliding-window option and
``max_window_layers``; its tensor names and layouts are the Llama's, biases
included (``model.layers.0.self_attn.q_proj.bias``). So this spec is the Llama's
module, keys, sharding plan and activation terms, with Qwen2's defaults (rope
theta 1e6, RMS epsilon 1e-6) and a mapping of its own; a sliding window is
refused, and so is a Qwen2 without the biases (that is a Llama).

    mpishard train --model qwen2 --n-kv-head 2 --steps 50
    mpishard train --init-from Qwen2.5-0.5B --strategy zero3 ...
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from mpishard.models.hf_mapping import ConfigReader, HFMapping
from mpishard.models.llama.activations import llama_activation_bytes
from mpishard.models.llama.hf import (KEY_NAMES, LLAMA_DEFAULTS, dense_config, dense_keys,
                                      ignorable, llama_tensors, tied_head)
from mpishard.models.llama.model import Llama, LlamaConfig
from mpishard.models.llama.spec import LLAMA_KEYS, attention_heads, check_split, llama_config
from mpishard.models.spec import ModelKey, ModelSpec

__all__ = ["Qwen2Config", "QWEN2_SPEC"]


@dataclass
class Qwen2Config(LlamaConfig):
    """A Qwen2 model's configuration: a :class:`LlamaConfig` with q/k/v biases and Qwen2's
    defaults (``transformers``' ``Qwen2Config`` names in LlamaConfig's comments)."""

    rope_theta: float = 1000000.0  # rope_theta of the published Qwen2 and Qwen2.5 models
    rms_eps: float = 1e-6          # rms_norm_eps
    qkv_bias: bool = True          # always, in Qwen2


def build_config(keys: dict) -> Qwen2Config:
    """A :class:`Qwen2Config` from ``[model]`` keys (``bias`` must be true)."""
    if not keys["bias"]:
        raise ValueError("bias = false: Qwen2 has biases on q, k and v; use bias = true, or "
                         "--model llama (no biases)")
    return llama_config(keys, Qwen2Config)


#: transformers' ``Qwen2Config`` defaults, read for a key a config.json leaves out
HF_DEFAULTS = dict(LLAMA_DEFAULTS, vocab_size=151936, intermediate_size=22016,
                   num_key_value_heads=32, max_position_embeddings=32768)


def read_config(r: ConfigReader) -> dict:
    """The ``[model]`` keys of a Qwen2 config.json."""
    keys = dense_keys(r, HF_DEFAULTS)
    r.must("use_sliding_window", False, (False,), "is not supported: mpishard's attention is "
           "full causal attention (use false)")
    kinds = r.raw.get("layer_types") or []
    if any(kind != "full_attention" for kind in kinds):
        r.refuse("layer_types", kinds, "is not supported: every layer of mpishard's Qwen2 is "
                 "'full_attention'")
    return {**keys, "bias": True}


def write_config(config: Qwen2Config, dtype: str) -> dict:
    """The config.json transformers reads as this model's ``Qwen2Config``."""
    if not config.qkv_bias or config.moe_experts:
        raise ValueError(f"qkv_bias = {config.qkv_bias}, moe_experts = {config.moe_experts}: "
                         f"Qwen2ForCausalLM has q/k/v biases and no experts; export a model "
                         f"that has them and none")
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            **dense_config(config, dtype), "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": config.n_layer,
            "layer_types": ["full_attention"] * config.n_layer}


QWEN2 = HFMapping(
    architectures={"qwen2": ("Qwen2ForCausalLM", "Qwen2Model")},
    read_config=read_config, write_config=write_config, tensors=llama_tensors,
    base_prefix="model.", ignorable=ignorable, key_names=KEY_NAMES,
    loose_fields=("dropout", "init_std", "block_size", "positions"), tied_head=tied_head)

_DEFAULTS = {"rope_theta": 1000000.0, "rms_eps": 1e-6}

#: Qwen2.5-0.5B's config.json (its head tied to the token table), and a small one for CPUs
PRESETS = {
    "qwen2.5-0.5b": dict(vocab_size=151936, block_size=32768, n_layer=24, n_head=14,
                         n_kv_head=2, n_embd=896, intermediate_size=4864,
                         rope_theta=1000000.0, rms_eps=1e-6, tie_embeddings=True),
    "qwen2-tiny": dict(block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                       intermediate_size=176),
}

QWEN2_SPEC = ModelSpec(
    name="qwen2", summary="Qwen2: a Llama with q/k/v biases", task="text",
    model_class=Llama, config_class=Qwen2Config,
    keys=(*(replace(k, default=_DEFAULTS.get(k.name, k.default)) for k in LLAMA_KEYS),
          ModelKey("bias", True, "biases on q, k and v (Qwen2: always)", estimate=True,
                   shapes=True)),
    build_config=build_config, presets=PRESETS, sharding=Llama.parallel_plan,
    activations=llama_activation_bytes, attention_heads=attention_heads,
    check_split=check_split, hf=QWEN2, positions_key="positions",
    elementwise="rmsnorm-swiglu")

"""The Llama family's spec (``--model llama``), see [Note: model specs].

Its keys, its config builder and its attention's heads serve the family's
variants too (models/qwen2/spec.py).
"""
from __future__ import annotations

from mpishard.models.llama.activations import llama_activation_bytes
from mpishard.models.llama.hf import LLAMA
from mpishard.models.llama.model import Llama, LlamaConfig
from mpishard.models.moe import MOE_KEYS, check_moe_split, moe_fields
from mpishard.models.spec import TEXT_KEYS, AxisSizes, ModelKey, ModelSpec, split_counts

__all__ = ["LLAMA_SPEC", "LLAMA_KEYS", "llama_config", "attention_heads", "check_split"]

#: the ``[model]`` keys of a dense Llama-shaped model (LlamaConfig's fields, RoPE scaling
#: flat); the Llama family adds ``bias`` and the mixture of experts' keys
LLAMA_KEYS = (
    ModelKey("n_kv_head", 0, "key/value heads, dividing n_head (0: n_head)", low=0,
             estimate=True, shapes=True),
    ModelKey("intermediate_size", 0, "the MLP's width (0: 8 n_embd / 3 rounded up to 256)",
             low=0, estimate=True, shapes=True),
    ModelKey("rope_theta", 10000.0, "rotary embedding base", above=0.0, estimate=True),
    ModelKey("rope_scaling", "none", "rotary frequency scaling", choices=("none", "llama3"),
             estimate=True),
    ModelKey("rope_factor", 8.0, "llama3 scaling: factor", above=0.0),
    ModelKey("rope_low_freq_factor", 1.0, "llama3 scaling: low-frequency factor", above=0.0),
    ModelKey("rope_high_freq_factor", 4.0, "llama3 scaling: high-frequency factor",
             above=0.0),
    ModelKey("rope_original_max_position", 8192, "llama3 scaling: the context the "
             "frequencies were trained for", low=1),
    ModelKey("rms_eps", 1e-5, "RMS norm epsilon", above=0.0),
    ModelKey("tie_embeddings", False, "the output layer is the token table", estimate=True,
             shapes=True),
    ModelKey("dropout", 0.0, "dropout probability (the Llama family: 0 only)", low=0.0,
             high=1.0),
    ModelKey("positions", 0, "the context the model is made for, its "
             "max_position_embeddings (0: block_size); block_size may be shorter, or longer "
             "as far as llama3 scaling reaches; --init-from sets it from the folder", low=0))


def rope_scaling(keys: dict) -> dict | None:
    """LlamaConfig's ``rope_scaling`` from the flat ``rope_*`` keys."""
    if keys["rope_scaling"] == "none":
        return None
    return {"rope_type": "llama3", "factor": keys["rope_factor"],
            "low_freq_factor": keys["rope_low_freq_factor"],
            "high_freq_factor": keys["rope_high_freq_factor"],
            "original_max_position_embeddings": keys["rope_original_max_position"]}


def llama_config(keys: dict, config_class=LlamaConfig, **fields):
    """``config_class`` (LlamaConfig or a variant's) from ``[model]`` keys (the
    ``moe_*`` ones where the family has them), and ``fields``."""
    if keys["dropout"]:
        raise ValueError(f"dropout = {keys['dropout']}: the Llama family trains without "
                         f"dropout here; use dropout = 0")
    return config_class(**{k: keys[k] for k in TEXT_KEYS}, n_kv_head=keys["n_kv_head"],
                        intermediate_size=keys["intermediate_size"],
                        rope_theta=keys["rope_theta"], rope_scaling=rope_scaling(keys),
                        rms_eps=keys["rms_eps"], tie_embeddings=keys["tie_embeddings"],
                        positions=keys["positions"], **moe_fields(keys), **fields)


def build_config(keys: dict) -> LlamaConfig:
    """A :class:`LlamaConfig` from ``[model]`` keys (``bias`` must be false)."""
    if keys["bias"]:
        raise ValueError("bias = true: Llama's layers have no biases; use bias = false "
                         "(--bias false)")
    return llama_config(keys)


def check_split(config: LlamaConfig, sizes: AxisSizes) -> list:
    """The mixture of experts' limits (:func:`~mpishard.models.moe.check_moe_split`), and
    a note on how tp splits the heads where it does not divide the key/value heads (the
    plan keeps those whole on every rank, their gradients summed over tp)."""
    check_moe_split(config, sizes)
    tp, kv = sizes.tp, config.n_kv_head
    if tp == 1 or kv % tp == 0:
        return []
    return [f"tp = {tp}: query heads {split_counts(config.n_head, tp)} of n_head = "
            f"{config.n_head} per tensor-parallel rank; the {kv} key/value heads do not "
            f"divide by {tp}, so every rank keeps them whole (their gradients summed over tp)"]


def attention_heads(attention) -> tuple:
    """``(query heads, head size)`` of one attention on this tp rank."""
    hs = int(attention.head_size)
    return int(attention.q_proj.weight.shape[0]) // hs, hs


_LLAMA3 = dict(vocab_size=128256, block_size=8192, rope_theta=500000.0,
               rope_scaling="llama3", rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
               rope_original_max_position=8192, rms_eps=1e-5)

#: Meta's Llama 3 config.json shapes (block_size: the 8192-token context they were
#: pretrained at; their scaled rotary embeddings reach 131072), Mistral AI's Mixtral
#: 8x7B (32 blocks of 8 experts, 2 per token), and a small one for CPUs
PRESETS = {
    "llama3.2-1b": dict(_LLAMA3, n_layer=16, n_head=32, n_kv_head=8, n_embd=2048,
                        intermediate_size=8192, rope_factor=32.0, tie_embeddings=True),
    "llama3.2-3b": dict(_LLAMA3, n_layer=28, n_head=24, n_kv_head=8, n_embd=3072,
                        intermediate_size=8192, rope_factor=32.0, tie_embeddings=True),
    "llama3.1-8b": dict(_LLAMA3, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
                        intermediate_size=14336, rope_factor=8.0, tie_embeddings=False),
    "llama3.1-70b": dict(_LLAMA3, n_layer=80, n_head=64, n_kv_head=8, n_embd=8192,
                         intermediate_size=28672, rope_factor=8.0, tie_embeddings=False),
    "mixtral-8x7b": dict(vocab_size=32000, block_size=32768, n_layer=32, n_head=32,
                         n_kv_head=8, n_embd=4096, intermediate_size=14336,
                         rope_theta=1000000.0, rope_scaling="none", rms_eps=1e-5,
                         tie_embeddings=False, moe_experts=8, moe_top_k=2, moe_every=1),
    "llama-tiny": dict(block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                       intermediate_size=176, rope_theta=10000.0, rope_scaling="none",
                       tie_embeddings=False),
}

LLAMA_SPEC = ModelSpec(
    name="llama", summary="the Llama family: RMS norm, rotary embeddings, SwiGLU MLP, "
    "grouped-query attention, no biases", task="text", model_class=Llama,
    config_class=LlamaConfig,
    keys=(*LLAMA_KEYS, ModelKey("bias", False, "biases (Llama: none; --model qwen2 has "
                                "them on q, k and v)", estimate=True, shapes=True),
          *MOE_KEYS),
    build_config=build_config, presets=PRESETS, sharding=Llama.parallel_plan,
    activations=llama_activation_bytes, attention_heads=attention_heads,
    check_split=check_split, hf=LLAMA, positions_key="positions",
    elementwise="rmsnorm-swiglu")

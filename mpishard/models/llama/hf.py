"""The Llama family as transformers' ``LlamaForCausalLM`` and ``MixtralForCausalLM``.

Names and layouts are transformers' own (``model.layers.0.self_attn.q_proj.weight``,
``[out, in]``, rotary embeddings on the two halves of each head), so they map
one to one; a tied head is not a tensor of the files. A Mixtral's experts are
one ``(E, 2F, C)`` gate|up and one ``(E, C, F)`` down tensor per block in
mpishard (as in transformers' model), and per-expert ``w1`` (gate), ``w3`` (up)
and ``w2`` (down) tensors under ``block_sparse_moe`` in the published files:
such a tensor is the concatenation of its ``parts``, read and written part by
part. Refused in a config.json: biases, an activation other than SiLU, a head
size other than ``hidden_size / num_attention_heads``, key/value heads that do
not divide the heads, partial rotary embeddings (the top-level key or the one
in ``rope_parameters``), a RoPE scaling type other than Llama 3's; for Mixtral
a sliding window or router jitter. A key left out is read as transformers'
config class of that ``model_type`` defaults it (:data:`LLAMA_DEFAULTS`,
:data:`MIXTRAL_DEFAULTS`). The readers here serve the family's variants too
(models/qwen2/).
"""
from __future__ import annotations

import dataclasses
import re

from mpishard.models.hf_mapping import ConfigReader, HFMapping, HFTensor, named_tensors
from mpishard.models.llama.model import Llama

__all__ = ["LLAMA", "dense_keys", "rope_keys", "dense_config", "llama_tensors", "ignorable",
           "LLAMA3_KEYS", "KEY_NAMES", "LLAMA_DEFAULTS", "tied_head"]

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings")
#: config field -> its config.json key, for messages
KEY_NAMES = {"positions": "max_position_embeddings", "n_layer": "num_hidden_layers",
             "n_head": "num_attention_heads", "n_kv_head": "num_key_value_heads",
             "n_embd": "hidden_size",
             "rms_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings",
             "rope_scaling": "rope_scaling"}
_ROTARY_BUFFER = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
#: transformers' ``LlamaConfig`` defaults, read for a key a config.json leaves out
#: (``num_key_value_heads`` None: one per query head)
LLAMA_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=None,
                      max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0)
#: ``MixtralConfig``'s: rms_norm_eps and rope_theta differ from a Llama's, and a folder
#: that leaves them out computes with these
MIXTRAL_DEFAULTS = dict(LLAMA_DEFAULTS, intermediate_size=14336, num_key_value_heads=8,
                        max_position_embeddings=131072, rms_norm_eps=1e-5,
                        rope_theta=1000000.0)


def dense_keys(r: ConfigReader, defaults: dict = LLAMA_DEFAULTS) -> dict:
    """The ``[model]`` keys of the dense Llama shape in a config.json (no bias check),
    ``defaults`` (transformers' config class's) for the keys it leaves out."""
    raw, d = r.raw, defaults
    n_embd = r.integer("hidden_size", d["hidden_size"])
    n_head = r.integer("num_attention_heads", d["num_attention_heads"])
    kv = raw.get("num_key_value_heads", d["num_key_value_heads"])
    positions = r.integer("max_position_embeddings", d["max_position_embeddings"])
    keys = dict(vocab_size=r.integer("vocab_size", d["vocab_size"]), block_size=positions,
                positions=positions,
                n_layer=r.integer("num_hidden_layers", d["num_hidden_layers"]), n_head=n_head,
                n_kv_head=n_head if kv is None else r.integer("num_key_value_heads", kv),
                n_embd=n_embd, intermediate_size=r.integer("intermediate_size",
                                                           d["intermediate_size"]),
                rms_eps=r.number("rms_norm_eps", d["rms_norm_eps"]),
                tie_embeddings=r.flag("tie_word_embeddings", False), moe_experts=0)
    r.must("hidden_act", "silu", ("silu",), "is not supported: mpishard's Llama MLP is SwiGLU "
           "with SiLU ('silu')")
    if n_head % keys["n_kv_head"] or keys["n_kv_head"] > n_head:
        left_out = "" if "num_key_value_heads" in raw else \
            "(left out of the file: its model_type's default) "
        r.refuse("num_key_value_heads", keys["n_kv_head"], f"{left_out}must divide "
                 f"num_attention_heads = {n_head} (grouped-query attention: each key/value "
                 f"head serves the same number of query heads)")
    head_dim = raw.get("head_dim")
    if head_dim is not None and (n_embd % n_head or head_dim != n_embd // n_head):
        r.refuse("head_dim", head_dim, f"is not supported: mpishard's heads are hidden_size / "
                 f"num_attention_heads = {n_embd / n_head:g} wide")
    if n_embd % n_head:
        r.refuse("hidden_size", n_embd, f"is not divisible by num_attention_heads = {n_head}: "
                 f"mpishard's heads are hidden_size / num_attention_heads wide")
    keys.update(rope_keys(r, d["rope_theta"]))
    return keys


def rope_keys(r: ConfigReader, default_theta: float = 10000.0) -> dict:
    """rope_theta and the scaling, from transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` / ``rope_scaling`` keys (``default_theta`` where neither gives it)."""
    raw = r.raw
    params = raw.get("rope_parameters")
    key = "rope_parameters" if isinstance(params, dict) else "rope_scaling"
    params = params if isinstance(params, dict) else raw.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        r.refuse(key, params, "must be an object or null")
    params = params or {}
    theta = r.number("rope_theta", default_theta,
                     params.get("rope_theta", raw.get("rope_theta", default_theta)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "llama3"):
        r.refuse(f"{key}.rope_type", kind, "is not implemented: mpishard has Llama 3's "
                 "frequency scaling ('llama3') or none ('default')")
    for name, source in ((f"{key}.partial_rotary_factor", params),   # transformers moves
                         ("partial_rotary_factor", raw)):             # the top-level key in
        factor = source.get("partial_rotary_factor")
        if factor not in (None, 1.0):
            r.refuse(name, factor, "is not supported: mpishard rotates whole heads (use 1.0)")
    keys = dict(rope_theta=theta, rope_scaling="none", rope_factor=8.0,
                rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                rope_original_max_position=8192)
    if kind == "llama3":
        missing = [k for k in LLAMA3_KEYS if k not in params]
        if missing:
            r.refuse(key, params, f"lacks {', '.join(missing)}, which llama3 scaling needs")
        sub = ConfigReader(params, f"{r.where}: {key}")
        keys.update(rope_scaling="llama3", rope_factor=sub.number("factor", 8.0),
                    rope_low_freq_factor=sub.number("low_freq_factor", 1.0),
                    rope_high_freq_factor=sub.number("high_freq_factor", 4.0),
                    rope_original_max_position=sub.integer("original_max_position_"
                                                           "embeddings", 8192))
    return keys


def read_config(r: ConfigReader) -> dict:
    """The ``[model]`` keys of a Llama or Mixtral config.json."""
    mixtral = r.raw.get("model_type") == "mixtral"
    keys = dense_keys(r, MIXTRAL_DEFAULTS if mixtral else LLAMA_DEFAULTS)
    keys["bias"] = False
    for key in ("attention_bias", "mlp_bias"):
        r.must(key, False, (False, None), "is not supported: mpishard's Llama has no biases "
               "(use false)")
    if not mixtral:
        return keys
    r.must("sliding_window", None, (None,), "is not supported: mpishard's attention is full "
           "causal attention (use null)")
    if r.raw.get("router_jitter_noise", 0.0) not in (0, 0.0, None):
        r.refuse("router_jitter_noise", r.raw["router_jitter_noise"], "is not supported "
                 "(use 0.0)")
    experts = r.integer("num_local_experts", 8)
    top_k = r.integer("num_experts_per_tok", 2)
    if top_k > experts:
        r.refuse("num_experts_per_tok", top_k, f"exceeds num_local_experts = {experts}")
    coef = r.raw.get("router_aux_loss_coef", 0.001)
    if not isinstance(coef, (int, float)) or isinstance(coef, bool) or coef < 0:
        r.refuse("router_aux_loss_coef", coef, "must be a number >= 0")
    keys.update(moe_experts=experts, moe_top_k=top_k, moe_every=1, moe_capacity=0.0,
                moe_aux_coef=float(coef))
    return keys


def dense_config(config, dtype: str) -> dict:
    """The config.json keys of a dense Llama-shaped model that transformers' Llama, Qwen2
    and Mixtral configs share (no architecture, no bias keys)."""
    scaling = None if config.rope_scaling is None else {
        "rope_type": "llama3", **{k: config.rope_scaling.get(k) for k in LLAMA3_KEYS}}
    return {"vocab_size": config.vocab_size, "torch_dtype": dtype, "use_cache": True,
            "hidden_size": config.n_embd, "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
            "num_key_value_heads": config.n_kv_head, "hidden_act": "silu",
            "max_position_embeddings": config.positions, "rms_norm_eps": config.rms_eps,
            "rope_theta": config.rope_theta, "rope_scaling": scaling,
            "tie_word_embeddings": config.tie_embeddings, "attention_dropout": 0.0,
            "initializer_range": config.init_std, "bos_token_id": None, "eos_token_id": None}


def write_config(config, dtype: str) -> dict:
    """The config.json transformers reads as this model's ``LlamaConfig``, or as a
    ``MixtralConfig`` for a mixture of experts in Mixtral's form."""
    if config.qkv_bias:
        raise ValueError("biases on q, k and v only have no LlamaForCausalLM form (its "
                         "attention_bias biases o_proj too); build the model as a "
                         "Qwen2Config (mpishard.models.qwen2), Qwen2ForCausalLM's")
    if not config.moe_experts:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                **dense_config(config, dtype), "head_dim": config.head_size,
                "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    if config.moe_every != 1 or config.moe_capacity or config.moe_router != "softmax" \
            or config.moe_shared_expert:
        raise ValueError(f"this mixture of experts (every {config.moe_every} blocks, "
                         f"capacity {config.moe_capacity}, {config.moe_router} router, "
                         f"shared expert {config.moe_shared_expert}) has no transformers "
                         f"architecture; Mixtral's has experts in every block, dropless, "
                         f"a softmax router and no shared expert")
    dense = dense_config(dataclasses.replace(config, moe_experts=0), dtype)
    return {**dense, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": config.moe_experts, "num_experts_per_tok": config.moe_top_k,
            "router_aux_loss_coef": config.moe_aux_coef, "output_router_logits": False,
            "router_jitter_noise": 0.0, "sliding_window": None}


def llama_tensors(config) -> list:
    """Every tensor of the files in model order: mpishard's own names, a Mixtral block's
    router and experts as the published files name them."""
    plan = []
    for name, shape in named_tensors(Llama, config):
        plan.append(_mixtral_tensor(name, shape)
                    if ".mlp.experts." in name or name.endswith(".mlp.gate.weight")
                    else HFTensor(name, name, shape))
    return plan


def _mixtral_tensor(name: str, shape: tuple) -> HFTensor:
    base = name.split(".mlp.")[0] + ".block_sparse_moe."
    if name.endswith(".mlp.gate.weight"):
        return HFTensor(base + "gate.weight", name, shape)
    E = shape[0]
    if name.endswith(".experts.gate_up_proj"):          # (E, 2F, C): w1 (gate), w3 (up)
        parts = tuple(f"{base}experts.{e}.{w}.weight" for e in range(E) for w in ("w1", "w3"))
        return HFTensor(parts[0], name, shape, parts=parts,
                        part_shape=(shape[1] // 2, shape[2]))
    parts = tuple(f"{base}experts.{e}.w2.weight" for e in range(E))   # (E, C, F)
    return HFTensor(parts[0], name, shape, parts=parts, part_shape=tuple(shape[1:]))


def ignorable(key: str, config) -> bool:
    """Older transformers' rotary buffers, and the head of a tied model."""
    return bool(_ROTARY_BUFFER.search(key)) or (config.tie_embeddings
                                                 and key == "lm_head.weight")


def tied_head(config):
    """A tied model's head, and the token table it is."""
    if not config.tie_embeddings:
        return None
    return ("lm_head.weight", "model.embed_tokens.weight",
            "set tie_word_embeddings to false in config.json to train with the stored head, "
            "or remove lm_head.weight from the files to tie it to the token table")


LLAMA = HFMapping(
    architectures={"llama": ("LlamaForCausalLM", "LlamaModel"),
                   "mixtral": ("MixtralForCausalLM", "MixtralModel")},
    read_config=read_config, write_config=write_config, tensors=llama_tensors,
    base_prefix="model.", ignorable=ignorable, key_names=KEY_NAMES,
    loose_fields=("dropout", "init_std", "block_size", "positions", "moe_aux_coef",
                  "moe_z_coef"), tied_head=tied_head)

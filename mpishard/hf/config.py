"""``config.json``: what a Hugging Face model folder says, in mpishard's terms, and back.

[Note: what converts and what is refused]
mpishard reproduces two architectures exactly: GPT-2 (``model_type`` ``gpt2``,
``GPT2LMHeadModel``) as its :class:`~mpishard.models.GPT`, and the Llama
family (``llama``, ``LlamaForCausalLM``) as its :class:`~mpishard.models.Llama`.
Anything in a ``config.json`` that would make the published model compute
something else is refused with the key, its value and what would work:
another model type or architecture, GPT-2 with an MLP width other than
``4 * n_embd``, an activation other than the tanh GELU, a layer-norm epsilon
other than 1e-5, attention scaled by the layer index or not at all, cross
attention, an untied head; Llama with biases, an activation other than SiLU, a
head size other than ``hidden_size / num_attention_heads``, partial rotary
embeddings, or a RoPE scaling type other than Llama 3's; quantised weights.
Keys that change nothing mpishard computes (dropout rates, token ids,
``use_cache``, ``pretraining_tp``, the dtype) are read past.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from mpishard.models import GPT, GPTConfig, Llama, LlamaConfig

__all__ = ["model_fields", "shape_from_folder", "config_from_fields", "config_from_pretrained", "read_config_json",
           "hf_config", "model_class", "check_model_matches", "CONFIG"]

CONFIG = "config.json"
#: the GELU implementations that are GPT-2's tanh approximation, to the formula
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
_ARCHITECTURES = {"gpt2": ("GPT2LMHeadModel", "GPT2Model"),
                  "llama": ("LlamaForCausalLM", "LlamaModel"),
                  "mixtral": ("MixtralForCausalLM", "MixtralModel")}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")


def read_config_json(path) -> dict:
    """The parsed ``config.json`` of folder ``path`` (ValueError when missing or not JSON)."""
    file = Path(path) / CONFIG
    if not file.is_file():
        raise ValueError(f"{file} does not exist: a Hugging Face model folder holds "
                         f"config.json next to its safetensors files")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{file} is not JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return raw


class _Reader:
    """Typed reads of one config.json, each refusal naming the key and its value."""

    def __init__(self, raw: dict, where: str):
        self.raw, self.where = raw, where

    def refuse(self, key: str, value, why: str):
        raise ValueError(f"{self.where}: {key}={json.dumps(value)} {why}")

    def integer(self, key: str, default=None, low: int = 1) -> int:
        value = self.raw.get(key, default)
        if value is None and default is None:
            raise ValueError(f"{self.where}: {key} is missing; it is needed to build the model")
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            self.refuse(key, value, f"must be an integer >= {low}")
        return value

    def number(self, key: str, default: float, value=None) -> float:
        value = self.raw.get(key, default) if value is None else value
        if not isinstance(value, (int, float)) or isinstance(value, bool) \
                or not math.isfinite(value) or value <= 0:
            self.refuse(key, value, "must be a positive number")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        if not isinstance(value, bool):
            self.refuse(key, value, "must be true or false")
        return value

    def must(self, key: str, default, allowed: tuple, why: str):
        value = self.raw.get(key, default)
        if value not in allowed:
            self.refuse(key, value, why)
        return value


def shape_from_folder(model_cfg, path) -> list:
    """Set the ``[model]`` section ``model_cfg`` (a run's, in place) to the shape of the
    folder's ``config.json``; returns a note. A Llama keeps the run's shorter
    ``block_size`` (rotary positions: any shorter length trains), a GPT-2 takes its
    ``n_positions`` (its position table has that many rows)."""
    fields = model_fields(path)
    trained, longest = model_cfg.block_size, fields["block_size"]
    if fields["name"] == "llama" and trained < longest:
        fields["block_size"] = trained
    for key, value in fields.items():
        setattr(model_cfg, key, value)
    context = (f"; sequences of {trained} tokens (it takes up to {longest:,}: --block-size)"
               if fields["block_size"] < longest else "")
    return [f"--init-from {path}: the [model] shape comes from its config.json "
            f"({fields['name']}, {fields['n_layer']} layers, width {fields['n_embd']}){context}"]


def model_fields(path) -> dict:
    """The mpishard ``[model]`` keys for the Hugging Face folder ``path`` (its config.json).

    Returns ``name`` (``"gpt"`` or ``"llama"``), ``vocab_size``, ``block_size``,
    ``n_layer``, ``n_head``, ``n_embd``, ``bias``, and for Llama ``n_kv_head``,
    ``intermediate_size``, ``rope_theta``, ``rope_scaling`` (``"none"`` or
    ``"llama3"``) with ``rope_factor``, ``rope_low_freq_factor``,
    ``rope_high_freq_factor``, ``rope_original_max_position``, ``rms_eps``,
    ``tie_embeddings`` and ``moe_experts`` (0; a Mixtral's count, with
    ``moe_top_k``, ``moe_every``, ``moe_capacity`` and ``moe_aux_coef``).

    Raises:
        ValueError: naming the key, its value and the fix, for anything mpishard
            cannot reproduce (see [Note: what converts and what is refused]).
    """
    raw = read_config_json(path)
    where = str(Path(path) / CONFIG)
    r = _Reader(raw, where)
    kind = raw.get("model_type")
    if kind not in _ARCHITECTURES:
        r.refuse("model_type", kind, "is not an architecture mpishard reproduces; it "
                 "converts 'gpt2' (GPT2LMHeadModel), 'llama' (LlamaForCausalLM) and "
                 "'mixtral' (MixtralForCausalLM)")
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or any(a not in _ARCHITECTURES[kind] for a in archs):
        r.refuse("architectures", archs, f"is not supported; for model_type {kind!r} "
                 f"mpishard converts {' or '.join(_ARCHITECTURES[kind])}")
    if raw.get("quantization_config") is not None:
        r.refuse("quantization_config", raw["quantization_config"], "is set: mpishard reads "
                 "unquantised float16, bfloat16, float32 or float64 weights")
    if kind == "gpt2":
        return _gpt2_fields(r)
    return _mixtral_fields(r) if kind == "mixtral" else _llama_fields(r)


def _gpt2_fields(r: _Reader) -> dict:
    n_embd = r.integer("n_embd", 768)
    fields = dict(name="gpt", vocab_size=r.integer("vocab_size", 50257),
                  block_size=r.integer("n_positions", 1024), n_layer=r.integer("n_layer", 12),
                  n_head=r.integer("n_head", 12), n_embd=n_embd, bias=True)
    inner = r.raw.get("n_inner")
    if inner is not None and inner != 4 * n_embd:
        r.refuse("n_inner", inner, f"is not supported: mpishard's GPT MLP is 4 * n_embd = "
                 f"{4 * n_embd} wide (use n_inner null)")
    r.must("activation_function", "gelu_new", _TANH_GELUS, "is not supported: mpishard's GPT "
           "uses the tanh GELU ('gelu_new')")
    eps = r.number("layer_norm_epsilon", 1e-5)
    if eps != 1e-5:
        r.refuse("layer_norm_epsilon", eps, "is not supported: mpishard's GPT layer norms use "
                 "1e-5")
    r.must("scale_attn_weights", True, (True,), "is not supported: mpishard scales attention "
           "scores by 1/sqrt(head size)")
    r.must("scale_attn_by_inverse_layer_idx", False, (False,), "is not supported: mpishard "
           "does not scale attention by the layer index (use false)")
    r.must("add_cross_attention", False, (False,), "is not supported: mpishard's GPT is a "
           "decoder without cross attention")
    r.must("tie_word_embeddings", True, (True,), "is not supported: mpishard's GPT ties the "
           "output layer to the token table (use true)")
    return fields


def _llama_fields(r: _Reader) -> dict:
    raw = r.raw
    n_embd, n_head = r.integer("hidden_size", 4096), r.integer("num_attention_heads", 32)
    kv = raw.get("num_key_value_heads")
    fields = dict(name="llama", vocab_size=r.integer("vocab_size", 32000),
                  block_size=r.integer("max_position_embeddings", 2048),
                  n_layer=r.integer("num_hidden_layers", 32), n_head=n_head,
                  n_kv_head=n_head if kv is None else r.integer("num_key_value_heads"),
                  n_embd=n_embd, intermediate_size=r.integer("intermediate_size", 11008),
                  rms_eps=r.number("rms_norm_eps", 1e-6),
                  tie_embeddings=r.flag("tie_word_embeddings", False), bias=False,
                  moe_experts=0)
    for key in ("attention_bias", "mlp_bias"):
        r.must(key, False, (False, None), "is not supported: mpishard's Llama has no biases "
               "(use false)")
    r.must("hidden_act", "silu", ("silu",), "is not supported: mpishard's Llama MLP is SwiGLU "
           "with SiLU ('silu')")
    head_dim = raw.get("head_dim")
    if head_dim is not None and (n_embd % n_head or head_dim != n_embd // n_head):
        r.refuse("head_dim", head_dim, f"is not supported: mpishard's heads are hidden_size / "
                 f"num_attention_heads = {n_embd / n_head:g} wide")
    fields.update(_rope_fields(r))
    return fields


def _mixtral_fields(r: _Reader) -> dict:
    """A Llama with a mixture of experts in every block (Mixtral's SwiGLU experts)."""
    fields = _llama_fields(r)
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
    fields.update(moe_experts=experts, moe_top_k=top_k, moe_every=1, moe_capacity=0.0,
                  moe_aux_coef=float(coef))
    return fields


def _rope_fields(r: _Reader) -> dict:
    """rope_theta and the scaling, from transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` / ``rope_scaling`` keys."""
    raw = r.raw
    params = raw.get("rope_parameters")
    key = "rope_parameters" if isinstance(params, dict) else "rope_scaling"
    params = params if isinstance(params, dict) else raw.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        r.refuse(key, params, "must be an object or null")
    params = params or {}
    theta = r.number("rope_theta", 10000.0, params.get("rope_theta", raw.get("rope_theta",
                                                                             10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "llama3"):
        r.refuse(f"{key}.rope_type", kind, "is not implemented: mpishard has Llama 3's "
                 "frequency scaling ('llama3') or none ('default')")
    factor = params.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        r.refuse(f"{key}.partial_rotary_factor", factor, "is not supported: mpishard rotates "
                 "whole heads (use 1.0)")
    fields = dict(rope_theta=theta, rope_scaling="none", rope_factor=8.0,
                  rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                  rope_original_max_position=8192)
    if kind == "llama3":
        missing = [k for k in _LLAMA3_KEYS if k not in params]
        if missing:
            r.refuse(key, params, f"lacks {', '.join(missing)}, which llama3 scaling needs")
        sub = _Reader(params, f"{r.where}: {key}")
        fields.update(rope_scaling="llama3", rope_factor=sub.number("factor", 8.0),
                      rope_low_freq_factor=sub.number("low_freq_factor", 1.0),
                      rope_high_freq_factor=sub.number("high_freq_factor", 4.0),
                      rope_original_max_position=sub.integer("original_max_position_"
                                                             "embeddings", 8192))
    return fields


def config_from_fields(fields: dict):
    """A :class:`GPTConfig` or :class:`LlamaConfig` from :func:`model_fields`' keys."""
    common = {k: fields[k] for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")}
    if fields["name"] == "gpt":
        return GPTConfig(**common, dropout=0.0, bias=fields["bias"])
    scaling = None if fields["rope_scaling"] == "none" else {
        "rope_type": "llama3", "factor": fields["rope_factor"],
        "low_freq_factor": fields["rope_low_freq_factor"],
        "high_freq_factor": fields["rope_high_freq_factor"],
        "original_max_position_embeddings": fields["rope_original_max_position"]}
    moe = {k: fields[k] for k in ("moe_experts", "moe_top_k", "moe_every", "moe_capacity",
                                  "moe_aux_coef") if k in fields}
    return LlamaConfig(**common, n_kv_head=fields["n_kv_head"],
                       intermediate_size=fields["intermediate_size"],
                       rope_theta=fields["rope_theta"], rope_scaling=scaling,
                       rms_eps=fields["rms_eps"], tie_embeddings=fields["tie_embeddings"],
                       **moe)


def config_from_pretrained(path):
    """The :class:`GPTConfig` or :class:`LlamaConfig` of the Hugging Face folder ``path``."""
    return config_from_fields(model_fields(path))


def model_class(config) -> type:
    """:class:`GPT` or :class:`Llama`, for their configs; ValueError for anything else."""
    if isinstance(config, GPTConfig):
        return GPT
    if isinstance(config, LlamaConfig):
        return Llama
    raise ValueError(f"{type(config).__name__}: only GPT and Llama models have a Hugging "
                     f"Face form (GPT2LMHeadModel, LlamaForCausalLM)")


#: mpishard config field -> its config.json key, for messages
_HF_NAMES = {"gpt": {"block_size": "n_positions", "bias": "biases (GPT-2 always has them)"},
             "llama": {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
                       "n_kv_head": "num_key_value_heads", "n_embd": "hidden_size",
                       "rms_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings",
                       "rope_scaling": "rope_scaling"}}


def check_model_matches(config, fields: dict, where: str) -> None:
    """Raise ValueError unless ``config`` (the model's) computes what ``fields`` describe.

    Llama's ``block_size`` may differ (it only bounds the sequence length); so
    may dropout and the init scale.
    """
    want = config_from_fields(fields)
    if type(want) is not type(config):
        raise ValueError(f"{where} describes a {fields['name']} model; this model is a "
                         f"{type(config).__name__[:-6]}")
    skip = {"dropout", "init_std"} | ({"block_size"} if fields["name"] == "llama" else set())
    for name in type(config).__dataclass_fields__:
        ours, theirs = getattr(config, name), getattr(want, name)
        if name == "rope_scaling":
            ours, theirs = _scaling(ours), _scaling(theirs)
        if name not in skip and ours != theirs:
            key = _HF_NAMES[fields["name"]].get(name, name)
            raise ValueError(f"{where}: {key}={json.dumps(theirs)}, but the model has "
                             f"{name}={json.dumps(ours)}; build the model from this folder "
                             f"(mpishard.hf.config_from_pretrained) or pick the matching one")


def _scaling(scaling):
    return None if scaling is None else {k: scaling.get(k) for k in _LLAMA3_KEYS}


def hf_config(config, dtype: str) -> dict:
    """The ``config.json`` transformers reads as this model's ``GPT2Config`` / ``LlamaConfig``."""
    common = {"vocab_size": config.vocab_size, "torch_dtype": dtype, "use_cache": True}
    if isinstance(config, GPTConfig):
        token = 50256 if config.vocab_size > 50256 else None   # GPT-2's <|endoftext|>
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
                "n_positions": config.block_size, "n_embd": config.n_embd,
                "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": None,
                "activation_function": "gelu_new", "resid_pdrop": config.dropout,
                "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
                "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False, "tie_word_embeddings": True,
                "bos_token_id": token, "eos_token_id": token}
    if isinstance(config, LlamaConfig) and config.moe_experts:
        if config.moe_every != 1 or config.moe_capacity or config.moe_router != "softmax" \
                or config.moe_shared_expert:
            raise ValueError(f"this mixture of experts (every {config.moe_every} blocks, "
                             f"capacity {config.moe_capacity}, {config.moe_router} router, "
                             f"shared expert {config.moe_shared_expert}) has no transformers "
                             f"architecture; Mixtral's has experts in every block, dropless, "
                             f"a softmax router and no shared expert")
        dense = hf_config(dataclasses.replace(config, moe_experts=0), dtype)
        for key in ("pretraining_tp", "attention_bias", "mlp_bias", "head_dim"):
            dense.pop(key)
        return {**dense, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": config.moe_experts,
                "num_experts_per_tok": config.moe_top_k,
                "router_aux_loss_coef": config.moe_aux_coef, "output_router_logits": False,
                "router_jitter_noise": 0.0, "sliding_window": None}
    if isinstance(config, LlamaConfig):
        scaling = _scaling(config.rope_scaling)
        scaling = scaling if scaling is None else {"rope_type": "llama3", **scaling}
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
                "hidden_size": config.n_embd, "intermediate_size": config.intermediate_size,
                "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
                "num_key_value_heads": config.n_kv_head, "head_dim": config.head_size,
                "hidden_act": "silu", "max_position_embeddings": config.block_size,
                "rms_norm_eps": config.rms_eps, "rope_theta": config.rope_theta,
                "rope_scaling": scaling, "tie_word_embeddings": config.tie_embeddings,
                "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
                "initializer_range": config.init_std, "pretraining_tp": 1,
                "bos_token_id": None, "eos_token_id": None}
    model_class(config)   # raises
    return {}

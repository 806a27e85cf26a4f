"""``config.json``: what a Hugging Face model folder says, in mpishard's terms, and back.

[Note: what converts and what is refused]
mpishard reproduces the architectures whose model families have a Hugging Face
mapping (their spec's ``hf``, mpishard/models/hf_mapping.py; the registry is
:data:`mpishard.models.MODELS`): GPT-2 (``gpt2``, ``GPT2LMHeadModel``) as its
:class:`~mpishard.models.GPT`, and the Llama family (``llama``,
``LlamaForCausalLM``; ``mixtral``) as its :class:`~mpishard.models.Llama`.
Anything in a ``config.json`` that would make the published model compute
something else is refused with the key, its value and what would work: another
model type or architecture, quantised weights, and what each family's mapping
lists in its module docstring (models/gpt/hf.py, models/llama/hf.py). Keys
that change nothing mpishard computes (dropout rates, token ids, ``use_cache``,
``pretraining_tp``, the dtype) are read past.
"""
from __future__ import annotations

import json

from mpishard.models import MODELS, folder_keys, spec_of

__all__ = ["model_fields", "config_from_fields", "config_from_pretrained",
           "hf_config", "mapping_of", "check_model_matches"]


def model_fields(path) -> dict:
    """The mpishard ``[model]`` keys for the Hugging Face folder ``path`` (its config.json):
    ``name``, the shape (``vocab_size``, ``block_size``, ``n_layer``, ``n_head``,
    ``n_embd``) and the family's own keys (for Llama ``n_kv_head``, the RoPE keys,
    ``tie_embeddings``, ``moe_experts``, ...).

    Raises:
        ValueError: naming the key, its value and the fix, for anything mpishard
            cannot reproduce (see [Note: what converts and what is refused]).
    """
    return folder_keys(path)


def config_from_fields(fields: dict):
    """The model config (GPTConfig, LlamaConfig, ...) from :func:`model_fields`' keys (the
    family's defaults for the rest)."""
    spec = MODELS[fields["name"]]
    return spec.build_config({**spec.defaults(), **fields})


def config_from_pretrained(path):
    """The model config of the Hugging Face folder ``path``."""
    return config_from_fields(model_fields(path))


def mapping_of(config):
    """The Hugging Face mapping of ``config``'s family; ValueError for one without."""
    spec = spec_of(config)
    if spec.hf is None:
        forms = ", ".join(f"{s.name} ({next(iter(s.hf.architectures.values()))[0]})"
                          for s in MODELS.values() if s.hf is not None)
        raise ValueError(f"{type(config).__name__}: the {spec.name} model has no Hugging "
                         f"Face form; these have: {forms}")
    return spec.hf


def check_model_matches(config, fields: dict, where: str) -> None:
    """Raise ValueError unless ``config`` (the model's) computes what ``fields`` describe.

    The family's loose fields may differ (dropout, the init scale; for Llama the
    context: rotary positions take any shorter sequence).
    """
    want = config_from_fields(fields)
    if type(want) is not type(config):
        raise ValueError(f"{where} describes a {fields['name']} model; this model is a "
                         f"{spec_of(config).name}")
    mapping = mapping_of(config)
    for name in type(config).__dataclass_fields__:
        ours, theirs = getattr(config, name), getattr(want, name)
        if name not in mapping.loose_fields and ours != theirs:
            key = mapping.key_names.get(name, name)
            raise ValueError(f"{where}: {key}={json.dumps(theirs)}, but the model has "
                             f"{name}={json.dumps(ours)}; build the model from this folder "
                             f"(mpishard.hf.config_from_pretrained) or pick the matching one")


def hf_config(config, dtype: str) -> dict:
    """The ``config.json`` transformers reads as this model (GPT2Config, LlamaConfig, ...)."""
    return mapping_of(config).write_config(config, dtype)

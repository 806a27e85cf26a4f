"""The model families mpishard trains, by ``--model`` name (see [Note: model specs]).

    spec = MODELS["llama"]                  # or spec_of(model), spec_of(config)
    keys = folder_keys("path/to/hf-folder")  # the [model] keys a Hugging Face folder implies
"""
from __future__ import annotations

from pathlib import Path

from mpishard.models.gpt.spec import GPT_SPEC
from mpishard.models.hf_mapping import CONFIG, ConfigReader, read_config_json
from mpishard.models.llama.spec import LLAMA_SPEC
from mpishard.models.mlp import MLP_SPEC
from mpishard.models.qwen2.spec import QWEN2_SPEC
from mpishard.models.spec import ModelSpec

__all__ = ["MODELS", "spec_of", "folder_keys"]

#: ``--model`` name -> :class:`~mpishard.models.spec.ModelSpec`, one line a family
MODELS = {spec.name: spec for spec in (GPT_SPEC, LLAMA_SPEC, QWEN2_SPEC, MLP_SPEC)}


def spec_of(model_or_config) -> ModelSpec:
    """The spec of a model (by its ``config``, or by its class where the family has no
    config class) or of a config; ValueError for one no family has."""
    config = getattr(model_or_config, "config", model_or_config)
    for spec in MODELS.values():
        if spec.config_class is not None and type(config) is spec.config_class:
            return spec
        if spec.config_class is None and type(model_or_config) is spec.model_class:
            return spec        # a model that takes its keys itself (the MLP)
    raise ValueError(f"{type(config).__name__} is the config of no model family mpishard "
                     f"knows; those are {', '.join(MODELS)} (mpishard.models.MODELS)")


def folder_keys(path) -> dict:
    """The ``[model]`` keys (``name`` first) of the Hugging Face folder ``path``, read from
    its config.json by the mapping of the family whose ``model_type`` it has.

    Raises:
        ValueError: naming the key, its value and the fix, for a config.json no family
            reproduces (another model type or architecture, quantised weights, or what
            the family's mapping refuses).
    """
    raw = read_config_json(path)
    reader = ConfigReader(raw, str(Path(path) / CONFIG))
    kind = raw.get("model_type")
    known = {t: (spec, names) for spec in MODELS.values() if spec.hf is not None
             for t, names in spec.hf.architectures.items()}
    if kind not in known:
        listed = ", ".join(f"{t!r} ({names[0]})" for t, (_, names) in known.items())
        reader.refuse("model_type", kind, f"is not an architecture mpishard reproduces; it "
                      f"converts {listed}")
    spec, names = known[kind]
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or any(a not in names for a in archs):
        reader.refuse("architectures", archs, f"is not supported; for model_type {kind!r} "
                      f"mpishard converts {' or '.join(names)}")
    if raw.get("quantization_config") is not None:
        reader.refuse("quantization_config", raw["quantization_config"], "is set: mpishard "
                      "reads unquantised float16, bfloat16, float32 or float64 weights")
    return {"name": spec.name, **spec.hf.read_config(reader)}

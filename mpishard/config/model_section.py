"""The ``[model]`` section: the keys every model reads, and each family's own.

[Note: per-family model keys]
A model family's own ``[model]`` keys and their defaults live in its spec
(``ModelSpec.keys``, mpishard/models/<family>/spec.py). This section declares
the keys every family reads (:class:`ModelKeys`) and adds one field per key of
any family, so each stays a TOML key and a flag (``--n-kv-head``); such a field
is ``None`` until resolved: a key of the chosen family that was not given takes
that family's default (``--model llama`` alone is a Llama with Llama's
defaults), a key the chosen family does not read stays ``None`` unless given
(and is then carried, unread, as older configs carry every key). A saved config
holds the ``None`` of the keys its family does not read.
"""
from __future__ import annotations

from dataclasses import dataclass, make_dataclass

from mpishard.config.options import model_names, preset_names, opt
from mpishard.models import MODELS

__all__ = ["ModelConfig", "ModelKeys", "family_fields"]


@dataclass
class ModelKeys:
    """[model] what is trained"""

    name: str = opt("gpt", "which model family: " + ", ".join(MODELS) + " (docs/models.md)",
                    flag="model", choices=model_names, estimate=True)
    preset: str = opt("", "a published or small shape that fills the keys below (any given "
                      "key still wins)", choices=preset_names, estimate=True)
    vocab_size: int = opt(0, "tokens in the vocabulary (0: from the data, 256 for text read "
                          "as bytes, meta.json's for token ids)", low=0, estimate=True)
    block_size: int = opt(64, "context length in tokens", low=1, estimate=True)
    n_layer: int = opt(2, "transformer blocks", low=1, estimate=True)
    n_head: int = opt(4, "attention heads per block", low=1, estimate=True)
    n_embd: int = opt(64, "model width (a multiple of n_head)", low=1, estimate=True)
    dtype: str = opt("float32", "master weights and optimizer state: float32 or float64",
                     choices=("float32", "float64"), estimate=True,
                     aliases={"fp32": "float32", "fp64": "float64"})
    activation_checkpointing: str = opt("none", "recompute activations in backward instead "
                                        "of keeping them: none, full (each block), "
                                        "selective (attention's T x T core only) or op "
                                        "(each block, keeping every second matrix "
                                        "product's output)",
                                        choices=("none", "full", "selective", "op"),
                                        estimate=True,
                                        aliases={"true": "full", "false": "none"})

    def __post_init__(self):
        spec = MODELS.get(self.name)     # an unknown name is refused when checked
        for key, default in (spec.defaults() if spec is not None else {}).items():
            if getattr(self, key) is None:
                setattr(self, key, default)


def family_fields() -> list:
    """``(name, type, field)`` of every family's own keys, in the registry's order (see
    [Note: per-family model keys]); a key several families read is one field."""
    by_name: dict = {}
    for spec in MODELS.values():
        for key in spec.keys:
            by_name.setdefault(key.name, {})[spec.name] = key
    out = []
    for name, families in by_name.items():
        first = next(iter(families.values()))
        kind = "list" if isinstance(first.default, list) else type(first.default).__name__
        out.append((name, kind, opt(None, f"{', '.join(families)}: {first.help}",
                                    choices=first.choices, low=first.low, above=first.above,
                                    high=first.high,
                                    estimate=any(k.estimate for k in families.values()),
                                    families=families)))
    return out


#: the ``[model]`` section's dataclass: :class:`ModelKeys` and a field per family key
ModelConfig = make_dataclass("ModelConfig", family_fields(), bases=(ModelKeys,))
ModelConfig.__doc__ = ModelKeys.__doc__
ModelConfig.__module__ = __name__

"""``--init-from`` a Hugging Face folder: the ``[model]`` keys come from its config.json.

[Note: the shape of an init-from folder]
With ``init_from`` naming a folder that holds a config.json, the folder's family
mapping (:func:`mpishard.models.folder_keys`) gives the ``[model]`` keys, read
while the configuration is (before anything is built, on every rank alike). A
key given in the TOML file or as a flag that contradicts the folder is refused
(``--n-layer 4`` on a folder of 2 layers), naming both values, and so is a
``--preset``. A key of the mapping's ``loose_fields`` (a Mixtral's
``router_aux_loss_coef``, ``--moe-aux-coef``: a weight of the training loss,
not of what the model computes) is the folder's unless given. The context:

* a family whose positions are a learned table (GPT-2's ``n_positions``) trains
  at the folder's, and a ``--block-size`` that differs is a contradiction;
* a family of rotary positions (its spec's ``positions_key``: the Llama family)
  keeps the folder's ``max_position_embeddings`` as that key, which an export
  writes back, and trains at ``--block-size`` when given (shorter, or as far as
  a llama3 scaling reaches; beyond that the model config refuses it), else at
  the folder's context, at most :data:`CONTEXT_CAP` tokens (a note says when
  that cuts it).

A ``.safetensors`` file (a consolidated export) holds no config: its shape is
the flags'.
"""
from __future__ import annotations

from pathlib import Path

from mpishard.core.errors import ConfigError
from mpishard.models import MODELS, folder_keys
from mpishard.models.hf_mapping import CONFIG

__all__ = ["shape_from_folder", "CONTEXT_CAP"]

#: the longest context a run from a folder of rotary positions trains at without
#: --block-size (Llama 3.1's folders hold 131072 positions)
CONTEXT_CAP = 4096


def _flag(name: str) -> str:
    return "--model" if name == "name" else "--" + name.replace("_", "-")


def shape_from_folder(values: dict, notes: list) -> dict:
    """``values`` (flat names, as given) with the ``[model]`` keys of the ``init_from``
    folder (see [Note: the shape of an init-from folder]); a note appended to ``notes``.

    Raises:
        ConfigError: the folder's config.json names what mpishard cannot reproduce,
            or a given key contradicts it.
    """
    path = values.get("init_from") or ""
    if not path or (Path(path).suffix == ".safetensors" and Path(path).is_file()):
        return values
    if not (Path(path) / CONFIG).is_file():
        found = ("does not exist" if not Path(path).exists() else
                 "is a folder without a config.json" if Path(path).is_dir() else
                 "is not a folder")
        raise ConfigError(f"--init-from {path} {found}; pass a Hugging Face model folder "
                          f"(config.json and its safetensors files) or a consolidated "
                          f"mpishard .safetensors file")
    try:
        keys = folder_keys(path)
    except ValueError as err:           # an unknown architecture, an unsupported option
        raise ConfigError(str(err)) from None
    spec = MODELS[keys["name"]]
    if values.get("preset"):
        raise ConfigError(f"--init-from {path} gives the [model] shape (its config.json); "
                          f"--preset {values['preset']} contradicts it: leave --preset out")
    given = {("name" if flat == "model" else flat): v for flat, v in values.items()}
    free = set(spec.hf.loose_fields) - {spec.positions_key}
    for name, value in keys.items():
        if name in given and name not in free and given[name] != value:
            json_key = spec.hf.key_names.get(name)
            said = f"{name} = {value!r}" + (f" ({json_key})" if json_key else "")
            raise ConfigError(f"--init-from {path}: its config.json gives {said}; "
                              f"{_flag(name)} {given[name]!r} contradicts it: leave "
                              f"{_flag(name)} out (the [model] shape is the folder's)")
    out = {**values, **{("model" if k == "name" else k): v for k, v in keys.items()
                        if k not in given or k not in free}}
    longest = keys["block_size"]
    context = ""
    if spec.positions_key:
        out[spec.positions_key] = longest
        out["block_size"] = given.get("block_size", min(longest, CONTEXT_CAP))
        if out["block_size"] != longest:
            cut = "" if "block_size" in given else f" (at most {CONTEXT_CAP:,} without " \
                                                  f"--block-size)"
            context = f"; sequences of {out['block_size']:,} of its {longest:,} positions{cut}"
    notes.append(f"--init-from {path}: the [model] shape comes from its config.json "
                 f"({keys['name']}, {keys['n_layer']} layers, width {keys['n_embd']})"
                 f"{context}")
    return out

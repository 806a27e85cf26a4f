"""How a model family maps onto a Hugging Face folder: config keys both ways, tensor names.

Each family's spec (see [Note: model specs]) holds one :class:`HFMapping`;
mpishard/hf/ reads and writes folders through it and knows no family. This
module holds what the mappings share: the typed reader of a ``config.json``
whose refusals name the key and its value (:class:`ConfigReader`), and the
tensor a mapping lists for each parameter (:class:`HFTensor`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["HFMapping", "HFTensor", "ConfigReader", "read_config_json", "CONFIG",
           "named_tensors"]

CONFIG = "config.json"


@dataclass(frozen=True)
class HFMapping:
    """A model family's Hugging Face form.

    Attributes:
        architectures: ``model_type`` -> the ``architectures`` names read for it (the
            first is the one written).
        read_config: ``(ConfigReader) -> [model] keys`` (but ``name``) of a folder's config.json
            (its ``model_type`` is one of ``architectures``); a ValueError naming the
            key, its value and the fix for anything the family cannot reproduce.
        write_config: ``(config, dtype name) -> config.json`` that transformers reads
            as the same model; a ValueError for a config with no transformers form.
        tensors: ``config -> [HFTensor]``, every tensor of the files in model order.
        base_prefix: what transformers' base model (``GPT2Model``, ``LlamaModel``)
            puts in front of every name; files saved from it are read too.
        ignorable: ``(tensor name, config) -> bool``: a tensor published files may hold
            that is no parameter (causal masks, rotary buffers, a tied head).
        tied_head: ``config -> (head key, token table's name, fix)`` when the config ties
            the output layer to the token table (else ``None``): files that hold a
            head of other values are refused with ``fix`` (transformers would keep it).
        key_names: config field -> its config.json key, for messages.
        loose_fields: config fields a folder and the model loading it may differ in
            (what they change is not what the weights compute: dropout, the init
            scale, the auxiliary losses' weights); ``--init-from`` takes a given one
            over the folder's.
    """

    architectures: dict
    read_config: Callable
    write_config: Callable
    tensors: Callable
    base_prefix: str
    ignorable: Callable
    key_names: dict
    loose_fields: tuple = ("dropout", "init_std")
    tied_head: Callable = lambda config: None


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the Hugging Face checkpoint.

    Attributes:
        key: its name there.
        name: the mpishard parameter it is (``None``: a zero bias mpishard has not).
        shape: the mpishard (global) shape.
        transposed: stored as the transpose (GPT-2's ``Conv1D``).
        parts: keys whose concatenation (row-major) is this tensor (Mixtral's experts).
        part_shape: the shape of each part.
    """

    key: str
    name: str | None
    shape: tuple
    transposed: bool = False
    parts: tuple = ()
    part_shape: tuple = ()

    @property
    def hf_shape(self) -> tuple:
        return tuple(reversed(self.shape)) if self.transposed else tuple(self.shape)

    def files(self) -> list:
        """``(key, shape)`` of every tensor of the files this one is."""
        if self.parts:
            return [(k, tuple(self.part_shape)) for k in self.parts]
        return [(self.key, self.hf_shape)]


def named_tensors(model_class, config):
    """``(name, global shape)`` of every parameter of the model ``config`` builds, in model
    order (a tied head is the token table's name); shapes only, no data."""
    whole = model_class(config, materialize_now=False)
    return [(name, tuple(p.spec.global_shape)) for name, p in whole.named_parameters()]


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


class ConfigReader:
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

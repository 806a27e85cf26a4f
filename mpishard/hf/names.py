"""Which tensor of a Hugging Face checkpoint each mpishard parameter is.

Llama's names and layouts are transformers' own (``model.layers.0.self_attn.q_proj.weight``,
``[out, in]``, rotary embeddings on the two halves of each head), so they map
one to one. GPT-2 keeps nanoGPT's names, which are transformers' too, but its
four linear layers per block are ``Conv1D``, stored ``[in, out]``: those are
transposed (``c_attn`` is the fused q|k|v projection on both sides, in the same
head order). A tied output layer is not a tensor of its own in a transformers
checkpoint (``lm_head.weight`` is left out on save and re-tied on load), so
it is neither read nor written. An mpishard GPT built without biases is
written with zero biases, which computes the same thing. A Mixtral's experts are
one ``(E, 2F, C)`` gate|up and one ``(E, C, F)`` down tensor per block in mpishard
(as in transformers' model), and per-expert ``w1`` (gate), ``w3`` (up) and ``w2``
(down) tensors under ``block_sparse_moe`` in the published files: such a tensor
is the concatenation of its ``parts``, read and written part by part.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from mpishard.hf.config import model_class

__all__ = ["HFTensor", "tensor_plan", "ignorable", "BASE_PREFIX"]

_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight",
           ".mlp.c_proj.weight")
#: what transformers' base models (GPT2Model, LlamaModel) put in front of every name
BASE_PREFIX = {"GPT": "transformer.", "Llama": "model."}
#: tensors a published checkpoint may hold that are not parameters (causal masks, rotary
#: frequency buffers of older transformers) or are the tied head
_IGNORED = {"GPT": re.compile(r"(^|\.)attn\.(masked_)?bias$|^lm_head\.weight$"),
            "Llama": re.compile(r"(^|\.)rotary_emb\.inv_freq$")}
_TIED_HEAD = re.compile(r"^lm_head\.weight$")


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the Hugging Face checkpoint.

    Attributes:
        key: its name there.
        name: the mpishard parameter it is (``None``: a zero bias mpishard has not).
        shape: the mpishard (global) shape.
        transposed: stored as the transpose (GPT-2's ``Conv1D``).
    """

    key: str
    name: str | None
    shape: tuple
    transposed: bool = False
    parts: tuple = ()          # keys whose concatenation (row-major) is this tensor
    part_shape: tuple = ()

    @property
    def hf_shape(self) -> tuple:
        return tuple(reversed(self.shape)) if self.transposed else tuple(self.shape)

    def files(self) -> list:
        """``(key, shape)`` of every tensor of the files this one is."""
        if self.parts:
            return [(k, tuple(self.part_shape)) for k in self.parts]
        return [(self.key, self.hf_shape)]


def tensor_plan(config) -> list:
    """Every tensor of the Hugging Face form of the model ``config`` builds, in model order."""
    cls = model_class(config)
    whole = cls(config, materialize_now=False)   # shapes and names only, no data
    plan = []
    for name, p in whole.named_parameters():     # a tied head is the token table's name
        shape = tuple(p.spec.global_shape)
        if ".mlp.experts." in name or name.endswith(".mlp.gate.weight"):
            plan.append(_mixtral_tensor(name, shape))
            continue
        plan.append(HFTensor(name, name, shape,
                             cls.__name__ == "GPT" and name.endswith(_CONV1D)))
    if cls.__name__ == "GPT" and not config.bias:
        plan = _with_zero_biases(plan, config)
    return plan


def _mixtral_tensor(name: str, shape: tuple) -> HFTensor:
    """A Mixtral block's router or experts as the published files name them."""
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


def _with_zero_biases(plan: list, config) -> list:
    """GPT-2's biases, as zeros, after the weights of a bias-free mpishard GPT."""
    C = config.n_embd
    widths = {".ln_1.weight": C, ".ln_2.weight": C, ".attn.c_attn.weight": 3 * C,
              ".attn.c_proj.weight": C, ".mlp.c_fc.weight": 4 * C, ".mlp.c_proj.weight": C,
              "transformer.ln_f.weight": C}
    out = []
    for t in plan:
        out.append(t)
        width = next((w for suffix, w in widths.items() if t.key.endswith(suffix)), None)
        if width is not None:
            out.append(HFTensor(t.key[:-len("weight")] + "bias", None, (width,)))
    return out


def ignorable(cls_name: str, key: str, tied: bool) -> bool:
    """Whether a tensor of a published checkpoint that mpishard does not use may be left."""
    return bool(_IGNORED[cls_name].search(key) or (tied and _TIED_HEAD.search(key)))

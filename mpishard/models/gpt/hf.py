"""The GPT as transformers' GPT-2 (``GPT2LMHeadModel``): config.json both ways, tensor names.

nanoGPT's names are transformers' too, but GPT-2's four linear layers per block
are ``Conv1D``, stored ``[in, out]``: those are transposed (``c_attn`` is the
fused q|k|v projection on both sides, in the same head order). The tied output
layer is not a tensor of its own in a transformers checkpoint (``lm_head.weight``
is left out on save and re-tied on load). An mpishard GPT built without biases is
written with zero biases, which computes the same thing. Refused in a
config.json: an MLP width other than ``4 * n_embd``, an activation other than the
tanh GELU, a layer-norm epsilon other than 1e-5, attention scaled by the layer
index or not at all, cross attention, an untied head.
"""
from __future__ import annotations

import re

from mpishard.models.gpt.model import GPT
from mpishard.models.hf_mapping import ConfigReader, HFMapping, HFTensor, named_tensors

__all__ = ["GPT2"]

#: the GELU implementations that are GPT-2's tanh approximation, to the formula
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight",
           ".mlp.c_proj.weight")
#: published tensors that are no parameters: causal masks, and the tied head
_IGNORED = re.compile(r"(^|\.)attn\.(masked_)?bias$|^lm_head\.weight$")


def read_config(r: ConfigReader) -> dict:
    """The ``[model]`` keys of a GPT-2 config.json."""
    n_embd = r.integer("n_embd", 768)
    keys = dict(vocab_size=r.integer("vocab_size", 50257),
                block_size=r.integer("n_positions", 1024), n_layer=r.integer("n_layer", 12),
                n_head=r.integer("n_head", 12), n_embd=n_embd, bias=True)
    if n_embd % keys["n_head"]:
        r.refuse("n_embd", n_embd, f"is not divisible by n_head = {keys['n_head']}")
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
    return keys


def write_config(config, dtype: str) -> dict:
    """The config.json transformers reads as this GPT's ``GPT2Config``."""
    if config.moe_experts:
        raise ValueError(f"a GPT with a mixture of experts (moe_experts = "
                         f"{config.moe_experts}) has no transformers architecture; export "
                         f"with --format safetensors (mpishard's names)")
    token = 50256 if config.vocab_size > 50256 else None   # GPT-2's <|endoftext|>
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": config.vocab_size, "torch_dtype": dtype, "use_cache": True,
            "n_positions": config.block_size, "n_embd": config.n_embd,
            "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": None,
            "activation_function": "gelu_new", "resid_pdrop": config.dropout,
            "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
            "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "tie_word_embeddings": True,
            "bos_token_id": token, "eos_token_id": token}


def tensors(config) -> list:
    """Every tensor of GPT-2's files, in model order: Conv1D weights transposed, and zero
    biases after the weights of a GPT built without them."""
    plan = [HFTensor(name, name, shape, name.endswith(_CONV1D))
            for name, shape in named_tensors(GPT, config)]
    if config.bias:
        return plan
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


GPT2 = HFMapping(
    architectures={"gpt2": ("GPT2LMHeadModel", "GPT2Model")},
    read_config=read_config, write_config=write_config, tensors=tensors,
    base_prefix="transformer.", ignorable=lambda key, config: bool(_IGNORED.search(key)),
    key_names={"block_size": "n_positions", "bias": "biases (GPT-2 always has them)"},
    tied_head=lambda config: ("lm_head.weight", "transformer.wte.weight", "mpishard's GPT "
                              "ties its head: remove lm_head.weight from the files to tie it "
                              "to the token table"))

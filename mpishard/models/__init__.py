"""Models: nanoGPT's GPT, the Llama family, and an MLP classifier; one spec each.

:data:`MODELS` lists the families by ``--model`` name (see [Note: model specs]
in mpishard/models/spec.py): what the recipe, the configuration, the Hugging
Face interop and the planner know of each.
"""
from mpishard.models.gpt.model import GPT, MLP, Block, CausalSelfAttention, GPTConfig
from mpishard.models.llama.model import Llama, LlamaConfig
from mpishard.models.mlp import MLPClassifier
from mpishard.models.registry import MODELS, folder_keys, spec_of
from mpishard.models.spec import AxisSizes, ModelKey, ModelSpec

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP", "MLPClassifier",
           "Llama", "LlamaConfig", "MODELS", "ModelSpec", "ModelKey", "AxisSizes", "spec_of",
           "folder_keys"]

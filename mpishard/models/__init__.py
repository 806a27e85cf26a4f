"""Models: nanoGPT's GPT, the Llama family, and an MLP classifier."""
from mpishard.models.gpt.model import GPT, MLP, Block, CausalSelfAttention, GPTConfig
from mpishard.models.llama.model import Llama, LlamaConfig
from mpishard.models.mlp import MLPClassifier

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP", "MLPClassifier",
           "Llama", "LlamaConfig"]

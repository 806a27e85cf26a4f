"""Models: nanoGPT's GPT, the Llama family, and an MLP classifier."""
from .gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig
from .llama import Llama, LlamaConfig
from .mlp import MLPClassifier

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP", "MLPClassifier",
           "Llama", "LlamaConfig"]

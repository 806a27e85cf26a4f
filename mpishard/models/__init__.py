"""Models: nanoGPT's GPT and an MLP classifier."""
from .gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig
from .mlp import MLPClassifier

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP", "MLPClassifier"]

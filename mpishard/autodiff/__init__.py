"""A small, framework-free reverse-mode autodiff core on NumPy or CuPy arrays.

``Tensor`` and the backward engine are in :mod:`.tensor`; every op (forward
beside backward) is in :mod:`.ops`, :mod:`.nn_ops` and :mod:`.llama_ops`,
listed in ``OPS``;
activation checkpointing (:func:`recompute`) is in :mod:`.recompute`.
"""
from . import llama_fused, llama_ops, moe_ops, nn_ops, ops
from .gradcheck import gradcheck, numerical_grad
from .nn_ops import (causal_self_attention, cross_entropy, dropout, dropout_add, embedding, gelu,
                     layer_norm, linear, log_softmax, softmax)
from .ops import (OPS, add, concat, div, exp, getitem, log, masked_fill, matmul, max,
                  mean, mul, neg, permute, pow, relu, reshape, split, sqrt, sub, sum,
                  tanh, transpose, unbroadcast, where)
from .llama_ops import rms_norm, rope, rope_qkv, rope_tables, swiglu
from .recompute import recompute
from .tensor import HookHandle, Tensor, enable_grad, is_grad_enabled, no_grad

__all__ = [
    "Tensor", "no_grad", "enable_grad", "is_grad_enabled", "HookHandle", "OPS",
    "ops", "nn_ops", "gradcheck", "numerical_grad", "unbroadcast",
    "add", "sub", "mul", "div", "neg", "pow", "matmul", "sum", "mean", "max",
    "reshape", "transpose", "permute", "getitem", "concat", "split", "exp", "log",
    "tanh", "sqrt", "relu", "where", "masked_fill",
    "linear", "layer_norm", "gelu", "softmax", "log_softmax", "cross_entropy",
    "embedding", "dropout", "dropout_add", "causal_self_attention", "recompute",
    "llama_ops", "rms_norm", "rope", "rope_tables", "swiglu", "rope_qkv",
]

"""A small, framework-free reverse-mode autodiff core on NumPy or CuPy arrays.

``Tensor`` and the backward engine are in :mod:`.tensor`; every op (forward
beside backward) is in :mod:`.ops`, :mod:`.nn_ops` and :mod:`.llama_ops`,
listed in ``OPS``;
activation checkpointing (:func:`recompute`) is in :mod:`.recompute`.
"""
from mpishard.autodiff import moe_ops, nn_ops, ops
from mpishard.autodiff import gqa_attention as llama_fused
from mpishard.autodiff import rms_rope_swiglu as llama_ops
from mpishard.autodiff.gradcheck import gradcheck, numerical_grad
from mpishard.autodiff.nn_ops import (causal_self_attention, cross_entropy, dropout, dropout_add, embedding, gelu,
                     layer_norm, linear, log_softmax, softmax)
from mpishard.autodiff.ops import (OPS, add, concat, div, exp, getitem, log, masked_fill, matmul, max,
                  mean, mul, neg, permute, pow, relu, reshape, split, sqrt, sub, sum,
                  tanh, transpose, unbroadcast, where)
from mpishard.autodiff.rms_rope_swiglu import rms_norm, rope, rope_qkv, rope_tables, swiglu
from mpishard.autodiff.recompute import recompute
from mpishard.autodiff.tensor import HookHandle, Tensor, enable_grad, is_grad_enabled, no_grad

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

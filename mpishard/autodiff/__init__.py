"""A small, framework-free reverse-mode autodiff core on NumPy or CuPy arrays.

``Tensor`` with its operators is in :mod:`.tensor`, the backward engine in
:mod:`.engine`; every op (forward beside backward) is in :mod:`.ops`,
:mod:`.shape_ops`, :mod:`.nn_ops`, :mod:`.softmax_ops`, :mod:`.rms_rope_swiglu`
(RMS norm, rotary embeddings, SwiGLU), :mod:`.gqa_attention` and :mod:`.moe_ops`,
listed in ``OPS``; activation checkpointing (:func:`recompute`) is in
:mod:`.recompute`.
"""
from mpishard.autodiff import moe_ops, nn_ops, ops, rms_rope_swiglu, shape_ops, softmax_ops
from mpishard.autodiff.gradcheck import gradcheck, numerical_grad
from mpishard.autodiff.graph import unbroadcast
from mpishard.autodiff.nn_ops import dropout, dropout_add, embedding, gelu, layer_norm, linear
from mpishard.autodiff.ops import (add, astype, div, exp, log, masked_fill, matmul, max, mean,
                                   mul, neg, pow, relu, sqrt, sub, sum, tanh, where)
from mpishard.autodiff.recompute import recompute
from mpishard.autodiff.rms_rope_swiglu import rms_norm, rope, rope_qkv, rope_tables, swiglu
from mpishard.autodiff.shape_ops import concat, getitem, permute, reshape, split, transpose
from mpishard.autodiff.softmax_ops import causal_self_attention, cross_entropy, log_softmax, softmax
from mpishard.autodiff.tensor import (OPS, HookHandle, Tensor, enable_grad, is_grad_enabled,
                                      no_grad)

__all__ = [
    "Tensor", "no_grad", "enable_grad", "is_grad_enabled", "HookHandle", "OPS",
    "ops", "shape_ops", "nn_ops", "softmax_ops", "moe_ops", "rms_rope_swiglu",
    "gradcheck", "numerical_grad", "unbroadcast",
    "add", "sub", "mul", "div", "neg", "pow", "matmul", "sum", "mean", "max",
    "reshape", "transpose", "permute", "getitem", "concat", "split", "exp", "log",
    "tanh", "sqrt", "relu", "where", "masked_fill", "astype",
    "linear", "layer_norm", "gelu", "softmax", "log_softmax", "cross_entropy",
    "embedding", "dropout", "dropout_add", "causal_self_attention", "recompute",
    "rms_norm", "rope", "rope_tables", "swiglu", "rope_qkv",
]

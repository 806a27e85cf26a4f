"""Layers: Linear, Embedding, LayerNorm, Dropout, CrossEntropyLoss.

Weights are stored ``[out, in]`` like ``torch.nn.Linear`` so state dicts load
into PyTorch models unchanged.
"""
from __future__ import annotations

import numpy as np

from mpishard.autodiff import nn_ops, softmax_ops
from mpishard.autodiff.rows import release_branch
from mpishard.nn.module import Module
from mpishard.nn.parameter import Constant, Normal, Parameter

__all__ = ["Linear", "Embedding", "LayerNorm", "Dropout", "CrossEntropyLoss", "unbiased"]


class Linear(Module):
    """``y = x @ weight.T + bias``.

    Args:
        in_features, out_features: sizes.
        bias: whether to add a bias.
        init_std: standard deviation of the weight's normal initialisation.
        dtype: parameter dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 init_std: float = 0.02, dtype: str = "float32"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter((out_features, in_features), Normal(init_std), True, dtype)
        self.bias = Parameter((out_features,), Constant(0.0), False, dtype) if bias else None

    def forward(self, x):
        return nn_ops.linear(x, self.weight, self.bias)

    def forward_unbiased(self, x):
        """The output without the bias (see :func:`unbiased`)."""
        return nn_ops.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    """A lookup table of ``num_embeddings`` rows of width ``embedding_dim``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, init_std: float = 0.02,
                 dtype: str = "float32"):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = Parameter((num_embeddings, embedding_dim), Normal(init_std), True, dtype)

    def forward(self, indices):
        return nn_ops.embedding(indices, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LayerNorm(Module):
    """Layer normalisation over the last axis, with an optional bias (nanoGPT's)."""

    def __init__(self, dim: int, bias: bool = True, eps: float = 1e-5, dtype: str = "float32"):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = Parameter((dim,), Constant(1.0), False, dtype)
        self.bias = Parameter((dim,), Constant(0.0), False, dtype) if bias else None

    def forward(self, x):
        return nn_ops.layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, bias={self.bias is not None}"


class Dropout(Module):
    """Dropout with its own generator, seeded from (seed, module name) at materialisation."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout p must be in [0, 1), got {p}")
        self.p = p
        self.rng = np.random.default_rng(0)

    def forward(self, x):
        return nn_ops.dropout(x, self.p, self.rng, self.training)

    def add_to(self, residual, x, bias=None):
        """``residual + self(x + bias)`` as one op (:func:`~mpishard.autodiff.dropout_add`;
        ``residual`` or ``bias`` may be None), or ``self(x)`` when both are.

        ``x`` is a residual branch's last output, handed over: once added, its values
        are let go (:func:`~mpishard.autodiff.rows.release_values`; backward needs only
        the mask), so pass an op's fresh output that nothing reads afterwards."""
        out = self(x) if residual is None and bias is None else \
            nn_ops.dropout_add(residual, x, self.p, self.rng, self.training, bias=bias)
        if out is not x:
            release_branch(x)          # an op's output in the graph: nothing else reads it
        return out

    def extra_repr(self) -> str:
        return f"p={self.p}"


class CrossEntropyLoss(Module):
    """The mean cross-entropy of ``(N, V)`` logits against ``(N,)`` targets
    (``ignore_index`` left out). A module, so a model's parallel plan can swap it
    for the vocabulary-parallel loss."""

    def __init__(self, ignore_index: int = -100):
        super().__init__()
        self.ignore_index = ignore_index

    def forward(self, logits, targets):
        return softmax_ops.cross_entropy(logits, targets, ignore_index=self.ignore_index)


def unbiased(linear, x):
    """``(output, bias)``: ``linear``'s output for ``x`` without its bias, and the bias,
    for the next op to add in its own kernel (GELU, a residual's dropout and add: one
    launch fewer each way on a GPU, one pass fewer on a CPU); ``(linear(x), None)``
    when the layer has no bias, no ``forward_unbiased`` beside its ``forward``, or
    forward hooks (which see the biased output)."""
    split = getattr(linear, "forward_unbiased", None)
    if (split is None or getattr(linear, "bias", None) is None or linear._forward_hooks
            or linear._forward_pre_hooks or _defined_in(type(linear), "forward")
            is not _defined_in(type(linear), "forward_unbiased")):
        return linear(x), None         # (a subclass's own forward is not skipped)
    return split(x), linear.bias


def _defined_in(cls, name: str):
    """The class of ``cls``'s MRO that defines attribute ``name``."""
    return next((k for k in cls.__mro__ if name in k.__dict__), None)

"""A multi-layer perceptron classifier (ReLU between Linear layers).

    >>> model = MLPClassifier(64, (128, 128), 10, seed=0)
    >>> logits, loss = model(x, labels)        # x: (N, 64) floats, labels: (N,) ints
"""
from __future__ import annotations

import numpy as np

from mpishard.autodiff import softmax_ops
from mpishard.autodiff.ops import relu
from mpishard.autodiff.tensor import Tensor
from mpishard.core.backend import Backend
from mpishard.nn import Linear, Module, ModuleList
from mpishard.nn.init import materialize
from mpishard.models.spec import ModelKey, ModelSpec
from mpishard.nn.sharding import ShardingPlan

__all__ = ["MLPClassifier", "MLP_SPEC"]


class MLPClassifier(Module):
    """``Linear -> ReLU -> ... -> Linear`` producing class logits.

    Args:
        in_features: input width.
        hidden: widths of the hidden layers.
        n_classes: number of classes.
        seed, dtype, backend, materialize_now: as for :class:`mpishard.models.GPT`.
    """

    def __init__(self, in_features: int, hidden: tuple = (128,), n_classes: int = 10,
                 seed: int = 0, dtype: str = "float32", backend: Backend | None = None,
                 materialize_now: bool = True, bias: bool = True):
        super().__init__()
        widths = [in_features, *hidden, n_classes]
        if any(int(w) < 1 for w in widths):
            raise ValueError(f"MLPClassifier: every width must be positive, got {widths}")
        self.backend = backend or Backend()
        self.seed = seed
        self.first_stage = self.last_stage = True  # one pipeline stage (no PipelinePlan)
        self.layers = ModuleList([Linear(a, b, bias, init_std=(2.0 / a) ** 0.5, dtype=dtype)
                                  for a, b in zip(widths[:-1], widths[1:])])
        if materialize_now:
            materialize(self, seed, self.backend)

    def parallel_plan(self) -> ShardingPlan:
        """ZeRO units: one per layer. No tensor or pipeline split: the classifier
        trains with data parallelism (tp = pp = 1)."""
        return ShardingPlan(units=tuple(f"layers.{i}" for i in range(len(self.layers))))

    def activation_bytes(self, batch_size: int, seq_len: int = 1, dtype="float32",
                         lean: bool | None = None) -> int:
        """Bytes one micro-batch's forward keeps for backward: each layer's output, each
        ReLU's, and the loss's shifted logits and per-row arrays (as the GPT's, see
        mpishard/models/gpt/activations.py; ``lean`` changes nothing here: these ops keep
        the same on every array module)."""
        c = np.dtype(dtype).itemsize
        f = 4 if c == 2 else c
        n, widths = batch_size, [layer.out_features for layer in self.layers]
        total = sum(n * w * c for w in widths) + sum(n * w * c for w in widths[:-1])
        total += n * widths[-1] * f + (n * widths[-1] * 4 if c == 2 else 0) + n * (18 + f)
        return int(total) + (2 << 10) * len(widths)    # the graph's Python objects

    def forward(self, x, targets=None):
        """Logits ``(N, n_classes)`` and, with integer ``targets``, the mean cross-entropy."""
        if not isinstance(x, Tensor):  # features onto the device, in the weights' dtype
            x = Tensor(self.backend.asarray(x, dtype=self.layers[0].weight.data.dtype))
        h = x
        if targets is not None and not isinstance(targets, Tensor):
            targets = self.backend.asarray(targets)
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i < n - 1:
                h = relu(h)
        loss = softmax_ops.cross_entropy(h, targets) if targets is not None else None
        return h, loss


#: ``--model mlp``, on scikit-learn's digits (mpishard/recipes/digits.py); data parallel only
MLP_SPEC = ModelSpec(
    name="mlp", summary="a ReLU MLP classifier (the digits)", task="digits",
    model_class=MLPClassifier,
    keys=(ModelKey("hidden", [128, 128], "MLP hidden widths, e.g. [128, 64]", estimate=True,
                   shapes=True),),
    sharding=MLPClassifier.parallel_plan, axes=frozenset())

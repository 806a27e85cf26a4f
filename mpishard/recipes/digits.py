"""The MLP classifier on scikit-learn's 8x8 digits (``--model mlp``)."""
from __future__ import annotations

from mpishard.data.corpus import ArraySampler, load_digits
from mpishard.models import MLPClassifier
from mpishard.recipes.base import Recipe, register_recipe

__all__ = ["Digits"]


@register_recipe("digits")
class Digits(Recipe):
    """A ReLU MLP on 64 pixels, 10 classes; one sample is one token for throughput."""

    def model(self, backend):
        c = self.cfg
        return MLPClassifier(64, tuple(c.model.hidden), 10, seed=c.run.seed, dtype=c.model.dtype,
                             backend=backend, materialize_now=False)

    def load_data(self) -> str:
        x, y, xv, yv = load_digits(self.cfg.run.seed)
        self.train, self.val = (x, y), (xv, yv)
        return f"digits: {len(y)} train / {len(yv)} val samples"

    def train_sampler(self, dp_rank: int, dp_size: int):
        return ArraySampler(*self.train, self.cfg.optim.batch_size, dp_rank, dp_size,
                            self.cfg.run.seed)

    def eval_batches(self, dp_rank: int, dp_size: int) -> list:
        return [self.val]      # the whole validation set, the same on every rank

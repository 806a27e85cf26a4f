"""The recipe interface and its registry (see [Note: recipes])."""
from __future__ import annotations

import numpy as np

from mpishard.models import MODELS

__all__ = ["Recipe", "RECIPES", "register_recipe", "recipe_for"]

#: task (a model spec's ``task``) -> :class:`Recipe` subclass
RECIPES: dict = {}


def register_recipe(name: str):
    """Class decorator: the recipe of the model families whose spec's task is ``name``."""
    def register(cls):
        RECIPES[name] = cls
        return cls
    return register


def recipe_for(cfg) -> "Recipe":
    """The recipe of ``cfg.model.name``'s task (the name validated by the config already)."""
    return RECIPES[MODELS[cfg.model.name].task](cfg)


class Recipe:
    """One model kind's part of a run. Subclasses implement every method below.

    Attributes:
        cfg: the :class:`~mpishard.config.sections.TrainConfig`.
        tokens_per_sample: tokens one sample holds (throughput is tokens/s).
        can_sample: whether :meth:`sample` makes text.
    """

    tokens_per_sample = 1
    can_sample = False

    def __init__(self, cfg):
        self.cfg = cfg

    def model(self, backend):
        """The whole model, unmaterialised (``materialize_now=False``), on ``backend``."""
        raise NotImplementedError

    def load_data(self) -> str:
        """Read the data (local work, no communication); return a one-line description.

        Raises ``DataError`` or ``ConfigError``, which the trainer makes the same
        error on every rank.
        """
        raise NotImplementedError

    def train_sampler(self, dp_rank: int, dp_size: int):
        """A resumable sampler (``next_batch``, ``state_dict``, ``load_state_dict``) of
        this dp rank's training batches."""
        raise NotImplementedError

    def eval_batches(self, dp_rank: int, dp_size: int) -> list:
        """The fixed ``(x, y)`` batches a validation loss averages over."""
        raise NotImplementedError

    def sample(self, module, prompt: str, n_tokens: int, seed: int, temperature: float = 0.8,
               top_k: int | None = 40) -> str:
        """Text the model writes after ``prompt`` (whole models only)."""
        raise NotImplementedError(f"{type(self).__name__} does not sample")

    def step_batch(self, sampler) -> tuple:
        """One step's batch for this dp rank: ``micro_steps`` sampler batches together."""
        parts = [sampler.next_batch() for _ in range(self.cfg.optim.micro_steps)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

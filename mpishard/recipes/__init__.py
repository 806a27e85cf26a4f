"""Recipes: what each kind of model needs to train through ``mpishard train``.

[Note: recipes]
The trainer knows no model kind. A :class:`Recipe` answers for one kind of
training (a task): the model (whole and unmaterialised, built from the
``[model]`` keys through its family's spec; the trainer's
:class:`~mpishard.parallel.ParallelModel` cuts this rank's part from it), the
data it trains on, the samplers that feed each dp rank, what one sample counts
in tokens, and whether it can sample text. Recipes are listed once in
:data:`RECIPES` by task; a model family names its task in its spec
(:data:`mpishard.models.MODELS`, the ``--model`` choices), so a new language
model needs no recipe of its own.
"""
from __future__ import annotations

from mpishard.recipes.base import RECIPES, Recipe, recipe_for, register_recipe
from mpishard.recipes import digits, text  # noqa: F401,E402 (register the built-in recipes)

__all__ = ["Recipe", "RECIPES", "register_recipe", "recipe_for"]

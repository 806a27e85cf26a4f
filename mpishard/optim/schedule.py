"""Learning-rate schedules (pure functions of the step: nothing to checkpoint)."""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CosineSchedule"]


@dataclass(frozen=True)
class CosineSchedule:
    """Linear warm-up, then cosine decay to ``min_lr`` (nanoGPT's ``get_lr``).

    ``schedule(step)`` for step 0, 1, ...: ``lr * (step + 1) / (warmup + 1)``
    during warm-up, ``min_lr`` after ``decay_steps``, cosine in between.
    """

    lr: float
    warmup_steps: int
    decay_steps: int
    min_lr: float = 0.0

    def __post_init__(self):
        if self.warmup_steps < 0 or self.decay_steps < self.warmup_steps:
            raise ValueError(f"CosineSchedule: need 0 <= warmup_steps ({self.warmup_steps}) "
                             f"<= decay_steps ({self.decay_steps})")
        if self.min_lr > self.lr:
            raise ValueError(f"CosineSchedule: min_lr {self.min_lr:g} is above lr "
                             f"{self.lr:g}; the decay would raise the rate")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / (self.warmup_steps + 1)
        if step >= self.decay_steps:
            return self.min_lr
        ratio = (step - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps)
        coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
        return self.min_lr + coeff * (self.lr - self.min_lr)

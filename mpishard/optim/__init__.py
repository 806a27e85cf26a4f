"""Optimizers over flat arrays, learning-rate schedules, clipping."""
from mpishard.optim.clip import clip_coefficient, clip_grad_norm, global_grad_norm, grad_sq_sum
from mpishard.optim.optimizers import SGD, Adam, AdamW, Optimizer
from mpishard.optim.schedule import CosineSchedule

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "CosineSchedule",
           "clip_grad_norm", "global_grad_norm", "grad_sq_sum", "clip_coefficient"]

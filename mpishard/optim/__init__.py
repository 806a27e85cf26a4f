"""Optimizers over flat arrays, learning-rate schedules, clipping."""
from .clip import clip_coefficient, clip_grad_norm, global_grad_norm, grad_sq_sum
from .optimizers import SGD, Adam, AdamW, Optimizer
from .schedule import ConstantSchedule, CosineSchedule

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "CosineSchedule", "ConstantSchedule",
           "clip_grad_norm", "global_grad_norm", "grad_sq_sum", "clip_coefficient"]

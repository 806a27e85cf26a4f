"""Replicas: the ranks that hold the same values of a parameter, and checking that they do.

A parameter is held alike by every rank of ``dp x cp`` (``mesh.dp_cp``), except an
expert split over ep (:func:`is_expert_param`), which only the ranks holding the
same experts share (``mesh.edp``; see [Note: expert dispatch] in
parallel/expert/layers.py). DDP and ZeRO both check at wrap time that a built
model's replicas agree, with :func:`check_replicas_equal`.
"""
from __future__ import annotations

import hashlib

from mpishard.core.backend import to_numpy

__all__ = ["check_replicas_equal", "is_expert_param"]


def is_expert_param(p) -> bool:
    """Whether ``p`` is split over the ep group (its gradient goes over ``mesh.edp``)."""
    return p.spec.ep_range is not None


#: what the error of :func:`check_replicas_equal` suggests by default (DDP's way)
BROADCAST_FIX = "or pass sync_params='broadcast' to copy rank 0's values"


def check_replicas_equal(module, comm, what: str = "parameters", select=None,
                         fix: str = BROADCAST_FIX) -> None:
    """Raise on every rank if the module's parameters (those ``select(p)`` accepts, by
    default all) differ between ranks of ``comm``; the error suggests the same seed on
    every rank, ``fix`` too (empty: nothing more).

    Compares a SHA-256 per parameter (one small all-gather of digests).
    """
    if comm.size == 1:
        return
    named = [(n, p) for n, p in module.named_parameters() if select is None or select(p)]
    digests = [hashlib.sha256(to_numpy(p.data).tobytes()).hexdigest()[:16] for _, p in named]
    everyone = comm.all_gather_obj(digests)
    names = [n for n, _ in named]
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            first = next((names[i] for i, (a, b) in enumerate(zip(everyone[0], theirs))
                          if a != b), "the parameter list")
            raise ValueError(
                f"{what} differ across ranks at wrap time: rank {rank} differs from rank 0 "
                f"first at {first}; build the model with the same seed on every rank"
                f"{', ' + fix if fix else ''}")

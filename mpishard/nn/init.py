"""Materialising a model's parameters: one tensor at a time, from (seed, name).

See [Note: deterministic init] in parameter.py.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from mpishard.core.backend import Backend
from mpishard.nn.module import Module
from mpishard.nn.parameter import init_array, rng_for

__all__ = ["materialize", "seed_dropout"]


def materialize(model: Module, seed: int, backend: Backend | None = None,
                dtype: str | None = None) -> Module:
    """Give every unmaterialised parameter its initial value, on ``backend``.

    Args:
        model: the module tree; parameters that already hold data are left alone.
        seed: the run's seed.
        backend: where arrays live and whose ledger counts them ("params").
        dtype: override every parameter's dtype (e.g. ``"float64"`` for tests).
    """
    backend = backend or Backend()
    for name, p in model.named_parameters():
        if dtype is not None and np.dtype(dtype) != p.dtype:
            p.spec = dataclasses.replace(p.spec, dtype=str(np.dtype(dtype)))
        if p.data is not None:
            continue
        full = init_array(p.init, p.spec.global_shape, seed, name)
        local = np.ascontiguousarray(p.spec.local_slice_of(full), dtype=p.dtype)
        p.data = backend.ledger.track("params", backend.asarray(local), name)
    seed_dropout(model, seed, backend)
    return model


def seed_dropout(model: Module, seed: int, backend: Backend | None = None) -> None:
    """Give each module with an ``rng`` attribute a generator from (seed, module name).

    On a device the masks are drawn there, and a device generator is large (CuPy's
    keeps one cuRAND state per thread it may launch: 12.4 MiB on a 132-SM GPU), so a
    module that never draws (``p == 0``, GPT-2's and Llama's default) gets none
    (``rng = None``); its generator would always equal its seeded state anyway."""
    for name, module in model.named_modules():
        if "rng" in module.__dict__:
            gen = rng_for(seed, "dropout:" + name)
            if backend is not None and backend.xp is not np:   # masks drawn on the device
                draws = getattr(module, "p", 1.0) > 0.0
                gen = backend.xp.random.default_rng(int(gen.integers(2**62))) if draws \
                    else None
            module.rng = gen

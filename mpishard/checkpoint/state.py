"""Extra state as JSON: random generators (data order and dropout) for an exact resume.

A checkpoint's ``extra_state`` is JSON, never pickle, so generator states go in
as plain dicts of integers::

    extra = {"data": sampler.state_dict(), "rng": module_rng_states(model, world)}
    ...
    load_module_rng_states(model, extra["rng"])
"""
from __future__ import annotations

import numpy as np

from .collective import exchange_json

__all__ = ["generator_state", "set_generator_state", "module_rng_states",
           "load_module_rng_states"]


def generator_state(generator: np.random.Generator) -> dict:
    """A NumPy generator's state as a JSON-able dict."""
    return generator.bit_generator.state


def set_generator_state(generator: np.random.Generator, state: dict) -> None:
    """Restore a state from :func:`generator_state` (the bit generator type must match).

    Raises:
        ValueError: the state is for another bit generator, or malformed.
    """
    expected = type(generator.bit_generator).__name__
    if not isinstance(state, dict) or state.get("bit_generator") != expected:
        raise ValueError(f"generator state is not a {expected} state: {str(state)[:80]}")
    try:
        generator.bit_generator.state = state
    except (TypeError, KeyError) as err:
        raise ValueError(f"malformed {expected} state: {err}") from None


def _generators(module) -> dict:
    return {name: m.rng for name, m in module.named_modules()
            if isinstance(m.__dict__.get("rng"), np.random.Generator)}


def module_rng_states(module, world=None) -> dict:
    """``{module name: state}`` of every NumPy generator a module holds (dropout layers).

    Args:
        module: the model (on a pipeline stage: the stage's part of it).
        world: if given, merge every rank's states (collective; a pipeline
            stage holds other modules than rank 0, whose ``extra_state`` is
            the one saved). Replicas' generators advance alike; the lowest
            rank's state is kept.
    """
    states = {name: generator_state(gen) for name, gen in _generators(module).items()}
    if world is None:
        return states
    merged: dict = {}
    for rank_states in exchange_json(world, states):
        for name, state in rank_states.items():
            merged.setdefault(name, state)
    return merged


def load_module_rng_states(module, states: dict) -> None:
    """Restore every generator of ``module`` from :func:`module_rng_states` (entries for
    modules this rank does not hold, e.g. other pipeline stages', are ignored).

    Raises:
        ValueError: a generator of the module has no saved state.
    """
    generators = _generators(module)
    missing = sorted(set(generators) - set(states))
    if missing:
        raise ValueError(f"no saved generator state for modules {missing[:4]}; the saved "
                         f"states are for {sorted(states)[:4]}")
    for name, gen in generators.items():
        set_generator_state(gen, states[name])

"""Extra state as JSON: random generators (data order and dropout) for an exact resume.

A checkpoint's ``extra_state`` is JSON, never pickle, so generator states go in
as plain dicts of integers::

    extra = {"data": sampler.state_dict(), "rng": module_rng_states(model, world)}
    ...
    load_module_rng_states(model, extra["rng"])

Dropout generators on a device (CuPy's, and the strict module's in tests) keep
their whole state in one device array (see
:func:`mpishard.autodiff.recompute.device_state_array`); it is saved as its
bytes, base64 in the JSON: on CuPy 1.5 MiB per generator (one cuRAND state per
thread), read back once per checkpoint. A generator that cannot draw (a dropout
of ``p = 0``) is left out on a device, as it always equals its seeded state.
"""
from __future__ import annotations

import base64

import numpy as np

from mpishard.autodiff.recompute import device_state_array
from mpishard.core.backend import to_numpy, xp_of
from mpishard.checkpoint.collective import exchange_json

__all__ = ["generator_state", "set_generator_state", "module_rng_states",
           "load_module_rng_states"]


def generator_state(generator) -> dict:
    """A NumPy or device generator's state as a JSON-able dict."""
    if isinstance(generator, np.random.Generator):
        return generator.bit_generator.state
    device = device_state_array(generator)
    if device is None:
        raise TypeError(f"cannot save the state of a {type(generator).__module__}."
                        f"{type(generator).__name__}; use a NumPy or CuPy Generator")
    host = np.ascontiguousarray(to_numpy(device))   # one copy to the host
    return {"bit_generator": type(generator.bit_generator).__name__,
            "device_state": base64.b64encode(host.tobytes()).decode("ascii"),
            "dtype": host.dtype.str, "shape": list(host.shape)}


def set_generator_state(generator, state: dict) -> None:
    """Restore a state from :func:`generator_state` (the bit generator type must match).

    Raises:
        ValueError: the state is for another bit generator, or malformed.
    """
    expected = type(generator.bit_generator).__name__
    if not isinstance(state, dict) or state.get("bit_generator") != expected:
        raise ValueError(f"generator state is not a {expected} state: {str(state)[:80]}")
    if isinstance(generator, np.random.Generator):
        try:
            generator.bit_generator.state = state
        except (TypeError, KeyError) as err:
            raise ValueError(f"malformed {expected} state: {err}") from None
        return
    device = device_state_array(generator)
    try:
        host = np.frombuffer(base64.b64decode(state["device_state"]),
                             dtype=np.dtype(state["dtype"])).reshape(state["shape"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"malformed {expected} device state: {err}") from None
    if host.shape != tuple(device.shape) or host.dtype != device.dtype:
        raise ValueError(f"{expected} state of shape {host.shape} ({host.dtype}) does not fit "
                         f"this generator's {tuple(device.shape)} ({device.dtype}): saved "
                         f"by another CuPy version or generator size")
    device[...] = xp_of(device).asarray(host)


def _on_device(generator) -> bool:
    return device_state_array(generator) is not None


def _generators(module) -> dict:
    found = {}
    for name, m in module.named_modules():
        rng = m.__dict__.get("rng")
        if isinstance(rng, np.random.Generator):
            found[name] = rng
        elif _on_device(rng) and getattr(m, "p", 1.0) > 0.0:
            found[name] = rng
    return found


def module_rng_states(module, world=None) -> dict:
    """``{module name: state}`` of every generator a module holds (dropout layers),
    NumPy's and, on a device, CuPy's.

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

    A device generator keeps its seeded state where the checkpoint has none for
    it (saved before device states were saved) or one from the other kind of
    array module (a run moved between NumPy and CuPy, whose streams differ anyway).

    Raises:
        ValueError: a NumPy generator of the module has no saved state.
    """
    generators = _generators(module)
    missing = sorted(n for n, g in generators.items() if n not in states and not _on_device(g))
    if missing:
        raise ValueError(f"no saved generator state for modules {missing[:4]}; the saved "
                         f"states are for {sorted(states)[:4]}")
    for name, gen in generators.items():
        state = states.get(name)
        if state is None or _on_device(gen) != ("device_state" in state):
            continue
        set_generator_state(gen, state)

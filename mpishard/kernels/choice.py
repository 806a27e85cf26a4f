"""The kernel layer's switches, read from the environment (``MPISHARD_KERNELS``,
``MPISHARD_BLAS``): one spelling rule and one error for all of them."""
from __future__ import annotations

import os

__all__ = ["env_choice"]


def env_choice(name: str, choices: tuple, hint: str) -> str:
    """The value of environment variable ``name``, lower-cased, ``choices[0]`` when
    unset or empty; raises naming the value, the choices and ``hint`` otherwise."""
    value = os.environ.get(name, choices[0]).strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={value!r}: use one of {', '.join(choices)} ({hint})")
    return value

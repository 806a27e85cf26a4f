"""Communicator settings from the environment (read at entry points only).

=========================  =================================================
variable                   meaning
=========================  =================================================
``MPISHARD_DEBUG``         1: fingerprint every collective across ranks
``MPISHARD_TIMEOUT``       seconds before a stuck collective aborts (0: none)
``MPISHARD_CUDA_AWARE``    1/0: MPI takes device buffers (unset: detect)
``MPISHARD_COMM_BACKEND``  ``mpi``, ``nccl`` or ``auto`` for CuPy arrays
=========================  =================================================
"""
from __future__ import annotations

from mpishard.comm.backends import COMM_BACKENDS, DEFAULT_COMM_BACKEND

__all__ = ["ENVIRONMENT", "SettingError", "env_flag", "settings_from_env"]


class SettingError(ValueError):
    """An ``MPISHARD_*`` variable whose value does not parse; the message names it and a
    value that does (the command line prints it as one line and exits 2)."""

#: variable -> what it does (``mpishard --help`` prints this table)
ENVIRONMENT = {
    "MPISHARD_DEBUG": "1: fingerprint every collective across ranks and name the first "
                      "mismatch (slower; for debugging hangs)",
    "MPISHARD_TIMEOUT": "seconds after which a stuck collective aborts the job with the "
                        "last collectives of every rank (0 or unset: no watchdog)",
    "MPISHARD_CUDA_AWARE": "1/0: the MPI library takes GPU buffers directly (unset: "
                           "detected from the loaded libmpi)",
    "MPISHARD_COMM_BACKEND": "mpi, nccl or auto: what reduces and gathers CuPy arrays "
                             "(default mpi)",
    "MPISHARD_MALLOC": "system: leave glibc's malloc as it is (by default a NumPy run "
                       "keeps the memory a step frees for the next one: fewer page faults)",
}

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def env_flag(environ, var: str) -> bool | None:
    """``True``/``False`` for a set flag variable, ``None`` when unset.

    Raises:
        SettingError: a value that is not a flag, naming the variable.
    """
    value = environ.get(var)
    if value is None:
        return None
    if value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise SettingError(f"{var}={value!r} is not a flag; use {var}=1 or {var}=0")


def settings_from_env(environ) -> dict:
    """Keyword arguments of :class:`~mpishard.comm.Communicator` from ``environ``.

    Raises:
        SettingError: a variable that does not parse; the message names it.
    """
    settings = {"debug": bool(env_flag(environ, "MPISHARD_DEBUG")),
                "comm_backend": environ.get("MPISHARD_COMM_BACKEND") or DEFAULT_COMM_BACKEND}
    if settings["comm_backend"] not in COMM_BACKENDS:
        raise SettingError(f"MPISHARD_COMM_BACKEND={settings['comm_backend']!r} is not one of "
                           f"{', '.join(COMM_BACKENDS)}; use e.g. MPISHARD_COMM_BACKEND=mpi")
    raw = environ.get("MPISHARD_TIMEOUT", "").strip()
    try:
        seconds = float(raw) if raw else 0.0
    except ValueError:
        seconds = float("nan")
    if not 0 <= seconds < float("inf"):           # not a number, negative or infinite
        raise SettingError(f"MPISHARD_TIMEOUT={raw!r} is not a number of seconds >= 0; "
                         f"use e.g. MPISHARD_TIMEOUT=600 (0: no timeout)")
    settings["timeout"] = seconds if seconds > 0 else None
    if environ.get("MPISHARD_CUDA_AWARE", "").strip():
        aware = env_flag(environ, "MPISHARD_CUDA_AWARE")
        settings["cuda_aware"] = aware
        settings["_cuda_aware_source"] = f"MPISHARD_CUDA_AWARE={int(aware)}"
    return settings

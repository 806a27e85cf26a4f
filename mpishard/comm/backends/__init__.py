"""Collective backends: what moves a communicator's array bytes, and the choice of one.

:class:`~.base.CollectiveBackend` is the interface ([Note: collective
backends]); :class:`~.mpi.MpiBackend` (every communicator has one) and
:class:`~.nccl.NcclBackend` implement it, and :class:`~.one_rank.OneRank`
runs the groups of one rank. A new backend is one module here and one line in
:data:`BACKENDS`.
"""
from __future__ import annotations

from mpishard.comm.backends.base import CollectiveBackend
from mpishard.comm.backends.mpi import MpiBackend
from mpishard.comm.backends.nccl import NcclBackend

__all__ = ["BACKENDS", "COMM_BACKENDS", "DEFAULT_COMM_BACKEND", "AUTO", "AUTO_ORDER",
           "choose_comm_backend"]

#: ``comm_backend`` name -> backend class.
BACKENDS: dict[str, type[CollectiveBackend]] = {
    "mpi": MpiBackend,
    "nccl": NcclBackend,
}
#: What a communicator uses unless told otherwise, and where ``auto`` falls back to.
DEFAULT_COMM_BACKEND = "mpi"
#: The choice that takes the first of :data:`AUTO_ORDER` that is available.
AUTO = "auto"
#: What ``auto`` tries, in order, before :data:`DEFAULT_COMM_BACKEND`.
AUTO_ORDER = ("nccl",)
#: The values of ``comm_backend`` and ``MPISHARD_COMM_BACKEND``.
COMM_BACKENDS = (*BACKENDS, AUTO)


def choose_comm_backend(comm_backend: str) -> tuple[str, str]:
    """``(backend name, why)`` for a requested ``comm_backend``.

    ``"auto"`` takes the first backend of :data:`AUTO_ORDER` that is available
    here, else MPI (the backend may still step back to MPI later: NCCL's
    [Note: one GPU per rank]).

    Raises:
        ValueError: an unknown name, or a backend that is unavailable here.
    """
    if comm_backend not in COMM_BACKENDS:
        raise ValueError(f"unknown comm_backend {comm_backend!r}; use one of {COMM_BACKENDS}")
    if comm_backend == AUTO:
        missing = []
        for name in AUTO_ORDER:
            ok, why = BACKENDS[name].available()
            if ok:
                return name, f"auto: {why}{BACKENDS[name].auto_caveat}"
            missing.append(f"{BACKENDS[name].label} unavailable ({why})")
        return DEFAULT_COMM_BACKEND, f"auto: {'; '.join(missing)}"
    backend = BACKENDS[comm_backend]
    ok, why = backend.available()
    if not ok:
        raise ValueError(f"comm_backend={comm_backend!r} but {backend.label} is unavailable "
                         f"({why}); {backend.install_hint} or use "
                         f"comm_backend={DEFAULT_COMM_BACKEND!r}")
    return comm_backend, f"comm_backend={comm_backend!r}" + (f" ({why})" if why else "")


"""What ``srun`` needs to know about this install: the PMI its MPI library speaks.

    python -m mpishard.comm.slurm pmi          # prints e.g. "pmi2": use srun --mpi=pmi2
    python -m mpishard.comm.slurm describe     # "pmi2 (MPICH Version: 5.0.2 ...): why"

``srun --mpi=TYPE`` must match the process-management interface the MPI library
that mpi4py loads was built for, or every rank starts alone (``mpishard train``
then stops with ``LauncherMismatch``). The library is asked for its version
string without starting MPI, so this runs in a batch script outside ``srun``.
The Slurm templates in slurm/ call it when ``SRUN_MPI=auto`` (their default).
"""
from __future__ import annotations

import sys

__all__ = ["mpi_library_version", "srun_mpi_type", "main"]

#: (substring of MPI_Get_library_version, srun --mpi type, why); first match wins
_RULES = (
    ("CRAY MPICH", "cray_shasta", "Cray MPICH on HPE/Cray systems speaks Cray's PMI"),
    ("Open MPI", "pmix", "Open MPI 4/5 starts through PMIx"),
    ("Intel(R) MPI", "pmi2", "Intel MPI under srun uses Slurm's PMI-2"),
    ("MVAPICH", "pmi2", "MVAPICH under srun uses Slurm's PMI-2"),
    ("MPICH", "pmi2", "MPICH's built-in PMI client (the mpich wheel's too) speaks PMI-2"),
)


def mpi_library_version() -> str:
    """``MPI_Get_library_version()`` of the library mpi4py loads, without MPI_Init.

    Sets ``mpi4py.rc.initialize = False`` for this process: call it from a
    process that does nothing else with MPI (``python -m mpishard.comm.slurm``).
    """
    import mpi4py

    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from mpi4py import MPI

    return MPI.Get_library_version().replace("\x00", "").strip()   # Open MPI ends it with NUL


def srun_mpi_type(version: str) -> tuple[str, str]:
    """``(srun --mpi type, why)`` for an MPI library version string."""
    upper = version.upper()
    for needle, kind, why in _RULES:
        if needle.upper() in upper:
            return kind, why
    return "pmi2", "unknown MPI library: PMI-2 is the interface most builds of Slurm serve"


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args not in (["pmi"], ["describe"]):
        print("usage: python -m mpishard.comm.slurm pmi|describe", file=sys.stderr)
        return 2
    version = mpi_library_version()
    kind, why = srun_mpi_type(version)
    if args == ["pmi"]:
        print(kind)
    else:
        print(f"{kind} ({version.splitlines()[0].strip()}): {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Communication: every byte that crosses ranks goes through here.

Importing this package initialises MPI (it imports ``mpi4py.MPI``).

* :class:`Communicator` wraps one MPI communicator (collectives, non-blocking
  forms returning a :class:`Handle`, point to point, ``*_obj`` forms, split,
  statistics in :class:`CommStats`, a ledger of recent collectives);
* :class:`Mesh` names the parallel axes (``dp``, ``tp``, ``pp``) as
  sub-communicators;
* :func:`install_abort_hook`, :func:`check_launcher`, debug mode and the
  watchdog turn distributed failures into errors instead of hangs;
* :mod:`.gpu` and :mod:`.nccl` handle CuPy arrays (CUDA-aware MPI, pinned host
  staging, NCCL); :mod:`.bucket` flattens many arrays into one buffer.

See docs/comm.md for the whole story.
"""
from .abort import LauncherMismatch, check_launcher, install_abort_hook
from .bucket import FlatLayout, padded_size
from .communicator import COMM_BACKENDS, Communicator
from .debug import CollectiveMismatch, CollectiveTimeout
from .gpu import detect_cuda_aware, format_rank_reports, nccl_available, rank_report
from .handles import Handle
from .mesh import Mesh, node_local_rank
from .stats import CommStats

__all__ = [
    "Communicator",
    "COMM_BACKENDS",
    "Mesh",
    "Handle",
    "CommStats",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "LauncherMismatch",
    "install_abort_hook",
    "check_launcher",
    "node_local_rank",
    "detect_cuda_aware",
    "nccl_available",
    "rank_report",
    "format_rank_reports",
    "FlatLayout",
    "padded_size",
]

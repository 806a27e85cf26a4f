"""Communication: every byte that crosses ranks goes through here.

Importing this package initialises MPI (it imports ``mpi4py.MPI``). It holds
only what moves bytes; flat buffer layouts and the tensor-parallel autodiff ops
are math, and live in :mod:`mpishard.parallel`.

* :class:`Communicator` wraps one MPI communicator (collectives, non-blocking
  forms returning a :class:`Handle`, point to point, ``*_obj`` forms, split,
  statistics in :class:`CommStats`, a history of recent calls);
* :class:`Mesh` names the parallel axes (``dp``, ``tp``, ``pp``) as
  sub-communicators;
* :func:`install_abort_hook`, :func:`check_launcher`, debug mode and the
  watchdog turn distributed failures into errors instead of hangs;
* :mod:`.backends` move the array bytes (:mod:`.backends.mpi`, with
  :mod:`.gpu` for CuPy arrays: CUDA-aware MPI or pinned host staging;
  :mod:`.backends.nccl`); :mod:`.launch` reports where each rank runs.

See docs/comm.md for the whole story.
"""
from mpishard.comm.abort import LauncherMismatch, check_launcher, install_abort_hook
from mpishard.comm.backends import COMM_BACKENDS
from mpishard.comm.communicator import Communicator
from mpishard.comm.debug import CollectiveMismatch, CollectiveTimeout
from mpishard.comm.env import ENVIRONMENT
from mpishard.comm.gpu import detect_cuda_aware, nccl_available
from mpishard.comm.handles import Handle
from mpishard.comm.launch import format_rank_reports, node_local_rank, rank_report
from mpishard.comm.mesh import Mesh
from mpishard.comm.stats import CommStats

__all__ = [
    "Communicator",
    "COMM_BACKENDS",
    "ENVIRONMENT",
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
]

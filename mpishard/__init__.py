"""mpishard: readable model sharding on NumPy/CuPy and mpi4py.

Layers (imports point down only): cli/train -> checkpoint -> parallel -> comm ->
nn/optim/models -> autodiff -> backend. Importing mpishard does not initialise
MPI; ``mpishard.comm`` does, when it is imported.
"""
__version__ = "0.1.0"

from mpishard.autodiff import Tensor, no_grad  # noqa: E402
from mpishard.core.backend import Backend, MemoryLedger, OutOfMemoryBudget  # noqa: E402

__all__ = ["__version__", "Tensor", "no_grad", "Backend", "MemoryLedger",
           "OutOfMemoryBudget", "install_abort_hook"]


def install_abort_hook(*communicators, threads: bool = True) -> None:
    """Abort the whole MPI job on an unhandled exception on any rank.

    See :func:`mpishard.comm.install_abort_hook` (imported here lazily, so that
    ``import mpishard`` does not initialise MPI).
    """
    from mpishard.comm import install_abort_hook as install  # noqa: PLC0415

    install(*communicators, threads=threads)

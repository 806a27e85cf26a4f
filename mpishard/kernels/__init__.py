"""The fused kernels, one set per backend, beside the plain references they are tested against.

    from mpishard.kernels import kernels_for
    k = kernels_for(xp)                  # the set for this array module
    y, t = k.gelu_forward(a)             # 2-D rows in float32 / float64

Every kernel set provides the same kernels, :class:`.protocol.KernelSet` (each
kernel's signature and contract; ``tests/kernels/test_kernels.py`` holds every set to it):

* :mod:`.cpu.ops` for NumPy arrays: cache-blocked passes, spread over
  ``MPISHARD_THREADS`` threads (default 1, see :mod:`.cpu.threads`);
* :mod:`.cuda.ops` for CuPy and the CuPy-strict test module: each kernel one compiled
  kernel launch (elementwise chains, a thread block per row for the norms and
  attention's softmax), plain row softmax as the reference (on the strict module
  each fused kernel counts as one launch);
* :mod:`.reference`: whole-array expressions, the math of every kernel;
* ``MPISHARD_KERNELS=reference`` selects the references everywhere: the
  fallback when a kernel misbehaves on a new machine (``MPISHARD_KERNELS=auto``,
  the default, picks per backend);
* ``MPISHARD_ATTENTION=fused`` runs a GPU's causal attention (without dropout of the
  weights) as the flash-style kernels of :mod:`.cuda.attention`, which keep no
  ``T x T`` array; ``batched`` (the default) keeps the weights and runs the products
  on cuBLAS. NumPy always keeps its per-sequence loop (:func:`fused_attention`).
"""
from __future__ import annotations

import numpy as np

from mpishard.kernels import reference
from mpishard.kernels.choice import env_choice
from mpishard.kernels.cpu import ops as cpu_kernels
from mpishard.kernels.cuda import ops as gpu_kernels
from mpishard.kernels.protocol import KernelSet

__all__ = ["kernels_for", "kernel_choice", "attention_choice", "fused_attention",
           "device_fused_attention",
           "check_settings", "describe"]

_CHOICES = ("auto", "reference")
_ATTENTION_CHOICES = ("batched", "fused")


def kernel_choice() -> str:
    """``MPISHARD_KERNELS``: ``"auto"`` (the default) or ``"reference"``."""
    return env_choice("MPISHARD_KERNELS", _CHOICES,
                      "'reference' runs the plain reference kernels everywhere")


def attention_choice() -> str:
    """``MPISHARD_ATTENTION``: ``"batched"`` (the default) or ``"fused"``."""
    return env_choice("MPISHARD_ATTENTION", _ATTENTION_CHOICES,
                      "'fused' runs a GPU's attention as flash-style kernels that keep no "
                      "T x T weights")


def fused_attention(xp, head_size: int, dropout: bool) -> bool:
    """Whether causal attention on array module ``xp`` runs the fused kernels: on a device
    (CuPy, or the strict module that stands in for it) and :func:`device_fused_attention`.
    The op and the activation plan both ask this."""
    return xp is not np and device_fused_attention(head_size, dropout)


def device_fused_attention(head_size: int, dropout: bool) -> bool:
    """Whether causal attention on a device runs the fused kernels: asked for
    (:func:`attention_choice`), without dropout of the weights (its draws would be a ``T x
    T`` array) and with a head size the kernels take (the GPU kernel model asks this)."""
    from mpishard.kernels.cuda.attention import MAX_HEAD_SIZE
    return not dropout and 0 < head_size <= MAX_HEAD_SIZE and attention_choice() == "fused"


def check_settings() -> None:
    """Raise now (ValueError, or RuntimeError when MKL is asked for and does not load)
    for a bad ``MPISHARD_KERNELS``, ``MPISHARD_ATTENTION``, ``MPISHARD_THREADS`` or
    ``MPISHARD_BLAS``, rather than at the first op that reads it."""
    from mpishard.kernels.cpu.blas import blas_choice, mkl_library
    from mpishard.kernels.cpu.threads import thread_count
    kernel_choice()
    attention_choice()
    thread_count()
    if blas_choice() == "mkl":
        mkl_library()


def describe() -> str:
    """One line for ``mpishard info``: which kernel sets run, with how many CPU threads."""
    from mpishard.kernels.cpu.threads import thread_count
    if kernel_choice() == "reference":
        return "reference everywhere (MPISHARD_KERNELS=reference)"
    n = thread_count()
    return (f"cpu on NumPy ({n} thread{'s' if n > 1 else ''} per rank, MPISHARD_THREADS), "
            f"gpu on CuPy (compiled kernels; attention {attention_choice()}, "
            f"MPISHARD_ATTENTION)")


def kernels_for(xp) -> KernelSet:
    """The kernel set for array module ``xp`` (see the module docstring)."""
    if kernel_choice() == "reference":
        return reference
    return cpu_kernels if xp is np else gpu_kernels

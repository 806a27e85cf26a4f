"""Optimizer offload: float32 masters and optimizer state in host memory, the update on the host.

    model = ZeRO(GPT(cfg, materialize_now=False), mesh, stage=3, precision="bfloat16",
                 offload="optimizer")
    opt = AdamW(model.parameters(), lr=3e-4, ledger=model.ledger)   # host targets
    ...
    model.step(opt, max_norm=1.0)

[Note: optimizer offload]
With ``offload="optimizer"`` (``--offload optimizer``) a strategy keeps what only the
optimizer reads in host memory, as ZeRO-Offload (Ren et al. 2021) and FSDP2's
``CPUOffloadPolicy`` do: each master -- DDP's flat master, ZeRO's flat shard of each
unit -- becomes a host NumPy array (pinned memory under CuPy), the optimizer's target;
its optimizer state follows it (an optimizer allocates state where its target lives).
What the model computes with stays on the device: the compute copy (16-bit, or the
float32 values themselves without mixed precision), the gradient buffers, ZeRO-3's
gathered units. A step then goes:

1. backward and the gradient reductions run on the device as without offload;
2. each reduced gradient (a ZeRO unit's shard, a DDP bucket) is copied into its
   master's host gradient buffer as its reduction finishes;
3. the global norm, the clipping factor and the non-finite skip are decided from the
   device's gradients, collectively, exactly as without offload;
4. the optimizer updates the host masters (the host kernel: mpishard/kernels/cpu/adam.py);
5. each master is copied back into its compute copy on the device (cast on the host
   first, so a 16-bit copy moves half the bytes), then ZeRO-1/2 all-gather as before.

Every value is the one the same arithmetic gives without offload, so losses are
bit-identical wherever the host's and the device's arithmetic are the same (always
on NumPy). The ledger counts the host arrays as host memory
(:meth:`~mpishard.core.backend.MemoryLedger.host_bytes_by_category`): per parameter,
the device no longer holds the float32 master (where it was a separate copy) nor the
optimizer's state, 8 bytes for AdamW.
"""
from __future__ import annotations

import numpy as np

from mpishard.parallel.flat import FlatShard
from mpishard.parallel.precision import MasterCopies

__all__ = ["OFFLOADS", "HostMasters", "check_offload", "host_zeros", "to_host", "to_device",
           "copy_into"]

#: what ``offload`` accepts (``--offload``)
OFFLOADS = ("none", "optimizer", "params")


def check_offload(value, strategy_cls) -> str | None:
    """What ``value`` (``None``, ``"none"``, ``"optimizer"`` or ``"params"``) offloads:
    ``None``, ``"optimizer"`` or ``"params"`` (which offloads the optimizer too); a
    ValueError naming the value, or the strategy that cannot offload it, and the fix."""
    if value in (None, "none"):
        return None
    if value not in OFFLOADS:
        raise ValueError(f"offload={value!r} is not one of {', '.join(OFFLOADS)}; "
                         f"offload='optimizer' keeps the optimizer state and float32 "
                         f"masters in host memory, 'params' (ZeRO-3) the parameter "
                         f"shards too")
    if not getattr(strategy_cls, "offloads_optimizer", False):
        raise ValueError(f"{strategy_cls.__name__} cannot offload its optimizer "
                         f"(offload={value!r}); use DataParallel or ZeRO, or offload='none'")
    if value == "params" and not getattr(strategy_cls, "offloads_params", False):
        raise ValueError(f"{strategy_cls.__name__} cannot offload its parameters "
                         f"(offload='params'): only ZeRO-3 keeps them as shards between "
                         f"uses; use --strategy zero3, or offload='optimizer'")
    return value


def _is_cupy(xp) -> bool:
    return getattr(xp, "__name__", "") == "cupy"


def host_zeros(ledger, category: str, size: int, dtype, name: str, xp):
    """A zeroed 1-D host array, counted as host memory: page-locked under CuPy (copies to
    and from the device run at full speed without staging), plain NumPy otherwise."""
    if _is_cupy(xp):
        import cupyx  # noqa: PLC0415 (only with CuPy)

        return ledger.track(category, cupyx.zeros_pinned((size,), dtype), name, host=True)
    return ledger.zeros(category, (size,), dtype, name, xp=np, host=True)


def to_host(src, dst) -> None:
    """Copy device array ``src`` into host array ``dst`` (same size; cast to ``dst``'s
    dtype on the host if they differ)."""
    if isinstance(src, np.ndarray):
        dst[...] = src.reshape(dst.shape)
    elif src.dtype == dst.dtype:
        src.reshape(dst.shape).get(out=dst)
    else:
        dst[...] = src.get().reshape(dst.shape)


def to_device(src, dst, staging=None) -> None:
    """Copy host array ``src`` into device array ``dst`` (same size). A dtype change is
    a cast on the host into ``staging`` (a host array of ``dst``'s dtype), so only
    ``dst``'s bytes cross."""
    if isinstance(dst, np.ndarray):
        dst[...] = src.reshape(dst.shape)
        return
    if src.dtype != dst.dtype:
        if staging is None:
            staging = np.empty(src.shape, dst.dtype)
        staging[...] = src
        src = staging
    dst.set(src.reshape(dst.shape))


def copy_into(dst, src) -> None:
    """``dst[...] = src`` whichever of the two is in host memory (NumPy) and which on the
    device."""
    if isinstance(dst, np.ndarray) == isinstance(src, np.ndarray):
        dst[...] = src
    elif isinstance(dst, np.ndarray):
        to_host(src, dst)
    else:
        to_device(src, dst)


class HostMasters(MasterCopies):
    """:class:`MasterCopies` with the masters in host memory (see [Note: optimizer offload]).

    Each entry pairs a host master (the optimizer's :class:`FlatShard` target, with
    a host gradient buffer of its size) with the device array the model reads.

    Args:
        ledger: where the host arrays are counted (as host memory).
        xp: the device's array module (CuPy: host arrays in page-locked memory).
    """

    def __init__(self, ledger, xp):
        super().__init__()
        self.ledger, self.xp = ledger, xp
        self.host_grads: dict = {}     # id(target) -> its host gradient buffer
        self.staging: dict = {}        # id(target) -> host array of the compute dtype

    def add(self, master, compute, decay_ranges: tuple, name: str):
        """Pair ``master`` (1-D) with ``compute``; return the target, whose data is
        ``master`` itself when it was built in host memory (:func:`host_zeros`), else a
        host copy of it (a device master that was a separate array is then released)."""
        if isinstance(master, np.ndarray) and self.ledger.on_host(master):
            host = master
        else:
            host = host_zeros(self.ledger, "params", master.size, master.dtype,
                              f"host master {name}", self.xp)
            to_host(master, host)
            if master is not compute:     # the device's float32 master: no longer needed
                self.ledger.release(master)
        target = FlatShard(host, decay_ranges, name)
        self.host_grads[id(target)] = host_zeros(self.ledger, "grads", master.size,
                                                 master.dtype, f"host grads {name}", self.xp)
        if compute.dtype != host.dtype and _is_cupy(self.xp):
            self.staging[id(target)] = host_zeros(self.ledger, "comm", compute.size,
                                                  compute.dtype, f"host staging {name}",
                                                  self.xp)
        self.pairs.append((target, compute))
        return target

    def grad_to_host(self, target, grad, span: tuple | None = None) -> None:
        """Copy device gradient ``grad`` into ``target``'s host gradient buffer (or into
        elements ``span = (lo, hi)`` of it: one bucket), which becomes ``target.grad``."""
        host = self.host_grads[id(target)]
        lo, hi = span if span is not None else (0, host.size)
        if grad is not host:                 # a ZeRO unit's shard may be the buffer itself
            to_host(grad, host[lo:hi])
        target.grad = host

    def refresh(self) -> None:
        """Copy every host master into its device compute copy (after an update or a load)."""
        for target, compute in self.pairs:
            to_device(target.data, compute, self.staging.get(id(target)))

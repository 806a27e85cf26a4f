"""A unit's gradient reduce-scatter in flight, and the queue that bounds how many are.

Backward reduce-scatters each ZeRO unit's gradients (averaging them into this
rank's shard) as soon as they are final, non-blocking, so the communication
overlaps the rest of backward. Each reduction in flight holds a full-size flat
gradient buffer (stages 2 and 3), so a strategy's units share one
:class:`ReductionQueue` that keeps at most ``limit`` of them: adding one more
first finishes the oldest. Every rank adds and finishes them in the same order.
"""
from __future__ import annotations

from mpishard.core.backend import to_numpy
from mpishard.parallel.offload import copy_into

__all__ = ["Reduction", "ReductionQueue"]


class Reduction:
    """One unit's reduce-scatter in flight: its handle and the buffers it holds."""

    __slots__ = ("unit", "handle", "flat", "recv", "first")

    def __init__(self, unit, handle, flat, recv, first: bool):
        self.unit, self.handle, self.flat, self.recv, self.first = unit, handle, flat, recv, first

    def finish(self, ledger) -> None:
        """Wait; add (or, for the step's first, cast) the received slice into the
        gradient shard (under offload a host array: the slice is copied there as its
        reduction finishes, while backward goes on); release the buffers that were only
        for this reduction."""
        if self.handle is not None:  # None: nothing to send (see ZeroUnit.aliased)
            self.handle.wait()
        unit = self.unit
        if unit.replicate is not None:  # hybrid sharding: then average across replicas
            unit.replicate.all_reduce(self.recv, op="avg")
        if unit.scale != 1.0:     # expert gradients: 1 / ep (see parallel/expert/layers.py)
            self.recv *= unit.scale
        if unit.shard_at_step:   # stage 1: back into grad_full (see [Note: stage 1's
            unit.keep_reduced(self.recv, self.first)           # gradient shard] in base.py)
            ledger.release(self.recv)
        elif self.recv is not unit.grad_shard:
            if self.first:  # reduced in another dtype, or into the device: into the shard
                copy_into(unit.grad_shard, self.recv)
            elif ledger.on_host(unit.grad_shard) and not ledger.on_host(self.recv):
                unit.grad_shard += to_numpy(self.recv).astype(unit.grad_shard.dtype)
            else:
                unit.grad_shard += self.recv
            ledger.release(self.recv)
        if self.flat is not unit.grad_full:
            ledger.release(self.flat)


class ReductionQueue:
    """The reductions a strategy's units launched and that are not finished, oldest first.

    Args:
        ledger: where the reductions' buffers are released.
        limit: reductions in flight before adding one finishes the oldest.
    """

    def __init__(self, ledger, limit: int):
        self.ledger, self.limit = ledger, limit
        self.pending: list[Reduction] = []

    def add(self, reduction: Reduction) -> None:
        """Keep ``reduction`` in flight; bound the full-size gradient buffers alive at
        once (stage 2/3 memory) by finishing the oldest beyond ``limit``."""
        self.pending.append(reduction)
        while len(self.pending) > self.limit:
            self.pending.pop(0).finish(self.ledger)

    def finish(self) -> None:
        """Finish every reduction in flight, oldest first."""
        while self.pending:
            self.pending.pop(0).finish(self.ledger)

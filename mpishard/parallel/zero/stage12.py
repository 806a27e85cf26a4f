"""ZeRO stages 1 and 2: the optimizer state (stage 1) and the gradients (stage 2)
are sharded over dp; the parameters stay whole on every rank.

    mpiexec -n 4 python -m mpi4py -m mpishard train --strategy zero2

Each unit keeps one flat compute buffer holding all its parameters (their
``data`` are views into it) and this rank's master slice (the slice itself, or
a float32 copy under mixed precision). Backward reduce-scatters each unit's
gradients as soon as they are final; stage 1 reduces from a full gradient
buffer it keeps, stage 2 from a transient one. After the optimizer updated the
slices, the full buffers are re-gathered: the slice is already this rank's block
of the buffer (or is cast into it), so the all-gather runs in place. Use
``ZeRO(module, mesh, stage=1 or 2)``; this class is what that builds.
"""
from __future__ import annotations

from mpishard.parallel.offload import copy_into
from mpishard.parallel.strategy import Sharded, register_strategy
from mpishard.parallel.zero.base import ZeroStrategy, ZeroUnit

__all__ = ["ShardedStateZeRO"]


@register_strategy("zero2", "ZeRO-2: gradients and optimizer state sharded, parameters "
                   "whole", keeps_sharded=Sharded.GRADIENTS, stage=2)
@register_strategy("zero1", "ZeRO-1: optimizer state sharded, parameters and gradients "
                   "whole", keeps_sharded=Sharded.OPTIMIZER_STATE, stage=1)
class ShardedStateZeRO(ZeroStrategy):
    """ZeRO stages 1 and 2 (see the module docstring); build it as ``ZeRO(stage=1|2)``."""

    stages = (1, 2)

    def _make_unit(self, layout) -> ZeroUnit:
        ledger, xp, cd = self.ledger, self.xp, self.compute_dtype
        dp, scale = self.unit_group(layout)
        unit = ZeroUnit(layout, dp, self.context, scale, keep_full_grads=self.stage == 1)
        unit.full = ledger.zeros("params", (layout.padded,), cd, f"params {layout.label}", xp=xp)
        block = unit.full[layout.shard_start:layout.shard_stop]  # this rank's, in compute dtype
        master = block if not self.mixed else self._new_master(layout)
        views = layout.views(unit.full)
        for i, p, value in self._initial_values(layout):
            views[i][...] = value
            p.data = views[i]
            if self.mixed:
                offset, piece = layout.owned_piece(i, value)
                copy_into(master[offset:offset + piece.size], piece)
        unit.target = self.masters.add(master, block, layout.decay_ranges(), layout.label)
        unit.allocate_grads(self.host_grad_shard(unit))
        return unit

    def _before_forward(self) -> None:
        """Settle the reductions; stage 1 also clears the full gradients it reduced: the
        next backward's gradients then reduce on their own and add to the shard (each
        micro-step may communicate; ``no_sync`` only saves the traffic)."""
        super()._before_forward()
        if self.stage == 1:
            for unit in self.units:
                if unit.reductions and not unit.aliased:  # aliased: the sum stays in place
                    unit.settle()     # the reduced slice into the shard, before clearing
                    unit.grad_full[...] = 0

    def after_update(self) -> None:
        """Bring the full parameters up to date with the updated (or loaded) slices.

        This rank's block of each full buffer (the slice itself, or its 16-bit copy
        under mixed precision) is current, so the all-gather runs in place.
        """
        self.masters.refresh()
        handles = [unit.dp.iall_gather(unit.full[unit.layout.shard_start:unit.layout.shard_stop],
                                       unit.full) for unit in self.units]
        for handle in handles:
            handle.wait()

"""ZeRO stage 3 (full sharding, as PyTorch FSDP): between steps a rank holds only shards.

    mpiexec -n 4 python -m mpi4py -m mpishard train --strategy zero3

Each unit is a :class:`ShardedUnit` that owns its parameters' lifecycle, with
an explicit :class:`UnitState` as FSDP2's parameter group has:

    SHARDED --prefetch()--> GATHERING --unshard()--> UNSHARDED --reshard()--> SHARDED
       \\________________________unshard()_______________/

A block unit is all-gathered just before its forward (a forward pre-hook),
released after it (``reshard_after_forward``), gathered again when backward
reaches it (a grad-ready hook on the unit's output) and released once its
gradients are reduce-scattered; the next unit's gather is issued ahead,
non-blocking (``prefetch``). The root unit is gathered for the whole forward
and backward. With mixed precision the unit all-gathers a 16-bit copy of its
shard, cast once per step. Use ``ZeRO(module, mesh, stage=3)``; this class is
what that builds.
"""
from __future__ import annotations

import enum

from mpishard.autodiff.tensor import Tensor
from mpishard.parallel.zero.base import ZeRO, ZeroUnit

__all__ = ["FullyShardedZeRO", "ShardedUnit", "UnitState"]


class UnitState(enum.Enum):
    """Where a stage-3 unit's full parameters are."""

    SHARDED = "sharded"        # only this rank's shard exists
    GATHERING = "gathering"    # a non-blocking all-gather into a full buffer is in flight
    UNSHARDED = "unsharded"    # the full parameters are in place: their data are views


class ShardedUnit(ZeroUnit):
    """A stage-3 unit: its shard, and the gathering and releasing of its full parameters.

    Attributes (besides :class:`ZeroUnit`'s):
        state: the :class:`UnitState`.
        compute_shard: what is all-gathered (the shard, or its 16-bit copy).
        full: the gathered flat buffer while unsharded, else ``None``.
    """

    def __init__(self, layout, dp, ledger, xp, reduce_dtype, compute_dtype, replicate=None,
                 scale: float = 1.0):
        super().__init__(layout, dp, ledger, xp, reduce_dtype, keep_full_grads=False,
                         replicate=replicate, scale=scale)
        self.compute_dtype = compute_dtype
        self.state = UnitState.SHARDED
        self.compute_shard = None
        self.full = None
        self._gather = None        # (handle, buffer) while GATHERING

    def _buffer(self):
        return self.ledger.empty("gathered", (self.layout.padded,), self.compute_dtype,
                                 f"gathered {self.label}", xp=self.xp)

    def prefetch(self) -> None:
        """Start gathering the full parameters without waiting (SHARDED -> GATHERING)."""
        if self.state is not UnitState.SHARDED:
            return
        buf = self._buffer()
        self._gather = (self.dp.iall_gather(self.compute_shard, buf), buf)
        self.state = UnitState.GATHERING

    def unshard(self) -> None:
        """Make the full parameters available, waiting for a prefetch if one is in flight."""
        if self.state is UnitState.UNSHARDED:
            return
        if self.state is UnitState.GATHERING:
            handle, buf = self._gather
            handle.wait()
            self._gather = None
        else:
            buf = self._buffer()
            self.dp.all_gather(self.compute_shard, buf)
        self.full = buf
        for p, view in zip(self.layout.params, self.layout.views(buf)):
            p.data = view
        self.state = UnitState.UNSHARDED

    def reshard(self) -> None:
        """Release the full parameters (UNSHARDED -> SHARDED; a no-op otherwise).

        The parameters keep empty arrays: see [Note: parameter storage].
        """
        if self.state is not UnitState.UNSHARDED:
            return
        for p in self.layout.params:
            p.data = self.xp.empty(0, dtype=self.compute_dtype)
        self.ledger.release(self.full)
        self.full = None
        self.state = UnitState.SHARDED

    def discard_prefetch(self) -> None:
        """Drop a gather in flight (GATHERING -> SHARDED): its values predate an update."""
        if self.state is not UnitState.GATHERING:
            return
        handle, buf = self._gather
        handle.wait()
        self.ledger.release(buf)
        self._gather = None
        self.state = UnitState.SHARDED


class FullyShardedZeRO(ZeRO):
    """ZeRO stage 3 (see the module docstring); build it as ``ZeRO(stage=3)``."""

    stages = (3,)

    def __init__(self, module, mesh, stage: int = 3, *args, **kwargs):
        super().__init__(module, mesh, stage, *args, **kwargs)
        self.blocks = [u for u in self.units if u.layout.module is not None]
        self.root = next((u for u in self.units if u.layout.module is None), None)
        # See [Note: prefetch order].
        self._order: list[int] = []
        self._last_order: list[int] = list(range(len(self.blocks)))
        for i, unit in enumerate(self.blocks):
            unit.layout.module.register_forward_pre_hook(lambda m, a, i=i: self._pre_forward(i))
            unit.layout.module.register_forward_hook(
                lambda m, a, out, i=i: self._post_forward(i, out))

    def _make_unit(self, layout) -> ShardedUnit:
        ledger, xp, cd = self.ledger, self.xp, self.compute_dtype
        dp, scale = self.unit_group(layout)
        unit = ShardedUnit(layout, dp, ledger, xp, self.reduce_dtype, cd, self.replicate, scale)
        shard = ledger.zeros("params", (layout.shard_size,), layout.dtype,
                             f"param shard {layout.label}", xp=xp)
        for i, p, value in self._initial_values(layout):
            p.data = xp.empty(0, dtype=cd)  # released; see [Note: parameter storage]
            offset, piece = layout.owned_piece(i, value)
            shard[offset:offset + piece.size] = piece
        unit.compute_shard = shard
        if self.mixed:
            unit.compute_shard = ledger.zeros("params", (layout.shard_size,), cd,
                                              f"{cd.name} param shard {layout.label}", xp=xp)
            unit.compute_shard[...] = shard
        unit.target = self.masters.add(shard, unit.compute_shard, layout.decay_ranges(),
                                       layout.label)
        unit.allocate_grads()
        return unit

    # [Note: prefetch order]
    # Units run in the order the model calls them, not necessarily the order
    # they were listed. Each forward records that order; the next forward
    # prefetches the unit that followed last time, and backward prefetches the
    # unit that preceded in this forward. A prefetch that is never consumed
    # would hold parameters from before the optimizer step, so reduce_grads()
    # discards every pending prefetch before the update.
    def _before_forward(self) -> None:
        super()._before_forward()
        if self._order:
            self._last_order, self._order = self._order, []
        if self.root is not None:
            self.root.unshard()

    @staticmethod
    def _neighbour(order: list, i: int, delta: int):
        if i not in order:
            return None
        k = order.index(i) + delta
        return order[k] if 0 <= k < len(order) else None

    def _prefetch(self, i) -> None:
        if i is not None and self.prefetch:
            self.blocks[i].prefetch()

    def _pre_forward(self, i: int) -> None:
        self._order.append(i)
        self.blocks[i].unshard()
        self._prefetch(self._neighbour(self._last_order, i, +1))

    def _post_forward(self, i: int, output) -> None:
        if self.reshard_after_forward:
            self.blocks[i].reshard()
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for out in outputs:
            if isinstance(out, Tensor) and out.requires_grad:
                out.register_grad_ready_hook(lambda t, i=i: self._pre_backward(i))

    def _pre_backward(self, i: int) -> None:
        self.blocks[i].unshard()
        self._prefetch(self._neighbour(self._order, i, -1))

    def _after_unit_backward(self, unit) -> None:
        if unit is not self.root:  # the root may serve more micro-batches' backward
            unit.reshard()

    def _after_reductions(self) -> None:
        for unit in self.blocks:
            unit.discard_prefetch()
        if self.root is not None:
            self.root.reshard()

    def after_update(self) -> None:
        """Bring the compute shards up to date with the updated (or loaded) masters.

        A forward without backward (evaluation) leaves the root, and with
        ``reshard_after_forward=False`` the blocks, gathered: drop those copies so
        the next forward gathers the new values.
        """
        for unit in self.blocks:
            unit.discard_prefetch()
        for unit in self.units:
            unit.reshard()
        self.masters.refresh()

"""ZeRO stage 3 (full sharding, as PyTorch FSDP): between steps a rank holds only shards.

    mpiexec -n 4 python -m mpi4py -m mpishard train --strategy zero3

Each unit is a :class:`ShardedUnit` that owns its whole life, as FSDP2's
parameter group does: the hooks on its module and parameters, the gathering
(and prefetching) and releasing of its full parameters, the reduce-scatter of
its gradients, and two explicit states. Where its parameters are
(:class:`ShardedState`)::

    SHARDED --prefetch()--> GATHERING --unshard()--> UNSHARDED --reshard()--> SHARDED
       \\________________________unshard()_______________/

and what its module is doing (:class:`TrainingState`, see [Note: unit training
state]). A block unit is all-gathered just before its forward (a forward
pre-hook), released after it (``reshard_after_forward``), gathered again when
backward reaches it (a grad-ready hook on its output) and released once its
gradients are reduce-scattered (``reshard_after_backward``); the unit that
runs next is gathered ahead, non-blocking (``prefetch``, see [Note: prefetch
order]). The root unit's module is the whole model: it is gathered for the
whole forward and backward of every micro-batch and released when the step's
gradients are reduced. With mixed precision the unit all-gathers a 16-bit copy
of its shard, cast once per step. Use ``ZeRO(module, mesh, stage=3)``; this
class is what that builds.

[Note: parameter offload]
With ``offload="params"`` (``--offload params``) what a unit all-gathers -- its
shard, or the shard's 16-bit copy -- lives in host memory too, beside the
float32 master and the optimizer state that ``offload="optimizer"`` already
keeps there (see [Note: optimizer offload] in mpishard/parallel/offload.py).
Gathering a unit (and prefetching it) first copies that shard into a device
buffer, which is released once the all-gather has finished; the host update
writes the new values straight into the host copy. Between a unit's uses the
device then holds none of its parameters: what stays is the gradient shard
(float32), and the gathered units while they compute.
"""
from __future__ import annotations

import enum

from mpishard.autodiff.tensor import Tensor
from mpishard.parallel.offload import copy_into, host_zeros
from mpishard.parallel.strategy import Sharded, register_strategy
from mpishard.parallel.zero.base import ZeroStrategy, ZeroUnit

__all__ = ["FullyShardedZeRO", "ShardedUnit", "ShardedState", "TrainingState", "ForwardOrder"]


class ShardedState(enum.Enum):
    """Where a stage-3 unit's full parameters are."""

    SHARDED = "sharded"        # only this rank's shard exists
    GATHERING = "gathering"    # a non-blocking all-gather into a full buffer is in flight
    UNSHARDED = "unsharded"    # the full parameters are in place: their data are views


class TrainingState(enum.Enum):
    """What a stage-3 unit's module is doing (see [Note: unit training state])."""

    IDLE = "idle"              # outside its forward and its backward
    FORWARD = "forward"        # between its module's forward pre-hook and post-hook
    BACKWARD = "backward"      # backward reached its output; not all its gradients are final


# [Note: unit training state]
# Each event of a unit's life may start only from some training states:
#
#   IDLE --pre_forward--> FORWARD --post_forward--> IDLE --pre_backward--> BACKWARD
#   BACKWARD --pre_backward--> BACKWARD     (its module ran twice in one forward)
#   BACKWARD --post_backward--> IDLE        (every gradient of the unit is final)
#
# and the end of a step (finish_step, after the reductions) returns every unit
# to IDLE, also one whose backward never reached all its parameters. An event
# from another state means the hooks and the model disagree (a module run
# inside its own forward, gradients without a backward through the unit's
# output): it raises, the same on every rank, instead of gathering or
# reducing at the wrong moment. The root unit is exempt: it stays gathered
# from its first forward to the end of the step, so no event of its can gather
# or release at the wrong moment, and under the interleaved pipeline schedule
# its module (all of the rank's model chunks) runs a chunk's forward while
# another chunk's backward is under way -- events from any state are right
# there.
_STARTS = {"pre_forward": (TrainingState.IDLE,),
           "post_forward": (TrainingState.FORWARD,),
           "pre_backward": (TrainingState.IDLE, TrainingState.BACKWARD),
           "post_backward": (TrainingState.BACKWARD,)}


class ForwardOrder:
    """The order units ran in, which prefetching follows (see [Note: prefetch order]).

    Attributes:
        current: the units this forward has run so far, in order.
        last: those of the forward before (until one has run: the units as listed).
    """

    def __init__(self):
        self.current: list = []
        self.last: list = []

    def add(self, unit) -> None:
        """List ``unit`` (units are added in the order they were listed)."""
        self.last.append(unit)

    def begin(self) -> None:
        """A forward of the model begins: the order recorded so far becomes the last one."""
        if self.current:
            self.last, self.current = self.current, []

    def ran(self, unit) -> None:
        self.current.append(unit)

    @staticmethod
    def _neighbour(order: list, unit, delta: int):
        if unit not in order:
            return None
        k = order.index(unit) + delta
        return order[k] if 0 <= k < len(order) else None

    def after(self, unit):
        """The unit that ran after ``unit`` in the last forward, or ``None``."""
        return self._neighbour(self.last, unit, +1)

    def before(self, unit):
        """The unit that ran before ``unit`` in this forward, or ``None``."""
        return self._neighbour(self.current, unit, -1)


# [Note: prefetch order]
# Units run in the order the model calls them, not necessarily the order
# they were listed. Each forward records that order; the next forward
# prefetches the unit that followed last time, and backward prefetches the
# unit that preceded in this forward. A prefetch that is never consumed
# would hold parameters from before the optimizer step, so every unit drops
# a pending prefetch when the step's reductions are done (finish_step).


class ShardedUnit(ZeroUnit):
    """A stage-3 unit: its shard, its hooks, and the gathering and releasing of its parameters.

    Args (besides :class:`ZeroUnit`'s):
        module: the module whose forward the unit wraps (the whole model for the root).
        order: the :class:`ForwardOrder` the unit records itself in and prefetches
            its neighbours by, or ``None`` (no prefetching, e.g. the root).
        reshard_after_forward: release the parameters after the module's forward.
        reshard_after_backward: release them once the unit's gradients are final;
            else (the root) when the step's gradients are reduced.

    Attributes (besides :class:`ZeroUnit`'s):
        state: the :class:`ShardedState`.
        training_state: the :class:`TrainingState`.
        compute_shard: what is all-gathered (the shard, or its 16-bit copy).
    """

    def __init__(self, layout, dp, context, module, scale: float = 1.0, order=None,
                 reshard_after_forward: bool = True, reshard_after_backward: bool = True):
        super().__init__(layout, dp, context, scale)
        self.compute_dtype = context.compute_dtype
        self.order = order
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = reshard_after_backward
        self.state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.compute_shard = None  # in host memory under parameter offload
        self.offloaded = False     # compute_shard is in host memory
        self._gather = None        # (handle, buffer, device copy of the shard) while GATHERING
        if order is not None:
            order.add(self)
        module.register_forward_pre_hook(lambda m, args: self.pre_forward())
        module.register_forward_hook(lambda m, args, out: self.post_forward(out))

    # -- the training state (see [Note: unit training state]) ------------------------
    def _begin(self, event: str, then: TrainingState) -> None:
        allowed = _STARTS[event]
        # the root (gathered until the step ends) takes events from any state
        if self.training_state not in allowed and self.reshard_after_backward:
            raise RuntimeError(
                f"ZeRO-3 unit {self.label!r}: {event} while {self.training_state.value}, "
                f"expected {' or '.join(s.value for s in allowed)}; call the unit's module "
                f"(module(...)) once per use, and let backward reach its output before its "
                f"gradients")
        self.training_state = then

    def pre_forward(self) -> None:
        """Before the module's forward: gather, and prefetch the unit that ran next last time."""
        self._begin("pre_forward", TrainingState.FORWARD)
        if self.order is not None:
            self.order.ran(self)
        self.unshard()
        if self.order is not None:
            self._prefetch(self.order.after(self))

    def post_forward(self, output) -> None:
        """After the module's forward: release (``reshard_after_forward``), and hook the
        outputs so backward gathers the unit again when it reaches them."""
        self._begin("post_forward", TrainingState.IDLE)
        if self.reshard_after_forward:
            self.reshard()
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for out in outputs:
            if isinstance(out, Tensor) and out.requires_grad:
                out.register_grad_ready_hook(lambda t: self.pre_backward())

    def pre_backward(self) -> None:
        """Backward reached the module's output: gather, and prefetch the unit before it."""
        self._begin("pre_backward", TrainingState.BACKWARD)
        self.unshard()
        if self.order is not None:
            self._prefetch(self.order.before(self))

    def post_backward(self) -> None:
        """Every gradient of the unit is final: reduce-scatter them (unless in ``no_sync``),
        then release the parameters (``reshard_after_backward``)."""
        self._begin("post_backward", TrainingState.IDLE)
        super().post_backward()
        if self.reshard_after_backward:
            self.reshard()

    def finish_step(self) -> None:
        """The step's reductions are done: drop a prefetch no forward used (see [Note:
        prefetch order]), release a unit kept through backward, hand the shard over."""
        self.discard_prefetch()
        if not self.reshard_after_backward:
            self.reshard()
        self.training_state = TrainingState.IDLE
        super().finish_step()

    # -- the parameters' storage -------------------------------------------------------
    def _buffer(self):
        return self.ledger.empty("gathered", (self.layout.padded,), self.compute_dtype,
                                 f"gathered {self.label}", xp=self.xp)

    @staticmethod
    def _prefetch(unit) -> None:
        if unit is not None:
            unit.prefetch()

    def _send_shard(self):
        """What the all-gather sends: the compute shard, or under parameter offload its
        copy on the device (see [Note: parameter offload])."""
        if not self.offloaded:
            return self.compute_shard
        shard = self.ledger.empty("comm", self.compute_shard.shape, self.compute_dtype,
                                  f"param shard {self.label} (from host)", xp=self.xp)
        copy_into(shard, self.compute_shard)
        return shard

    def _sent(self, shard) -> None:
        if shard is not self.compute_shard:
            self.ledger.release(shard)

    def prefetch(self) -> None:
        """Start gathering the full parameters without waiting (SHARDED -> GATHERING)."""
        if self.state is not ShardedState.SHARDED:
            return
        buf, shard = self._buffer(), self._send_shard()
        self._gather = (self.dp.iall_gather(shard, buf), buf, shard)
        self.state = ShardedState.GATHERING

    def unshard(self) -> None:
        """Make the full parameters available, waiting for a prefetch if one is in flight."""
        if self.state is ShardedState.UNSHARDED:
            return
        if self.state is ShardedState.GATHERING:
            handle, buf, shard = self._gather
            handle.wait()
            self._gather = None
        else:
            buf, shard = self._buffer(), self._send_shard()
            self.dp.all_gather(shard, buf)
        self._sent(shard)
        self.full = buf
        for p, view in zip(self.layout.params, self.layout.views(buf)):
            p.data = view
        self.state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Release the full parameters (UNSHARDED -> SHARDED; a no-op otherwise).

        The parameters keep empty arrays: see [Note: parameter storage].
        """
        if self.state is not ShardedState.UNSHARDED:
            return
        for p in self.layout.params:
            p.data = self.xp.empty(0, dtype=self.compute_dtype)
        self.ledger.release(self.full)
        self.full = None
        self.state = ShardedState.SHARDED

    def discard_prefetch(self) -> None:
        """Drop a gather in flight (GATHERING -> SHARDED): its values predate an update."""
        if self.state is not ShardedState.GATHERING:
            return
        handle, buf, shard = self._gather
        handle.wait()
        self.ledger.release(buf)
        self._sent(shard)
        self._gather = None
        self.state = ShardedState.SHARDED


@register_strategy("zero3", "ZeRO-3 / FSDP: parameters, gradients and optimizer state "
                   "sharded; units gathered around their forward and backward",
                   keeps_sharded=Sharded.PARAMETERS, stage=3)
class FullyShardedZeRO(ZeroStrategy):
    """ZeRO stage 3 (see the module docstring); build it as ``ZeRO(stage=3)``."""

    stages = (3,)
    #: takes ``offload="params"`` (see [Note: parameter offload])
    offloads_params = True

    def __init__(self, module, mesh, stage: int = 3, units=None, root_unit: bool = True,
                 reshard_after_forward: bool = True, prefetch: bool = True, seed=None,
                 ledger=None, precision=None, offload=None):
        # read by _make_unit while the base class builds the units
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.order = ForwardOrder()
        super().__init__(module, mesh, stage, units, root_unit, seed, ledger, precision,
                         offload)

    def _make_unit(self, layout) -> ShardedUnit:
        ledger, xp, cd = self.ledger, self.xp, self.compute_dtype
        dp, scale = self.unit_group(layout)
        if layout.module is not None:
            unit = ShardedUnit(layout, dp, self.context, layout.module, scale,
                               self.order if self.prefetch else None, self.reshard_after_forward)
        else:   # the root: gathered through every micro-batch's backward
            unit = ShardedUnit(layout, dp, self.context, self.module, scale,
                               reshard_after_forward=False, reshard_after_backward=False)
        # the master; in host memory when offloaded, unless it is also what is gathered
        # and only the optimizer is offloaded
        offloaded = self.offload == "params"
        shard = self._new_master(layout) if self.mixed or offloaded else ledger.zeros(
            "params", (layout.shard_size,), layout.dtype, f"param shard {layout.label}", xp=xp)
        for i, p, value in self._initial_values(layout):
            p.data = xp.empty(0, dtype=cd)  # released; see [Note: parameter storage]
            offset, piece = layout.owned_piece(i, value)
            copy_into(shard[offset:offset + piece.size], piece)
        unit.compute_shard = shard
        unit.offloaded = offloaded
        if self.mixed:
            name = f"{cd.name} param shard {layout.label}"
            unit.compute_shard = host_zeros(ledger, "params", layout.shard_size, cd, name, xp) \
                if unit.offloaded else ledger.zeros("params", (layout.shard_size,), cd, name,
                                                    xp=xp)
            copy_into(unit.compute_shard, shard)
        unit.target = self.masters.add(shard, unit.compute_shard, layout.decay_ranges(),
                                       layout.label)
        unit.allocate_grads(self.host_grad_shard(unit))
        return unit

    def _before_forward(self) -> None:
        """Finish the reductions in flight, and begin recording this forward's unit order
        (the root unit's own hook then gathers it)."""
        super()._before_forward()
        self.order.begin()

    def after_update(self) -> None:
        """Bring the compute shards up to date with the updated (or loaded) masters.

        A forward without backward (evaluation) leaves the root, and with
        ``reshard_after_forward=False`` the blocks, gathered: drop those copies so
        the next forward gathers the new values.
        """
        for unit in self.units:
            unit.discard_prefetch()
            unit.reshard()
        self.masters.refresh()

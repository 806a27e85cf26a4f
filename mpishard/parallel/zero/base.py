"""What every ZeRO stage shares: units of sharded state, their reductions, the strategy's half.

    mpiexec -n 4 python -m mpi4py -m mpishard train --strategy zero3

Parameters are grouped into units (the model plan's units, e.g. a GPT block
each, plus the root remainder: embeddings and the final norm), each laid out as
one padded flat buffer (see [Note: flat unit layout] in units.py). Each dp rank
owns one contiguous slice of every unit.

| stage | kept whole on every rank | kept as this rank's shard |
|---|---|---|
| 1 | parameters, gradients | optimizer state |
| 2 | parameters | gradients, optimizer state |
| 3 | (a unit's parameters while it computes) | parameters, gradients, optimizer state |

``ZeRO(module, mesh, stage=k)`` (in zero/__init__.py) builds the class
registered as ``zero{k}``: stages 1 and 2 in stage12.py
(:class:`~mpishard.parallel.zero.stage12.ShardedStateZeRO`), stage 3 in
stage3.py (:class:`~mpishard.parallel.zero.stage3.FullyShardedZeRO`), both
subclasses of :class:`ZeroStrategy`. What they share is here: each unit is a
:class:`ZeroUnit` holding its master shard (the optimizer's target, a
:class:`FlatShard`) and gradient shard, and reduce-scattering (averaging) its
own gradients as soon as backward has finished them (its parameters'
grad-ready hooks), non-blocking, with at most ``max_inflight_reductions`` in
flight (a :class:`~mpishard.parallel.zero.reduction.ReductionQueue` the units
share). See ZeRO (Rajbhandari et al., 2020, arXiv:1910.02054).

With mixed precision (see [Note: mixed precision] in precision.py) the shard is
the float32 master and the model computes with a 16-bit copy
(:class:`MasterCopies`); gradients are flattened into ``reduce_dtype``
buffers before the reduce-scatter. With ``offload="optimizer"`` the masters and
their optimizer state live in host memory (:class:`~mpishard.parallel.offload.
HostMasters`, see [Note: optimizer offload] in offload.py): each unit's reduced
gradient shard is copied to the host, the host updates the master, and the
compute shard on the device is refreshed from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mpishard.nn.init import seed_dropout
from mpishard.nn.parameter import init_array
from mpishard.nn.sharding import plan_of
from mpishard.optim.clip import grad_sq_sum
from mpishard.optim.optimizers import Targets
from mpishard.parallel.flat import stage_grad
from mpishard.parallel.offload import HostMasters, check_offload, copy_into, host_zeros
from mpishard.parallel.pieces import unit_pieces
from mpishard.parallel.precision import MasterCopies
from mpishard.parallel.replicas import check_replicas_equal, is_expert_param
from mpishard.parallel.strategy import Strategy
from mpishard.parallel.zero.reduction import Reduction, ReductionQueue
from mpishard.parallel.zero.units import FlatUnit, build_units, expert_units

__all__ = ["ZeroStrategy", "ZeroUnit", "UnitContext"]


@dataclass(frozen=True)
class UnitContext:
    """What every unit of one ZeRO strategy shares.

    Attributes:
        ledger, xp: where buffers are counted and allocated.
        reduce_dtype: dtype gradients are averaged in.
        compute_dtype: dtype the model computes in (what stage 3 gathers).
        replicate: the replicas of the shards (hybrid sharding), or ``None``.
        reduction_queue: the reduce-scatters in flight, bounded.
        syncing: whether this backward communicates (the strategy's
            ``sync_gradients``; ``False`` inside ``no_sync``).
    """

    ledger: object
    xp: object
    reduce_dtype: object
    compute_dtype: object
    replicate: object
    reduction_queue: ReductionQueue
    syncing: Callable[[], bool]


class ZeroUnit:
    """One unit's sharded state and the reduce-scatter of its gradients, what every stage has.

    The unit hooks its parameters' grad-ready: once backward has made all of them
    final it reduce-scatters them (:meth:`post_backward`), unless the strategy is
    inside ``no_sync``.

    Args:
        layout: the unit's :class:`FlatUnit` (which parameters, where).
        dp: the communicator the unit shards over.
        context: the :class:`UnitContext` of the strategy's units.
        scale: multiplies the averaged gradients (``1 / ep`` for an expert unit).
        keep_full_grads: hold the whole unit's gradients (stage 1).

    Attributes:
        target: the :class:`FlatShard` the optimizer updates (set by the stage).
        full: the unit's whole flat parameters where this rank holds them (stages 1
            and 2 always, stage 3 while unsharded), else ``None``.
        grad_shard: this rank's averaged gradient slice (at stage 1 made at the step,
            see [Note: stage 1's gradient shard]).
        grad_full: the full flat gradients (stage 1 only, else ``None``).
        shard_at_step: stage 1 (not aliased, not offloaded): the reduced slice waits in
            this rank's block of ``grad_full``, and ``grad_shard`` exists from the step
            to :meth:`release_step_shard` only.
        aliased: stage 1 on one rank, gradients reduced in the shard's dtype: the
            shard *is* the full gradient buffer (no second copy, nothing to send).
        ready: parameters whose gradient is final so far in this backward.
        reductions: reduce-scatters launched this step.
        grads_reduced: this step's gradients are in ``target.grad`` (no gradient
            arrived since :meth:`finish_step`).
    """

    def __init__(self, layout: FlatUnit, dp, context: UnitContext, scale: float = 1.0,
                 keep_full_grads: bool = False):
        self.layout, self.dp, self.context = layout, dp, context
        self.ledger, self.xp = context.ledger, context.xp
        self.scale = scale   # times the average: 1 / ep for experts split over ep
        #: the replicas of this shard (hybrid sharding), or None
        replicate = context.replicate
        self.replicate = replicate if replicate is not None and replicate.size > 1 else None
        self.reduce_dtype = context.reduce_dtype
        self.keep_full_grads = keep_full_grads
        self.target = self.full = None
        self.grad_shard = self.grad_full = None
        self.grad_views: list = []      # stage 1: the parameters' views of grad_full
        self.aliased = False
        self.shard_at_step = False
        self._waiting = False     # a reduced slice in grad_full's block, not in the shard
        self._summed = False      # the shard holds this step's earlier reductions
        self._owned = False       # the shard is an array of its own (else grad_full's block)
        self.ready = 0
        self.reductions = 0
        self.grads_reduced = False
        for p in layout.params:
            p.register_grad_ready_hook(self._on_grad_ready)

    @property
    def label(self) -> str:
        return self.layout.label

    def allocate_grads(self, host_shard=None) -> None:
        """The gradient shard (and, at stage 1, the full gradient buffer). ``host_shard``:
        under offload, the host gradient buffer of the unit's master, which then is the
        shard itself (see [Note: optimizer offload] in mpishard/parallel/offload.py)."""
        layout = self.layout
        if self.keep_full_grads:
            self.grad_full = self.ledger.zeros("grads", (layout.padded,), self.reduce_dtype,
                                               f"grads {layout.label}", xp=self.xp)
            self.grad_views = layout.views(self.grad_full)
            for p, view in zip(layout.params, self.grad_views):
                p.grad_out = view   # backward writes the gradient there (see [Note:
                # gradient buffers] in mpishard/autodiff/tensor.py)
            if self.dp.size == 1 and self.replicate is None and self.scale == 1.0 and \
                    self.reduce_dtype == layout.dtype:
                self.grad_shard, self.aliased = self.grad_full, True
                return
        if host_shard is not None:
            self.grad_shard = host_shard
            return
        if self.keep_full_grads:
            self.shard_at_step = True   # see [Note: stage 1's gradient shard]
            return
        self.grad_shard = self.ledger.zeros("grads", (layout.shard_size,), layout.dtype,
                                            f"grad shard {layout.label}", xp=self.xp)

    def _on_grad_ready(self, p) -> None:
        """A parameter's gradient is final: once all of the unit's are, :meth:`post_backward`."""
        self.grads_reduced = False
        self.ready += 1
        if self.ready < len(self.layout.params):
            return
        self.ready = 0
        self.post_backward()

    def post_backward(self) -> None:
        """Backward has finished the unit's gradients: reduce-scatter them (not in ``no_sync``)."""
        if self.context.syncing():
            self.context.reduction_queue.add(self.reduce_scatter())

    def reduce_scatter(self) -> Reduction:
        """Flatten the unit's gradients and start averaging them into this rank's slice."""
        layout, rd = self.layout, self.reduce_dtype
        if self.grad_full is not None:  # stage 1 keeps full gradients
            flat = self.grad_full
        else:
            flat = self.ledger.empty("comm", (layout.padded,), rd,
                                     f"grad bucket {layout.label}", xp=self.xp)
        if self.grad_full is not None:  # stage 1: into the views (padding: zero since made)
            for p, view in zip(layout.params, self.grad_views):
                stage_grad(p, view)
        else:
            layout.flatten([p.grad for p in layout.params], flat)
            for p in layout.params:
                p.grad = None
        first = self.reductions == 0
        if first and self.shard_at_step:
            self.release_step_shard()   # one from an earlier step (no zero_grad since)
        if self.aliased:  # the full buffer is the shard: nothing to reduce or send
            self.reductions += 1
            return Reduction(self, None, flat, self.grad_shard, first)
        if first and not self.shard_at_step and rd == self.grad_shard.dtype and \
                not self.ledger.on_host(self.grad_shard):
            recv = self.grad_shard
        else:
            recv = self.ledger.empty("comm", (layout.shard_size,), rd,
                                     f"grad shard {layout.label} (received)", xp=self.xp)
        self.reductions += 1
        return Reduction(self, self.dp.ireduce_scatter(flat, recv, op="avg"), flat, recv, first)

    def reduce_rest(self) -> None:
        """At the end of a step: reduce-scatter now if backward did not (``no_sync``, or a
        gradient that never arrived); a count of ready gradients starts again."""
        self.ready = 0
        if self.reductions == 0:
            self.context.reduction_queue.add(self.reduce_scatter())

    def finish_step(self) -> None:
        """All of this step's reductions are done: hand the shard to the optimizer."""
        self.ready = 0
        self.reductions = 0
        if self.shard_at_step:
            block = self._block()
            if self.grad_shard is None and block.dtype == self.layout.dtype:
                self.grad_shard, self._waiting = block, False   # the block itself
            else:
                self.settle()
        self.target.grad = self.grad_shard
        self.grads_reduced = True

    # [Note: stage 1's gradient shard]
    # Stage 1 keeps every gradient whole (``grad_full``, in reduce_dtype) and reduces
    # once per step where the loop accumulates under ``no_sync`` (as ``mpishard
    # train`` and the pipeline schedules do). The reduced slice then lands back in
    # this rank's own block of ``grad_full``, whose local values the reduce-scatter
    # has consumed, and the optimizer's gradient shard is made at the step: that
    # block itself when reduce_dtype is the masters' dtype, else a cast copy (the
    # float32 shard of bfloat16 gradients), released by ``zero_grad``. So between
    # steps, and under the activations of forward and backward, the rank keeps the
    # gradients once, as Megatron-LM's distributed optimizer does (its float32
    # gradient shard is made from the bfloat16 buffer at the step); the plan counts
    # the copy in ``at_step`` (planning/model_state.py). A loop that reduces on
    # every micro-step (no ``no_sync``) zeroes ``grad_full`` before the next
    # forward, so the slice moves into a shard made then, and later reductions add
    # to it: the same sums, in the same dtype and order, as a shard kept always (that
    # shard then lives under the later micro-batches' activations, which the plan,
    # reading ``no_sync`` loops, does not count). The parameters' gradients are views
    # of ``grad_full``: between the reduction and the step, this rank's block of them
    # holds the averaged slice the optimizer reads, so scale or clip through the
    # strategy (``step(max_norm=...)``), not through the module's parameters.

    def _block(self):
        return self.grad_full[self.layout.shard_start:self.layout.shard_stop]

    def keep_reduced(self, recv, first: bool) -> None:
        """Stage 1: a reduction's averaged slice, into this rank's block of ``grad_full``."""
        if first:
            self._summed = False
        self._block()[...] = recv
        self._waiting = True

    def settle(self) -> None:
        """Stage 1: move a reduced slice waiting in ``grad_full`` into the gradient shard
        (made now if there is none), before ``grad_full`` is cleared or at the step."""
        if not self._waiting:
            return
        block = self._block()
        if self.grad_shard is None:
            self.grad_shard = self.ledger.empty("grads", (self.layout.shard_size,),
                                                self.layout.dtype,
                                                f"grad shard {self.layout.label} (at the step)",
                                                xp=self.xp)
            self._owned = True
        if self._summed:
            self.grad_shard += block
        else:
            copy_into(self.grad_shard, block)
        self._waiting, self._summed = False, True

    def release_step_shard(self) -> None:
        """Stage 1, after the step: let the gradient shard go (a view of ``grad_full``,
        or the copy :meth:`settle` made)."""
        if self._owned:
            self.ledger.release(self.grad_shard)
        if self.shard_at_step:
            self.grad_shard = None
        self._waiting = self._summed = self._owned = False


class ZeroStrategy(Strategy):
    """The half of ZeRO every stage shares (see the module docstring); build one with
    ``ZeRO(module, mesh, stage=k)``, whose arguments these are."""

    #: reduce-scatters in flight before backward waits for the oldest
    max_inflight_reductions = 2
    materializes_shards = True
    #: the stages a subclass implements (its registered names give it one of them)
    stages: tuple = ()
    #: takes ``offload="optimizer"`` (see [Note: optimizer offload] in offload.py)
    offloads_optimizer = True

    def __init__(self, module, mesh, stage: int, units=None, root_unit: bool = True, seed=None,
                 ledger=None, precision=None, offload=None):
        if stage not in type(self).stages:
            raise ValueError(f"{type(self).__name__} implements ZeRO stages {type(self).stages}, "
                             f"not {stage!r}; build it as ZeRO(module, mesh, stage={stage!r})")
        self.offload = check_offload(offload, type(self))
        super().__init__(module, mesh, ledger, precision, seed)
        # shards live on dp_shard x cp and are replicated over dp_replicate (hybrid
        # sharding, see [Note: mesh layout]); without those axes both are plain dp
        self.dp = getattr(mesh, "dp_shard_cp", self.dp)
        self.replicate = getattr(mesh, "dp_replicate", None)
        self.stage = stage
        names = list(units) if units is not None else list(plan_of(module).units)
        edp = getattr(mesh, "edp_shard", self.dp)
        names, experts = expert_units(module, names)
        ep = getattr(mesh, "ep", None)
        self._unit_groups = {name: (edp, 1.0 / ep.size) for name in experts}
        layouts = build_units(module, names, self.dp.size, self.dp.rank, root_unit,
                             groups={n: (edp.size, edp.rank) for n in experts})
        if any(p.data is not None for p in module.parameters()):   # each rank shards its own
            fix = "as ZeRO takes each rank's slice of its own values"
            check_replicas_equal(module, self.dp, select=lambda p: not is_expert_param(p),
                                 fix=fix)
            check_replicas_equal(module, edp, select=is_expert_param, fix=fix)
            if self.replicate is not None:      # hybrid sharding: the replicas' shards too
                check_replicas_equal(module, self.replicate, fix=fix)
        deferred = any(p.data is None for p in module.parameters())
        # before the units' own hooks: a forward first finishes the reductions in flight
        module.register_forward_pre_hook(lambda m, a: self._before_forward())
        self.reduction_queue = ReductionQueue(self.ledger, self.max_inflight_reductions)
        self.context = UnitContext(self.ledger, self.xp, self.reduce_dtype, self.compute_dtype,
                                   self.replicate, self.reduction_queue,
                                   syncing=lambda: self.sync_gradients)
        self.masters = HostMasters(self.ledger, self.xp) if self.offload else MasterCopies()
        self.units = [self._make_unit(layout) for layout in layouts]
        if deferred:  # what materialize() does besides parameters: dropout generators
            seed_dropout(module, self.seed, getattr(module, "backend", None))

    def host_grad_shard(self, unit):
        """Under offload the host buffer a unit's reduced gradients land in (its master's
        host gradient buffer), else ``None``: the shard then lives on the device."""
        return self.masters.host_grads[id(unit.target)] if self.offload else None

    def unit_group(self, layout: FlatUnit) -> tuple:
        """``(shard communicator, scale)`` of a unit: ``(dp_shard x cp, 1)``, or for the
        experts split over ep ``(edp_shard, 1 / ep)`` (see parallel/expert/layers.py)."""
        return self._unit_groups.get(layout.name, (self.dp, 1.0))

    def _make_unit(self, layout: FlatUnit) -> ZeroUnit:
        """Build a unit's buffers and move its parameters' values into them (each stage's)."""
        raise NotImplementedError

    def _new_master(self, layout: FlatUnit):
        """A zeroed master for the unit's shard, in the model's dtype: in host memory when
        the optimizer is offloaded (fill it with :func:`~mpishard.parallel.offload.copy_into`)."""
        if self.offload:
            return host_zeros(self.ledger, "params", layout.shard_size, layout.dtype,
                              f"host master {layout.label}", self.xp)
        return self.ledger.zeros("params", (layout.shard_size,), layout.dtype,
                                 f"param shard {layout.label}", xp=self.xp)

    def _initial_values(self, layout: FlatUnit):
        """``(index, parameter, value)`` per parameter of the unit, one at a time: its
        data (released from the ledger), or drawn from (seed, name) when deferred."""
        for i, (name, p) in enumerate(zip(layout.names, layout.params)):
            if p.data is not None:
                value = p.data
                self.ledger.release(p.data)
            else:
                full = init_array(p.init, p.spec.global_shape, self.seed, name)
                value = self.xp.asarray(p.spec.local_slice_of(full).astype(layout.dtype))
            yield i, p, value

    def parameters(self) -> list:
        """This rank's flat shards, one per unit: hand these to the optimizer."""
        return Targets([unit.target for unit in self.units], self)

    def describe(self) -> dict:
        return {"name": "ZeRO", "stage": self.stage}

    def pieces(self, optimizer=None) -> list:
        return unit_pieces(self, self.units, optimizer)

    def _before_forward(self) -> None:
        """Before a forward: finish the reduce-scatters an earlier backward of this
        step started, so the next backward never writes into a buffer MPI still reads."""
        self.reduction_queue.finish()

    def reduce_grads(self) -> None:
        """Reduce-scatter what backward did not (in unit order), wait for everything,
        hand every shard its gradient (offloaded: a copy in host memory, unit by unit).

        Idempotent until the next backward: a second call changes nothing.
        """
        if all(unit.grads_reduced for unit in self.units):
            return
        for unit in self.units:
            unit.reduce_rest()
        self.reduction_queue.finish()
        for unit in self.units:
            unit.finish_step()
            if self.offload:     # the host shard itself, unless aliased (stage 1, one rank)
                self.masters.grad_to_host(unit.target, unit.grad_shard)

    def zero_grad(self) -> None:
        """Drop this step's gradients, also those a backward reduced, or is reducing,
        with no step since (a backward the loop throws away): its reductions finish
        and count for nothing, and the next backward's reductions start the sums
        again. After a step there is nothing in flight and this only lets go."""
        super().zero_grad()
        self.reduction_queue.finish()
        for unit in self.units:
            if unit.reductions and unit.grad_full is not None and not unit.aliased:
                unit.grad_full[...] = 0    # stage 1: what the thrown backward left there
            unit.reductions = unit.ready = 0
            unit.grads_reduced = False
            unit.release_step_shard()

    def local_grad_sq(self) -> float:
        """Sum of squares of this rank's gradient shards, each element counted once overall."""
        if self.replicate is not None and self.replicate.rank != 0:
            return 0.0   # the replicas hold the same shards: counted on replica 0
        pieces = []
        for unit in self.units:
            # the device's shard, also when offloaded: the same sum, on the device
            g = unit.grad_shard if unit.target.grad is not None else None
            layout = unit.layout
            if g is None:
                continue
            if all(self.counts_once(p.spec) for p in layout.params):
                pieces.append(g)
                continue
            for i, p in enumerate(layout.params):
                if self.counts_once(p.spec):
                    lo, hi = layout.shard_range_of(i)
                    pieces.append(g[lo:hi])
        return grad_sq_sum(pieces)

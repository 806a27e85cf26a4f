"""ZeRO stages 1, 2 and 3 (stage 3 is full sharding, as in FSDP): one entry, ``ZeRO(stage=...)``.

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

``ZeRO(module, mesh, stage=k)`` builds the stage's class: stages 1 and 2 in
zero_stage12.py (:class:`~mpishard.parallel.zero.stage12.ShardedStateZeRO`),
stage 3 in zero_stage3.py (:class:`~mpishard.parallel.zero.stage3.FullyShardedZeRO`),
both subclasses of :class:`ZeRO`. What they share is here: each unit is a
:class:`ZeroUnit` holding its master shard (the optimizer's target, a
:class:`FlatShard`) and gradient shard, and reduce-scattering (averaging) its
own gradients as soon as backward has finished it (grad-ready hooks),
non-blocking, with at most ``max_inflight_reductions`` in flight. See ZeRO
(Rajbhandari et al., 2020, arXiv:1910.02054).

With mixed precision (see [Note: mixed precision] in precision.py) the shard is
the float32 master and the model computes with a 16-bit copy
(:class:`MasterCopies`); gradients are flattened into ``reduce_dtype``
buffers before the reduce-scatter.
"""
from __future__ import annotations

from mpishard.nn.init import seed_dropout
from mpishard.nn.parameter import init_array
from mpishard.nn.sharding import plan_of
from mpishard.optim.clip import grad_sq_sum
from mpishard.parallel.flat import stage_grad
from mpishard.parallel.pieces import unit_pieces
from mpishard.parallel.precision import MasterCopies
from mpishard.parallel.replicas import check_replicas_equal, is_expert_param
from mpishard.parallel.strategy import Strategy, register_strategy
from mpishard.parallel.zero.units import FlatUnit, build_units, expert_units

__all__ = ["ZeRO", "ZeroUnit", "build_units"]


class Reduction:
    """One unit's reduce-scatter in flight: its handle and the buffers it holds."""

    __slots__ = ("unit", "handle", "flat", "recv", "first")

    def __init__(self, unit, handle, flat, recv, first: bool):
        self.unit, self.handle, self.flat, self.recv, self.first = unit, handle, flat, recv, first

    def finish(self, ledger) -> None:
        """Wait; add (or, for the step's first, cast) the received slice into the
        gradient shard; release the buffers that were only for this reduction."""
        if self.handle is not None:  # None: nothing to send (see ZeroUnit.aliased)
            self.handle.wait()
        unit = self.unit
        if unit.replicate is not None:  # hybrid sharding: then average across replicas
            unit.replicate.all_reduce(self.recv, op="avg")
        if unit.scale != 1.0:           # expert gradients: 1 / ep (see expert_parallel.py)
            self.recv *= unit.scale
        if self.recv is not unit.grad_shard:
            if self.first:  # reduced in another dtype: cast into the shard
                unit.grad_shard[...] = self.recv
            else:
                unit.grad_shard += self.recv
            ledger.release(self.recv)
        if self.flat is not unit.grad_full:
            ledger.release(self.flat)


class ZeroUnit:
    """One unit's sharded state, the part every stage has: master and gradient shards.

    Args:
        layout: the unit's :class:`FlatUnit` (which parameters, where).
        dp: the data-parallel communicator.
        ledger, xp: where buffers are counted and allocated.
        reduce_dtype: dtype gradients are averaged in.
        keep_full_grads: hold the whole unit's gradients (stage 1).
        replicate: the replicas of the shards (hybrid sharding), or ``None``.
        scale: multiplies the averaged gradients (``1 / ep`` for an expert unit).

    Attributes:
        target: the :class:`FlatShard` the optimizer updates (set by the stage).
        grad_shard: this rank's averaged gradient slice.
        grad_full: the full flat gradients (stage 1 only, else ``None``).
        aliased: stage 1 on one rank, gradients reduced in the shard's dtype: the
            shard *is* the full gradient buffer (no second copy, nothing to send).
        ready: parameters whose gradient is final so far in this backward.
        reductions: reduce-scatters launched this step.
    """

    def __init__(self, layout: FlatUnit, dp, ledger, xp, reduce_dtype, keep_full_grads: bool,
                 replicate=None, scale: float = 1.0):
        self.layout, self.dp, self.ledger, self.xp = layout, dp, ledger, xp
        self.scale = scale   # times the average: 1 / ep for experts split over ep
        #: the replicas of this shard (hybrid sharding), or None
        self.replicate = replicate if replicate is not None and replicate.size > 1 else None
        self.reduce_dtype = reduce_dtype
        self.keep_full_grads = keep_full_grads
        self.target = None
        self.grad_shard = self.grad_full = None
        self.grad_views: list = []      # stage 1: the parameters' views of grad_full
        self.aliased = False
        self.ready = 0
        self.reductions = 0

    @property
    def label(self) -> str:
        return self.layout.label

    def allocate_grads(self) -> None:
        """The gradient shard (and, at stage 1, the full gradient buffer)."""
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
        self.grad_shard = self.ledger.zeros("grads", (layout.shard_size,), layout.dtype,
                                            f"grad shard {layout.label}", xp=self.xp)

    def grad_ready(self) -> bool:
        """Count one parameter's gradient as final; ``True`` once all of the unit's are."""
        self.ready += 1
        if self.ready < len(self.layout.params):
            return False
        self.ready = 0
        return True

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
        if self.aliased:  # the full buffer is the shard: nothing to reduce or send
            self.reductions += 1
            return Reduction(self, None, flat, self.grad_shard, first)
        if first and rd == self.grad_shard.dtype:
            recv = self.grad_shard
        else:
            recv = self.ledger.empty("comm", (layout.shard_size,), rd,
                                     f"grad shard {layout.label} (received)", xp=self.xp)
        self.reductions += 1
        return Reduction(self, self.dp.ireduce_scatter(flat, recv, op="avg"), flat, recv, first)

    def finish_step(self) -> None:
        """All of this step's reductions are done: hand the shard to the optimizer."""
        self.ready = 0
        self.reductions = 0
        self.target.grad = self.grad_shard


@register_strategy("zero3", "ZeRO-3 / FSDP: parameters, gradients and optimizer state "
                   "sharded; units gathered around their forward and backward", stage=3)
@register_strategy("zero2", "ZeRO-2: gradients and optimizer state sharded, parameters "
                   "whole", stage=2)
@register_strategy("zero1", "ZeRO-1: optimizer state sharded, parameters and gradients "
                   "whole", stage=1)
class ZeRO(Strategy):
    """Shard optimizer state (stage 1), + gradients (2), + parameters (3) over ``mesh.dp``.

    Args:
        module: the model; under stage 3 build it with ``materialize_now=False``
            so no rank ever holds it whole (parameters are materialised one
            tensor at a time, from seed and name, straight into shards).
        mesh: a :class:`mpishard.comm.Mesh`.
        stage: 1, 2 or 3.
        units: module names that form units (default: the model plan's units).
        root_unit: put parameters of no unit into a root unit (default True).
        reshard_after_forward: stage 3: release a unit after its forward.
        prefetch: stage 3: gather the next unit ahead, non-blocking.
        seed: initialisation seed (default: ``module.seed``).
        precision: ``"float32"`` (default), ``"float16"``, ``"bfloat16"`` or a
            :class:`~mpishard.parallel.Precision`.
    """

    #: reduce-scatters in flight before backward waits for the oldest
    max_inflight_reductions = 2
    materializes_shards = True
    #: the stages a subclass implements; ``ZeRO(stage=k)`` builds the one listing k
    stages: tuple = ()
    _by_stage: dict = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for stage in cls.stages:
            ZeRO._by_stage[stage] = cls

    def __new__(cls, module, mesh, stage: int = 3, units=None, root_unit: bool = True,
                reshard_after_forward: bool = True, prefetch: bool = True, seed=None,
                ledger=None, precision=None):
        if cls is ZeRO:  # the public entry: the class of this stage (zero_stage12/3.py)
            if stage not in (1, 2, 3):
                raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r}")
            cls = ZeRO._by_stage[stage]
        return super().__new__(cls)

    def __init__(self, module, mesh, stage: int = 3, units=None, root_unit: bool = True,
                 reshard_after_forward: bool = True, prefetch: bool = True, seed=None,
                 ledger=None, precision=None):
        if stage not in type(self).stages:
            raise ValueError(f"{type(self).__name__} implements ZeRO stages {type(self).stages}, "
                             f"not {stage!r}; build it as ZeRO(module, mesh, stage={stage!r})")
        super().__init__(module, mesh, ledger, precision, seed)
        # shards live on dp_shard x cp and are replicated over dp_replicate (hybrid
        # sharding, see [Note: mesh layout]); without those axes both are plain dp
        self.dp = getattr(mesh, "dp_shard_cp", self.dp)
        self.replicate = getattr(mesh, "dp_replicate", None)
        self.stage = stage
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        names = list(units) if units is not None else list(plan_of(module).units)
        edp = getattr(mesh, "edp_shard", self.dp)
        names, experts = expert_units(module, names)
        ep = getattr(mesh, "ep", None)
        self._unit_groups = {name: (edp, 1.0 / ep.size) for name in experts}
        layouts = build_units(module, names, self.dp.size, self.dp.rank, root_unit,
                             groups={n: (edp.size, edp.rank) for n in experts})
        if any(p.data is not None for p in module.parameters()):
            check_replicas_equal(module, self.dp, select=lambda p: not is_expert_param(p))
            check_replicas_equal(module, edp, select=is_expert_param)
        deferred = any(p.data is None for p in module.parameters())
        self._pending: list[Reduction] = []
        self._grads_reduced = False
        self.masters = MasterCopies()
        self.units = [self._make_unit(layout) for layout in layouts]
        for unit in self.units:
            for p in unit.layout.params:
                p.register_grad_ready_hook(lambda p, unit=unit: self._on_grad_ready(unit))
        if deferred:  # what materialize() does besides parameters: dropout generators
            seed_dropout(module, self.seed, getattr(module, "backend", None))
        module.register_forward_pre_hook(lambda m, a: self._before_forward())

    def unit_group(self, layout: FlatUnit) -> tuple:
        """``(shard communicator, scale)`` of a unit: ``(dp_shard x cp, 1)``, or for the
        experts split over ep ``(edp_shard, 1 / ep)`` (see expert_parallel.py)."""
        return self._unit_groups.get(layout.name, (self.dp, 1.0))

    # -- what each stage defines ----------------------------------------------
    def _make_unit(self, layout: FlatUnit) -> ZeroUnit:
        """Build a unit's buffers and move its parameters' values into them."""
        raise NotImplementedError

    def _after_unit_backward(self, unit: ZeroUnit) -> None:
        """Runs when backward has finished a unit (stage 3 releases it)."""

    def _after_reductions(self) -> None:
        """Runs in :meth:`reduce_grads` after the last reduction (stage 3 cleans up)."""

    # -- shared ---------------------------------------------------------------
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
        return [unit.target for unit in self.units]

    def describe(self) -> dict:
        return {"name": "ZeRO", "stage": self.stage}

    def pieces(self, optimizer=None) -> list:
        return unit_pieces(self, self.units, optimizer)

    def _before_forward(self) -> None:
        """Before a forward: finish the reduce-scatters an earlier backward of this
        step started, so the next backward never writes into a buffer MPI still reads."""
        while self._pending:
            self._pending.pop(0).finish(self.ledger)

    def _on_grad_ready(self, unit: ZeroUnit) -> None:
        self._grads_reduced = False
        if not unit.grad_ready():
            return
        if self.sync_gradients:
            self._launch(unit)
        self._after_unit_backward(unit)

    def _launch(self, unit: ZeroUnit) -> None:
        self._pending.append(unit.reduce_scatter())
        # Bound the full-size gradient buffers alive at once (stage 2/3 memory).
        while len(self._pending) > self.max_inflight_reductions:
            self._pending.pop(0).finish(self.ledger)

    def reduce_grads(self) -> None:
        """Reduce-scatter what backward did not (in unit order), wait for everything.

        Idempotent until the next backward: a second call changes nothing.
        """
        if self._grads_reduced:
            return
        for unit in self.units:
            unit.ready = 0
            if unit.reductions == 0:
                self._launch(unit)
        while self._pending:
            self._pending.pop(0).finish(self.ledger)
        self._after_reductions()
        for unit in self.units:
            unit.finish_step()
        self._grads_reduced = True

    def zero_grad(self) -> None:
        super().zero_grad()
        self._grads_reduced = False

    def local_grad_sq(self) -> float:
        """Sum of squares of this rank's gradient shards, each element counted once overall."""
        if self.replicate is not None and self.replicate.rank != 0:
            return 0.0   # the replicas hold the same shards: counted on replica 0
        pieces = []
        for unit in self.units:
            g, layout = unit.target.grad, unit.layout
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

    @classmethod
    def estimate_memory(cls, model, sizes, stage: int = 3, **_):
        """Per-rank bytes of stage ``stage``: see :func:`~mpishard.planning.zero_memory.zero_memory_estimate`."""
        from mpishard.planning.zero_memory import zero_memory_estimate  # noqa: PLC0415 (planning reads parallel)
        return zero_memory_estimate(model, sizes, stage, cls.max_inflight_reductions)

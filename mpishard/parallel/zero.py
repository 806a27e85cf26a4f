"""ZeRO stages 1, 2 and 3 (stage 3 is full sharding, as in FSDP): one class, a ``stage``.

    mpiexec -n 4 python -m mpi4py examples/train_gpt.py --strategy zero3

Parameters are grouped into units (a GPT block each, plus the root remainder:
embeddings and the final norm), each laid out as one padded flat buffer (see
[Note: flat unit layout] in flat.py). Each dp rank owns one contiguous slice.

| stage | kept whole on every rank | kept as this rank's shard |
|---|---|---|
| 1 | parameters, gradients | optimizer state |
| 2 | parameters | gradients, optimizer state |
| 3 | (a unit's parameters while it computes) | parameters, gradients, optimizer state |

Gradients of a unit are reduce-scattered (averaged) into its gradient shard as
soon as backward has finished the unit (grad-ready hooks), non-blocking. The
optimizer updates the shards (:meth:`parameters` returns them as
:class:`FlatShard` targets). Stages 1 and 2 then all-gather the updated shards
into the full parameters. Stage 3 keeps only shards: a unit is all-gathered just
before its forward, released after it (``reshard_after_forward``), gathered
again when backward reaches it (a grad-ready hook on the unit's output), and
released once its gradients are reduce-scattered; the next unit's gather is
issued ahead with a non-blocking all-gather (``prefetch``). The root unit is
gathered for the whole forward and backward. See ZeRO (Rajbhandari et al.,
2020, arXiv:1910.02054).

With mixed precision (see [Note: mixed precision] in precision.py) the shard
is the float32 master. Stage 3 casts it once per step into a 16-bit copy of
the shard (``unit.compute_shard``) and all-gathers that; stages 1 and 2 keep
the whole model as a 16-bit buffer (``unit.full``) whose own block is refreshed
from the master after each update and then all-gathered in place. Gradients
are flattened into ``reduce_dtype`` buffers before the reduce-scatter.
"""
from __future__ import annotations

import numpy as np

from ..autodiff.tensor import Tensor
from ..optim.clip import grad_sq_sum
from ..nn.init import seed_dropout
from ..nn.parameter import init_array
from .base import Strategy
from .data_parallel import check_replicas_equal
from .flat import FlatShard
from .units import FlatUnit

__all__ = ["ZeRO", "plan_units"]


def plan_units(module, unit_names, dp_size: int, dp_rank: int, root_unit: bool = True):
    """Build the :class:`FlatUnit` list: named units in order, then the root remainder.

    Raises ``ValueError`` (identically on every rank) for an unknown unit, a
    parameter in two units, or one in none (with ``root_unit=False``).
    """
    modules = dict(module.named_modules())
    canonical = {id(p): name for name, p in module.named_parameters()}
    owner: dict[int, str] = {}
    units = []
    for unit_name in unit_names:
        if unit_name not in modules or unit_name == "":
            raise ValueError(f"unit {unit_name!r} is not a sub-module of "
                             f"{type(module).__name__}; name modules as in named_modules(), "
                             f"e.g. 'transformer.h.0'")
        named = []
        for _, p in modules[unit_name].named_parameters():
            if id(p) in owner:
                raise ValueError(f"parameter {canonical[id(p)]} is in two units, "
                                 f"{owner[id(p)]!r} and {unit_name!r}; list each module once "
                                 f"and no module inside another")
            owner[id(p)] = unit_name
            named.append((canonical[id(p)], p))
        units.append(FlatUnit(unit_name, named, dp_size, dp_rank, modules[unit_name]))
    rest = [(n, p) for n, p in module.named_parameters() if id(p) not in owner]
    # A parameter shared with a module outside its unit would be needed while
    # that unit is released (e.g. a tied embedding): refuse.
    for mod_name, mod in modules.items():
        for p in mod._parameters.values():
            unit = owner.get(id(p))
            if unit is not None and not (mod_name == unit or mod_name.startswith(unit + ".")):
                raise ValueError(f"parameter {canonical[id(p)]} of unit {unit!r} is also used by "
                                 f"module {mod_name!r} outside it; keep tied parameters in one "
                                 f"unit (e.g. leave both in the root)")
    if rest:
        if not root_unit:
            raise ValueError(f"parameters in no unit: {', '.join(n for n, _ in rest)}; add units "
                             f"that cover them or pass root_unit=True")
        units.append(FlatUnit("", rest, dp_size, dp_rank, None))
    return units


class ZeRO(Strategy):
    """Shard optimizer state (stage 1), + gradients (2), + parameters (3) over ``mesh.dp``.

    Args:
        module: the model; under stage 3 build it with ``materialize_now=False``
            so no rank ever holds it whole (parameters are materialised one
            tensor at a time, from seed and name, straight into shards).
        mesh: a :class:`mpishard.comm.Mesh`.
        stage: 1, 2 or 3.
        units: module names that form units (default: ``module.shard_units()``).
        root_unit: put parameters of no unit into a root unit (default True).
        reshard_after_forward: stage 3: release a unit after its forward.
        prefetch: stage 3: gather the next unit ahead, non-blocking.
        seed: initialisation seed (default: ``module.seed``).
        precision: ``"float32"`` (default), ``"float16"``, ``"bfloat16"`` or a
            :class:`~mpishard.parallel.Precision`.
    """

    #: reduce-scatters in flight before backward waits for the oldest
    max_inflight_reductions = 2

    def __init__(self, module, mesh, stage: int = 3, units=None, root_unit: bool = True,
                 reshard_after_forward: bool = True, prefetch: bool = True, seed=None,
                 ledger=None, precision=None):
        super().__init__(module, mesh, ledger, precision)
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r}")
        self.stage = stage
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        names = list(units) if units is not None else list(
            getattr(module, "shard_units", lambda: [])())
        self.units = plan_units(module, names, self.dp.size, self.dp.rank, root_unit)
        self.blocks = [u for u in self.units if u.module is not None]
        self.root = next((u for u in self.units if u.module is None), None)
        if any(p.data is not None for p in module.parameters()):
            check_replicas_equal(module, self.dp)
        seed = seed if seed is not None else getattr(module, "seed", 0)
        backend = getattr(module, "backend", None)
        self.xp = backend.xp if backend is not None else np
        self._pending: list = []
        self._grads_reduced = False
        deferred = any(p.data is None for p in module.parameters())
        for unit in self.units:
            self._materialize(unit, seed)
            for p in unit.params:
                p.register_grad_ready_hook(lambda p, unit=unit: self._on_grad_ready(unit))
        if deferred:  # what materialize() does besides parameters: dropout generators
            seed_dropout(module, seed, backend)
        # See [Note: prefetch order].
        self._order: list[int] = []
        self._last_order: list[int] = list(range(len(self.blocks)))
        if stage == 3:
            for i, unit in enumerate(self.blocks):
                unit.module.register_forward_pre_hook(lambda m, a, i=i: self._pre_forward(i))
                unit.module.register_forward_hook(lambda m, a, out, i=i: self._post_forward(i, out))
        module.register_forward_pre_hook(lambda m, a: self._before_forward())

    # -- layout and materialisation -------------------------------------------
    def _materialize(self, unit: FlatUnit, seed: int) -> None:
        xp, ledger, cd = self.xp, self.ledger, self.compute_dtype
        unit.full, unit.compute_shard = None, None
        if self.stage < 3:
            unit.full = ledger.zeros("params", (unit.padded,), cd, f"params {unit.label}", xp=xp)
        if self.stage < 3 and not self.mixed:  # the shard is this rank's block of full
            shard = unit.full[unit.shard_start:unit.shard_stop]
        else:
            shard = ledger.zeros("params", (unit.shard_size,), unit.dtype,
                                 f"param shard {unit.label}", xp=xp)
        views = unit.views(unit.full) if unit.full is not None else None
        for i, (name, p) in enumerate(zip(unit.names, unit.params)):
            if p.data is not None:
                value = p.data
                ledger.release(p.data)
            else:  # deferred: one tensor at a time, from (seed, name)
                full = init_array(p.init, p.spec.global_shape, seed, name)
                value = xp.asarray(p.spec.local_slice_of(full).astype(unit.dtype))
            if views is not None:
                views[i][...] = value
                p.data = views[i]
            else:
                p.data = xp.empty(0, dtype=cd)  # released; see [Note: parameter storage]
            if views is None or self.mixed:
                offset, piece = unit.owned_piece(i, value)
                shard[offset:offset + piece.size] = piece
        unit.target = FlatShard(shard, unit.decay_ranges(), unit.label)
        if self.stage == 3 and self.mixed:
            unit.compute_shard = ledger.zeros("params", (unit.shard_size,), cd,
                                              f"{cd.name} param shard {unit.label}", xp=xp)
            unit.compute_shard[...] = shard
        rd = self.reduce_dtype
        unit.grad_shard = ledger.zeros("grads", (unit.shard_size,), unit.dtype,
                                       f"grad shard {unit.label}", xp=xp)
        unit.grad_full = (ledger.zeros("grads", (unit.padded,), rd,
                                       f"grads {unit.label}", xp=xp) if self.stage == 1 else None)
        unit.gather = None
        unit.ready = 0
        unit.reductions = 0

    def parameters(self) -> list:
        """This rank's flat shards, one per unit: hand these to the optimizer."""
        return [unit.target for unit in self.units]

    # -- stage 3: unshard / reshard -------------------------------------------
    def unshard(self, unit: FlatUnit) -> None:
        """Make the unit's full parameters available (waits for a prefetch if one is pending)."""
        if unit is None or unit.full is not None:
            return
        if unit.gather is not None:
            handle, buf = unit.gather
            handle.wait()
            unit.gather = None
        else:
            buf = self.ledger.empty("gathered", (unit.padded,), self.compute_dtype,
                                    f"gathered {unit.label}", xp=self.xp)
            self.dp.all_gather(self._gather_source(unit), buf)
        unit.full = buf
        for p, view in zip(unit.params, unit.views(buf)):
            p.data = view

    def reshard(self, unit: FlatUnit) -> None:
        """Release the unit's full parameters (stage 3 only; a no-op otherwise)."""
        if self.stage != 3 or unit is None or unit.full is None:
            return
        for p in unit.params:
            p.data = self.xp.empty(0, dtype=self.compute_dtype)
        self.ledger.release(unit.full)
        unit.full = None

    @staticmethod
    def _gather_source(unit: FlatUnit):
        """What stage 3 all-gathers: the shard, or its 16-bit copy under mixed precision."""
        return unit.compute_shard if unit.compute_shard is not None else unit.target.data

    def _prefetch(self, unit: FlatUnit) -> None:
        if not self.prefetch or unit.full is not None or unit.gather is not None:
            return
        buf = self.ledger.empty("gathered", (unit.padded,), self.compute_dtype,
                                f"gathered {unit.label}", xp=self.xp)
        unit.gather = (self.dp.iall_gather(self._gather_source(unit), buf), buf)

    # [Note: prefetch order]
    # Units run in the order the model calls them, not necessarily the order
    # they were listed. Each forward records that order; the next forward
    # prefetches the unit that followed last time, and backward prefetches the
    # unit that preceded in this forward. A prefetch that is never consumed
    # would hold parameters from before the optimizer step, so reduce_grads()
    # discards every pending prefetch before the update.
    def _before_forward(self) -> None:
        self._settle_reductions()
        if self.stage < 3:
            return
        if self._order:
            self._last_order, self._order = self._order, []
        self.unshard(self.root)

    def _settle_reductions(self) -> None:
        """Before a forward: finish the reduce-scatters an earlier backward of this step
        started, so the next backward never writes into a buffer MPI still reads.
        Stage 1 also clears the full gradients it reduced: the next backward's
        gradients then reduce on their own and add to the shard (each micro-step
        may communicate; ``no_sync`` only saves the traffic)."""
        while self._pending:
            self._finish_oldest_reduction()
        if self.stage == 1:
            for unit in self.units:
                if unit.reductions:
                    unit.grad_full[...] = 0

    @staticmethod
    def _neighbour(order: list, i: int, delta: int):
        if i not in order:
            return None
        k = order.index(i) + delta
        return order[k] if 0 <= k < len(order) else None

    def _pre_forward(self, i: int) -> None:
        self._order.append(i)
        self.unshard(self.blocks[i])
        nxt = self._neighbour(self._last_order, i, +1)
        if nxt is not None:
            self._prefetch(self.blocks[nxt])

    def _post_forward(self, i: int, output) -> None:
        if self.reshard_after_forward:
            self.reshard(self.blocks[i])
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for out in outputs:
            if isinstance(out, Tensor) and out.requires_grad:
                out.register_grad_ready_hook(lambda t, i=i: self._pre_backward(i))

    def _pre_backward(self, i: int) -> None:
        self.unshard(self.blocks[i])
        prev = self._neighbour(self._order, i, -1)
        if prev is not None:
            self._prefetch(self.blocks[prev])

    def _discard_prefetches(self) -> None:
        for unit in self.blocks:
            if unit.gather is not None:
                handle, buf = unit.gather
                handle.wait()
                self.ledger.release(buf)
                unit.gather = None

    # -- gradients --------------------------------------------------------------
    def _on_grad_ready(self, unit: FlatUnit) -> None:
        self._grads_reduced = False
        unit.ready += 1
        if unit.ready < len(unit.params):
            return
        unit.ready = 0
        if self.sync_gradients:
            self._reduce_scatter(unit)
        if unit is not self.root:  # the root may serve more micro-batches' backward
            self.reshard(unit)

    def _reduce_scatter(self, unit: FlatUnit) -> None:
        rd = self.reduce_dtype
        if unit.grad_full is not None:  # stage 1 keeps full gradients
            flat = unit.grad_full
        else:
            flat = self.ledger.empty("comm", (unit.padded,), rd,
                                     f"grad bucket {unit.label}", xp=self.xp)
        unit.flatten([p.grad for p in unit.params], flat)
        full_grads = unit.views(flat) if unit.grad_full is not None else [None] * len(unit.params)
        for p, g in zip(unit.params, full_grads):
            p.grad = g
        first = unit.reductions == 0
        if first and rd == unit.grad_shard.dtype:
            recv = unit.grad_shard
        else:
            recv = self.ledger.empty("comm", (unit.shard_size,), rd,
                                     f"grad shard {unit.label} (received)", xp=self.xp)
        unit.reductions += 1
        self._pending.append((unit, self.dp.ireduce_scatter(flat, recv, op="avg"), flat, recv,
                              first))
        # Bound the full-size gradient buffers alive at once (stage 2/3 memory).
        while len(self._pending) > self.max_inflight_reductions:
            self._finish_oldest_reduction()

    def _finish_oldest_reduction(self) -> None:
        unit, handle, flat, recv, first = self._pending.pop(0)
        handle.wait()
        if recv is not unit.grad_shard:
            if first:  # reduced in another dtype: cast into the shard
                unit.grad_shard[...] = recv
            else:
                unit.grad_shard += recv
            self.ledger.release(recv)
        if flat is not unit.grad_full:
            self.ledger.release(flat)

    def reduce_grads(self) -> None:
        """Reduce-scatter what backward did not (in unit order), wait for everything.

        Idempotent until the next backward: a second call changes nothing.
        """
        if self._grads_reduced:
            return
        for unit in self.units:
            unit.ready = 0
            if unit.reductions == 0:
                self._reduce_scatter(unit)
        while self._pending:
            self._finish_oldest_reduction()
        self._discard_prefetches()
        self.reshard(self.root)
        for unit in self.units:
            unit.reductions = 0
            unit.target.grad = unit.grad_shard
        self._grads_reduced = True

    def zero_grad(self) -> None:
        super().zero_grad()
        self._grads_reduced = False

    def _local_grad_sq(self) -> float:
        """Sum of squares of this rank's gradient shards, each element counted once overall."""
        pieces = []
        for unit in self.units:
            g = unit.target.grad
            if g is None:
                continue
            if all(self.counts_once(p.spec) for p in unit.params):
                pieces.append(g)
                continue
            for i, p in enumerate(unit.params):
                if self.counts_once(p.spec):
                    lo, hi = unit.shard_range_of(i)
                    pieces.append(g[lo:hi])
        return grad_sq_sum(pieces)

    def _after_update(self) -> None:
        """Bring the compute copies up to date with the updated (or loaded) shards."""
        if self.stage == 3:
            # A forward without backward (evaluation) leaves the root, and with
            # reshard_after_forward=False the blocks, gathered: drop those copies
            # so the next forward gathers the new values.
            self._discard_prefetches()
            for unit in self.units:
                self.reshard(unit)
            if self.mixed:
                for unit in self.units:
                    unit.compute_shard[...] = unit.target.data
            return
        # This rank's block of the full buffer (the shard itself, or its 16-bit
        # copy under mixed precision) is current: an in-place all-gather.
        blocks = [unit.full[unit.shard_start:unit.shard_stop] for unit in self.units]
        if self.mixed:
            for unit, block in zip(self.units, blocks):
                block[...] = unit.target.data
        handles = [self.dp.iall_gather(block, unit.full) for unit, block in zip(self.units, blocks)]
        for handle in handles:
            handle.wait()

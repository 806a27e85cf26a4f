"""Data parallelism: every rank holds the whole model; gradients are averaged.

    mpiexec -n 4 python -m mpi4py -m mpishard train --strategy ddp

Gradients are averaged over ``mesh.dp`` in flat buckets. Each parameter's
gradient is computed straight into its bucket view where the op allows (a
linear layer's and a norm's; see [Note: gradient buffers] in
mpishard/autodiff/tensor.py), else copied there the moment it is final (a grad-ready hook),
and a bucket's non-blocking all-reduce starts as soon as all its gradients are
in, so communication overlaps the rest of backward. Buckets are filled in
reverse registration order (roughly the order backward produces gradients) and
launched strictly in bucket order, so every rank issues the same collectives in
the same order (see [Note: bucket launch order] below).

With mixed precision (``precision="float16"``, see [Note: mixed precision]) the
model computes with a 16-bit copy of every parameter, buckets hold gradients in
``reduce_dtype``, and the optimizer updates one flat float32 master holding
every parameter (:meth:`parameters` returns it as one :class:`FlatShard`
target, held in :class:`MasterCopies`), as ZeRO updates flat shards: the
parameters' 16-bit copies are views of one flat buffer, the buckets slices of
one flat gradient buffer, both in the master's order.

With ``offload="optimizer"`` (see [Note: optimizer offload] in
mpishard/parallel/offload.py) the model's parameters are laid out the same way
(views of one flat device buffer, in float32 too), and the flat master, its
optimizer state and a gradient buffer of its size live in host memory: each
bucket's averaged gradients are copied there as soon as its all-reduce is done,
the host updates the master, and the device buffer is refreshed from it.
"""
from __future__ import annotations

from mpishard.core.backend import xp_of
from mpishard.optim.clip import grad_sq_sum
from mpishard.optim.optimizers import Targets
from mpishard.parallel.flat import FlatIndex, stage_grad
from mpishard.parallel.offload import HostMasters, check_offload, copy_into, host_zeros
from mpishard.parallel.pieces import TargetSlices, replicated_pieces
from mpishard.parallel.precision import MasterCopies
from mpishard.parallel.replicas import check_replicas_equal, is_expert_param
from mpishard.parallel.strategy import Sharded, Strategy, register_strategy

__all__ = ["DataParallel"]

# [Note: bucket launch order]
# MPI matches collectives on a communicator by the order in which ranks issue
# them (see [Note: collective order] in mpishard/comm/debug.py). Grad-ready hooks fire in the order of the backward graph, which is the
# same on every rank, but to be safe against parameters that get no gradient on
# some step a bucket is launched only after every earlier bucket was: bucket i
# waits for buckets 0..i-1, and reduce_grads() launches the rest in index order.


def _bucket_groups(params, bucket_bytes: int, itemsize: int) -> list:
    """Parameters in reverse registration order, cut into buckets of about
    ``bucket_bytes`` (``itemsize`` bytes per element: the compute dtype's) and of one
    dtype each."""
    groups, current, current_bytes = [], [], 0
    for p in reversed(params):
        nbytes = p.size * itemsize
        if current and (current_bytes + nbytes > bucket_bytes or p.dtype != current[0].dtype):
            groups.append(current)
            current, current_bytes = [], 0
        current.append(p)
        current_bytes += nbytes
    if current:
        groups.append(current)
    return groups


class _Bucket:
    __slots__ = ("params", "flat", "views", "ready", "handle", "comm", "scale")

    def __init__(self, params, ledger, xp, index, dtype, flat=None, comm=None, scale=1.0):
        self.params = params
        self.comm, self.scale = comm, scale   # averaged over comm, then times scale
        layout = FlatIndex.of([p.shape for p in params], dtype)
        # its own buffer, or its slice of the flat gradients (mixed precision)
        self.flat = flat if flat is not None else ledger.zeros(
            "grads", (layout.padded_numel,), layout.dtype, f"ddp bucket {index}", xp=xp)
        self.views = layout.views(self.flat)
        self.ready = 0
        self.handle = None

    def finish(self) -> None:
        """Wait for the average; apply the scale (1 / ep for experts split over ep)."""
        self.handle.wait()
        self.handle = None
        if self.scale != 1.0:
            self.flat *= self.scale

    def stage(self, i: int) -> None:
        """Copy ``params[i]``'s gradient into the bucket; its ``grad`` becomes the bucket view."""
        stage_grad(self.params[i], self.views[i])


@register_strategy("ddp", "data parallel: every rank holds the whole model; gradients "
                   "averaged in buckets during backward", keeps_sharded=Sharded.NOTHING)
class DataParallel(Strategy):
    """Replicate the model on every dp rank and average gradients in buckets.

    Args:
        module: the model (an unmaterialised one is materialised from ``seed``).
        mesh: a :class:`mpishard.comm.Mesh` (its ``dp`` axis is used).
        bucket_bytes: target size of one gradient bucket.
        sync_params: ``"check"`` (raise if parameters differ across ranks) or
            ``"broadcast"`` (copy rank 0's parameters to every rank).
        precision: ``"float32"`` (default), ``"float16"``, ``"bfloat16"`` or a
            :class:`~mpishard.parallel.Precision`.
        offload: ``"optimizer"`` keeps the float32 master and the optimizer state in
            host memory (docs/offload.md); ``None`` or ``"none"`` (default) does not.
    """

    #: takes ``offload="optimizer"`` (see [Note: optimizer offload] in offload.py)
    offloads_optimizer = True

    def __init__(self, module, mesh, bucket_bytes: int = 4 << 20, sync_params: str = "check",
                 ledger=None, precision=None, seed: int | None = None, offload=None):
        self.offload = check_offload(offload, type(self))
        super().__init__(module, mesh, ledger, precision, seed)
        if sync_params not in ("check", "broadcast"):
            raise ValueError(f"sync_params must be 'check' or 'broadcast', got {sync_params!r}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        params = module.parameters()
        self._buckets: list[_Bucket] = []
        self._where: dict[int, tuple] = {}
        self._next_launch = 0
        self.masters = HostMasters(self.ledger, self.xp) if self.offload else MasterCopies()
        self._master_of: dict = {}
        self._spans: list = []          # each bucket's (start, stop) in the flat master
        self._range_of: dict = {}
        # Experts split over ep are replicated over edp only, and their averaged
        # gradients scaled by 1 / ep (see [Note: expert dispatch] in parallel/expert/layers.py).
        # Buckets at every dp size, also 1 (where nothing is sent): gradients then
        # always live in ledger-counted buffers, as the plan says.
        xp = xp_of(params[0].data)
        groups, reduce_over = [], []
        for expert in (False, True):
            part = [p for p in params if is_expert_param(p) == expert]
            if not part:
                continue
            comm = self.replica_group(part[0])
            if comm.size > 1 and sync_params == "broadcast":
                for p in part:
                    comm.broadcast(p.data, root=0)
            elif comm.size > 1:
                check_replicas_equal(module, comm, select=lambda p, e=expert:
                                     is_expert_param(p) == e)
            cut = _bucket_groups(part, bucket_bytes, self.compute_dtype.itemsize)
            groups += cut
            reduce_over += [(comm, 1.0 / mesh.ep.size if expert else 1.0)] * len(cut)
        if self.mixed or self.offload:
            flats = self._make_masters(groups, xp)
        else:
            flats = [None] * len(groups)
        for group, flat, (comm, scale) in zip(groups, flats, reduce_over):
            self._buckets.append(_Bucket(group, self.ledger, xp, len(self._buckets),
                                         self.reduce_dtype, flat, comm, scale))
        for b, bucket in enumerate(self._buckets):
            for i, p in enumerate(bucket.params):
                self._where[id(p)] = (b, i)
                p.register_grad_ready_hook(self._on_grad_ready)
                p.grad_out = bucket.views[i]   # backward writes the gradient there
                # (see [Note: gradient buffers] in mpishard/autodiff/tensor.py)
        module.register_forward_pre_hook(lambda m, a: self._settle())

    def _make_masters(self, groups, xp) -> list:
        """Move every parameter's values into one flat float32 master, the optimizer's
        single target, and compute with views of one flat 16-bit copy (or, offloaded in
        float32, of the flat buffer that was the master before it moved to the host);
        gradients go to one flat buffer in the same order, whose slices are the buckets
        (returned).

        One target, not one per parameter: the optimizer's elementwise update then
        runs as a few large operations (ZeRO's units do the same).
        """
        ordered = [p for group in groups for p in group]
        layout = FlatIndex.of([p.shape for p in ordered], self.master_dtype)
        n, ledger = layout.numel, self.ledger
        compute = ledger.zeros("params", (n,), self.compute_dtype,
                               f"ddp {self.compute_dtype.name} copy", xp=xp)
        if not self.mixed:
            master = compute
        elif self.offload:
            master = host_zeros(ledger, "params", n, self.master_dtype, "ddp host masters", xp)
        else:
            master = ledger.zeros("params", (n,), self.master_dtype, "ddp masters", xp=xp)
        names = {id(p): name for name, p in self.module.named_parameters()}
        decay = []
        for p, offset, view in zip(ordered, layout.offsets, layout.views(compute)):
            lo, hi = offset, offset + p.size
            if master is not compute:
                copy_into(master[lo:hi], p.data.reshape(-1))
            ledger.release(p.data)          # the materialised float32 array: now the master
            view[...] = p.data
            p.data = view
            self._range_of[id(p)] = (lo, hi, names[id(p)])
            for a, b in p.decay_ranges:      # adjacent ranges merged: fewer slices to decay
                if decay and decay[-1][1] == lo + a:
                    decay[-1] = (decay[-1][0], lo + b)
                else:
                    decay.append((lo + a, lo + b))
        # after the materialised arrays are released: a device peak of the plan's bytes
        grads = ledger.zeros("grads", (n,), self.reduce_dtype, "ddp buckets", xp=xp)
        target = self.masters.add(master, compute, tuple(decay), "ddp masters")
        self._master_of = {id(p): target for p in ordered}
        flats, start = [], 0
        for group in groups:
            stop = start + sum(p.size for p in group)
            flats.append(grads[start:stop])
            self._spans.append((start, stop))
            start = stop
        self._flat_grads = grads
        return flats

    def parameters(self) -> list:
        """The optimizer's targets: the parameters, or their flat float32 master (mixed
        precision, offload)."""
        targets = self.module.parameters() if not (self.mixed or self.offload) else \
            self.masters.targets()
        return Targets(targets, self)

    def optimizer_target(self, p):
        """What the optimizer updates for parameter ``p`` (``p``, or its master)."""
        return self._master_of.get(id(p), p)

    # -- communication ------------------------------------------------------
    def _settle(self) -> None:
        """Before a forward: wait for the buckets an earlier backward of this step
        launched, and let the next backward launch them again. Its gradients add
        to the averaged ones already in the buckets, and averaging that sum adds
        their average: each micro-step may communicate (``no_sync`` only saves
        the traffic)."""
        if self._next_launch == 0:
            return
        for bucket in self._buckets[:self._next_launch]:
            bucket.finish()
            if bucket.scale != 1.0:   # the next reduction averages (and scales) it again
                bucket.flat *= 1.0 / bucket.scale
        for bucket in self._buckets:
            bucket.ready = 0
        self._next_launch = 0

    def _on_grad_ready(self, p) -> None:
        b, i = self._where[id(p)]
        bucket = self._buckets[b]
        if not self.sync_gradients:
            return
        bucket.stage(i)
        bucket.ready += 1
        self._launch_in_order()

    def _launch_in_order(self) -> None:
        while (self._next_launch < len(self._buckets)
               and self._buckets[self._next_launch].ready == len(
                   self._buckets[self._next_launch].params)):
            bucket = self._buckets[self._next_launch]
            bucket.handle = bucket.comm.iall_reduce(bucket.flat, op="avg")
            self._next_launch += 1

    def reduce_grads(self) -> None:
        """Launch buckets that backward did not complete, wait for all, reset."""
        if self.offload:      # each bucket into the host master's gradient once averaged
            target = self.masters.targets()[0]
            self._reduce_buckets(lambda b: self.masters.grad_to_host(
                target, self._buckets[b].flat, self._spans[b]))
            return
        self._reduce_buckets()
        if self.mixed:  # the master's gradient: the flat buffer the buckets are slices of
            for target in self.masters.targets():
                target.grad = self._flat_grads.astype(self.master_dtype, copy=False)

    def _reduce_buckets(self, finished=None) -> None:
        """Launch what is left, then wait for every bucket in order (``finished(b)``
        after bucket ``b``'s average is in place)."""
        for bucket in self._buckets[self._next_launch:]:
            for i in range(len(bucket.params)):
                bucket.stage(i)
            bucket.ready = len(bucket.params)
        self._launch_in_order()
        for b, bucket in enumerate(self._buckets):
            bucket.finish()
            bucket.ready = 0
            if finished is not None:
                finished(b)
        self._next_launch = 0

    def local_grad_sq(self) -> float:
        # every rank of a parameter's group holds the same averaged gradient: the
        # group's rank 0 counts it; parameter by parameter, in the order of the model
        return grad_sq_sum(p.grad for p in self.module.parameters()
                           if self.replica_group(p).rank == 0 and self.counts_once(p.spec))

    def after_update(self) -> None:
        """The compute copies follow the updated masters (mixed precision: 16-bit casts;
        offload: copies from the host)."""
        self.masters.refresh()

    def pieces(self, optimizer=None) -> list:
        """Every parameter whole, owned by dp rank 0; under mixed precision or offload its
        values and optimizer state are its slice of the flat master (see
        :meth:`_make_masters`)."""
        if not (self.mixed or self.offload):
            return replicated_pieces(self, optimizer)
        slices = TargetSlices(optimizer)
        pieces = []
        for p in self.module.parameters():
            lo, hi, name = self._range_of[id(p)]
            owner = self.replica_group(p).rank == 0 and self.counts_once(p.spec)
            pieces += slices.pieces(name, p.spec, self._master_of[id(p)], (lo, hi),
                                    p.spec.global_runs(), owner)
        return pieces

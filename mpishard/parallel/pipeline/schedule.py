"""Pipeline parallelism: whole blocks per stage, micro-batches, GPipe, 1F1B and interleaved 1F1B.

    mpiexec -n 4 python -m mpi4py -m mpishard train --pp 2 --dp 2 --micro-steps 4
    mpiexec -n 2 python -m mpi4py -m mpishard train --pp 2 --micro-steps 4 --strategy zero1 \
        --pipeline-schedule interleaved --virtual-stages 2

Stage ``s`` of ``mesh.pp`` holds a contiguous run of blocks (the first stage also
what the model's :class:`~mpishard.nn.PipelinePlan` lists as first, e.g. the
embeddings; the last what it lists as last, e.g. the final norm and the output
layer). A step splits the batch into ``m`` micro-batches; activations go
forward and their gradients back with point-to-point messages whose shapes
every stage knows from the batch (the stage's ``activation_shape``, see [Note:
pipeline stage interface] in mpishard/nn/sharding.py), tagged ``2 (c m + i)``
(activations of micro-batch ``i``) and ``2 (c m + i) + 1`` (their gradients),
with ``c`` the chunk, on the sending rank, of the stage before the boundary
(always 0 without interleaving): unique per (chunk boundary, micro-batch,
direction) between two ranks, so no two messages can be confused, also when
``pp = 2`` sends both ways between the same two ranks.

- GPipe (Huang et al., 2019, arXiv:1811.06965): all forwards, then all backwards.
- 1F1B (PipeDream-Flush; Narayanan et al., 2021, arXiv:2104.04473): stage ``s``
  runs ``p - s - 1`` warm-up forwards, then alternates one forward and one
  backward, then drains; the same bubble, at most ``p - s`` micro-batches of
  activations alive instead of ``m``.
- Interleaved 1F1B (Narayanan et al., 2021, Section 2.2; Megatron-Core's
  order): each rank holds ``V`` model chunks (:class:`~mpishard.parallel.pipeline.
  chunks.ModelChunks`, stages ``s, s + p, ...`` of ``p V``) and micro-batches go
  round the ranks ``V`` times; ``m`` a multiple of ``p``. See [Note: interleaved
  order] in order.py for the order each rank runs.

The bubble, the idle fraction of an ideal pipeline, is ``(p - 1) / (V m + p - 1)``
(``V = 1`` without interleaving): ``(p - 1) / (V m)`` of the busy time.
Gradients are communicated once after the last micro-batch: the two copies of
a tied parameter (the token table on the first and the last stage) are summed,
then the strategy reduces over dp in ``step``. Activations and their gradients stay in the
model's array module (device memory on CuPy); the communicator sends them
directly (CUDA-aware MPI) or through its pinned staging buffers.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from mpishard.autodiff.rows import release_values
from mpishard.autodiff.tensor import Tensor, no_grad
from mpishard.core.backend import to_numpy, xp_of
from mpishard.parallel.pipeline.order import SCHEDULES, message_tag, schedule_order

__all__ = ["partition_blocks", "Pipeline", "StepLoss", "bubble_fraction"]


def bubble_fraction(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """The ideal pipeline's idle share of the step, ``(p - 1) / (V m + p - 1)``.

    Every rank idles ``(p - 1)`` chunk slots of a step of ``V m`` busy ones (GPipe
    and 1F1B: ``V = 1``; interleaved 1F1B: ``V`` chunks per rank). As a share of the
    busy time that is ``(p - 1) / (V m)``, the figure Narayanan et al. give.
    """
    return (stages - 1) / (virtual_stages * micro_batches + stages - 1)


def partition_blocks(n_layer: int, stages: int, block_params=1, first_extra: int = 0,
                     last_extra: int = 0, plan=None) -> list[range]:
    """Split ``n_layer`` blocks into ``stages`` contiguous runs.

    Balanced by parameter count: each block counts ``block_params`` (one number
    for all, or one per block), the first stage also ``first_extra``
    (embeddings), the last ``last_extra`` (final norm); the split minimises the
    largest stage. ``plan`` (blocks per stage, e.g. ``[1, 3]``) overrides it.

    Raises:
        ValueError: more stages than blocks, or a plan that does not add up.
    """
    if stages < 1:
        raise ValueError(f"pp must be >= 1, got {stages}")
    if stages > n_layer:
        raise ValueError(f"pp={stages} is larger than the number of blocks (n_layer="
                         f"{n_layer}); every pipeline stage needs at least one block")
    if plan is not None:
        plan = [int(n) for n in plan]
        if len(plan) != stages or sum(plan) != n_layer or min(plan) < 1:
            raise ValueError(f"stage plan {plan} must give each of the {stages} stages at "
                             f"least one block, {n_layer} in all")
    else:
        sizes = [block_params] * n_layer if np.isscalar(block_params) else list(block_params)
        if len(sizes) != n_layer:
            raise ValueError(f"block_params has {len(sizes)} entries for {n_layer} blocks")
        prefix = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        # best[k][j]: smallest possible largest stage using stages 0..k for blocks 0..j-1
        inf = float("inf")
        best = [[inf] * (n_layer + 1) for _ in range(stages)]
        cut = [[0] * (n_layer + 1) for _ in range(stages)]
        for j in range(1, n_layer + 1):
            best[0][j] = first_extra + prefix[j] + (last_extra if stages == 1 else 0)
        for k in range(1, stages):
            for j in range(k + 1, n_layer + 1):
                for i in range(k, j):
                    cost = prefix[j] - prefix[i] + (last_extra if k == stages - 1 else 0)
                    worst = max(best[k - 1][i], cost)
                    if worst < best[k][j]:
                        best[k][j], cut[k][j] = worst, i
        bounds, j = [n_layer], n_layer
        for k in range(stages - 1, 0, -1):
            j = cut[k][j]
            bounds.append(j)
        bounds.append(0)
        bounds.reverse()
        plan = [bounds[k + 1] - bounds[k] for k in range(stages)]
    starts = np.concatenate([[0], np.cumsum(plan)]).tolist()
    return [range(starts[k], starts[k + 1]) for k in range(stages)]


@dataclass
class _Step:
    """One step's state, passed to the micro-batch functions (the schedule's locals)."""

    x: list
    y: list
    batch: int                    # micro-batch size b
    seq_len: int
    saved: dict = field(default_factory=dict)     # (c, i) -> (input, output) kept for backward
    sends: list = field(default_factory=list)     # handles of sends in flight
    losses: list = field(default_factory=list)
    weights: list = field(default_factory=list)   # each micro-batch's loss weight
    alive: dict = field(default_factory=dict)     # (c, i) -> measured activation bytes


class StepLoss:
    """A training step's mean loss, read when first converted (``float(loss)``).

    :meth:`Pipeline.forward_backward` returns it so that the step's optimizer update
    can run before anything is read back: on a device the micro-batches' losses stay
    there until then (see [Note: device step decisions] in mpishard/parallel/strategy.py).
    The read is one host sync and, with ``pp > 1``, a broadcast from the last stage:
    every rank of the pipeline reads its step's loss, in the same order.
    """

    def __init__(self, read):
        self._read, self._value = read, None

    def __float__(self) -> float:
        if self._read is not None:
            self._value, self._read = self._read(), None
        return self._value

    def __repr__(self) -> str:
        return f"StepLoss({float(self)})"


class Pipeline:
    """Drive one step of micro-batches through the stages (any ``pp``, also 1).

    Args:
        strategy: the stage's model wrapped in a strategy (DataParallel/ZeRO);
            its module answers the stage interface ([Note: pipeline stage
            interface] in mpishard/nn/sharding.py); for ``"interleaved"`` it is
            a :class:`~mpishard.parallel.pipeline.chunks.ModelChunks`.
        mesh: the :class:`~mpishard.comm.Mesh`.
        micro_batches: ``m >= 1``; the per-rank batch must divide by it (and ``m``
            by ``pp`` for ``"interleaved"``).
        schedule: ``"1f1b"``, ``"gpipe"`` or ``"interleaved"``.
        tie: Communicator joining this rank with the other end of the pipeline
            (first <-> last stage) for tied parameters, or ``None``.
        tied: the parameters of this stage that ``tie`` sums gradients of, in
            the same order on both ends.
    """

    def __init__(self, strategy, mesh, micro_batches: int = 1, schedule: str = "1f1b",
                 tie=None, tied=()):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; use one of "
                             f"{', '.join(SCHEDULES)}")
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
        self.strategy, self.mesh, self.pp = strategy, mesh, mesh.pp
        self.model = strategy.module
        #: model chunks on this rank (``V``; 1 unless the module holds several)
        self.chunks = getattr(self.model, "virtual_stages", 1)
        if (schedule == "interleaved") != (self.chunks > 1):
            raise ValueError(f"the {schedule!r} schedule with {self.chunks} model chunk(s) "
                             f"per rank: 'interleaved' needs a module holding 2 or more "
                             f"chunks (ParallelModel(..., virtual_stages=V)), the others one")
        if schedule == "interleaved" and micro_batches % mesh.pp.size:
            raise ValueError(f"the interleaved schedule needs micro_batches a multiple of "
                             f"pp = {mesh.pp.size}, got {micro_batches}")
        self.first = getattr(self.model, "first_stage", True)
        self.last = getattr(self.model, "last_stage", True)
        self.micro_batches, self.schedule = micro_batches, schedule
        self.tie, self.tied = tie, list(tied)
        self.stage, self.stages = self.pp.rank, self.pp.size
        self.idle_seconds = 0.0
        self.busy_seconds = 0.0
        self.step_seconds = 0.0
        self._dtype = strategy.compute_dtype  # activations cross stages in it
        self._xp = strategy.xp
        #: set to measure the next training step's activations (see [Note: measured activations])
        self.measure_activations = False
        self.activation_bytes = 0

    # [Note: measured activations]
    # With measure_activations set, each micro-batch's forward runs inside the
    # ledger's measure_activations() (tracemalloc on NumPy: slower, so one step
    # at a time) and its bytes count as alive until its backward starts. The
    # step's peak of that sum, what the schedule keeps at once (all m
    # micro-batches under GPipe, at most p - s under 1F1B, the chunks' forwards
    # between a forward and its backward in the interleaved order), becomes the
    # ledger's "activations" peak and ``activation_bytes``. A chunk's output handed
    # to its send is not among them: a message in flight, not kept for backward
    # (see [Note: sent outputs]).
    def _forward(self, step: _Step, c: int, i: int) -> None:
        if not self.measure_activations:
            self._run_forward(step, c, i)
            return
        with self.strategy.ledger.measure_activations() as measured:
            sent = self._run_forward(step, c, i)
        step.alive[c, i] = measured.nbytes - sent
        self.activation_bytes = max(self.activation_bytes, sum(step.alive.values()))

    # -- one micro-batch through one chunk ------------------------------------------
    def _ends(self, c: int) -> tuple:
        """Whether chunk ``c`` of this rank is the model's first stage, and its last."""
        return self.first and c == 0, self.last and c == self.chunks - 1

    def _tag(self, c: int, i: int, direction: int, before: bool) -> int:
        """:func:`~mpishard.parallel.pipeline.order.message_tag` of this rank."""
        return message_tag(self.stage, c, i, self.micro_batches, bool(direction), before)

    # [Note: sent outputs]
    # Once a chunk's output is handed to its send, nothing on this rank reads its
    # values: the boundary's backward, ``out.backward(grad)``, reads only the
    # gradient that comes back (an op's backward reads what it kept, never its own
    # output tensor). So the output lets go of its values at once, keeping its
    # place in the graph (:func:`~mpishard.autodiff.rows.release_values`), and the
    # send holds the array until it completes; the completed sends are dropped
    # before each forward and backward, and with them the arrays. Megatron-LM does
    # the same (``deallocate_output_tensor``; Korthikanti et al. 2022,
    # arXiv:2205.05198, Appendix B), and the activation plans count no output on a
    # stage that sends one (mpishard/models/gpt/activations.py).
    def _run_forward(self, step: _Step, c: int, i: int) -> int:
        """Micro-batch ``i`` through chunk ``c``; returns the bytes handed to a send
        (0 on the model's last stage, which sends nothing)."""
        x, y = step.x[i], step.y[i]
        first, last = self._ends(c)
        chunk = {"chunk": c} if self.chunks > 1 else {}
        if first:
            inp, extra = x, {}
        else:
            rows, width = self.model.activation_shape(step.batch, step.seq_len)
            split = getattr(self.model, "sequence_parallel_size", 1)  # split rows under sp
            buf = self._xp.empty((rows // split, width), dtype=self._dtype)
            self._recv_rows(buf, (self.stage - 1) % self.stages,
                            self._tag(c, i, 0, before=True))
            inp, extra = Tensor(buf, requires_grad=True), {"batch_size": step.batch}
        if last:
            _, loss = self.strategy(inp, y, **extra, **chunk)
            step.losses.append(loss.data)     # read once per step, in _mean_loss
            step.saved[c, i] = (inp, self.strategy.scale_loss(loss) * step.weights[i])
            return 0
        out = self.strategy(inp, **extra, **chunk)
        send = self._xp.ascontiguousarray(out.data)
        step.sends.append(self.pp.isend(self._rows_to_send(send), (self.stage + 1) % self.stages,
                                        self._tag(c, i, 0, before=False)))
        release_values(out)                   # the send holds it: see [Note: sent outputs]
        step.saved[c, i] = (inp, out)
        return send.nbytes

    def _backward(self, step: _Step, c: int, i: int) -> None:
        step.alive.pop((c, i), None)
        inp, out = step.saved.pop((c, i))
        first, last = self._ends(c)
        if last:
            out.backward()
        else:
            grad = self._xp.empty(out.shape, dtype=self._dtype)
            self._recv_rows(grad, (self.stage + 1) % self.stages,
                            self._tag(c, i, 1, before=False))
            out.backward(grad)
        if not first:
            send = self._xp.zeros(inp.shape, self._dtype) if inp.grad is None else \
                self._xp.ascontiguousarray(inp.grad, dtype=self._dtype)
            step.sends.append(self.pp.isend(self._rows_to_send(send),
                                            (self.stage - 1) % self.stages,
                                            self._tag(c, i, 1, before=True)))

    def order(self) -> list:
        """This rank's forwards and backwards of a step, ``(kind, chunk, micro_batch)``
        in the order they run (:func:`~mpishard.parallel.pipeline.order.schedule_order`)."""
        return schedule_order(self.schedule, self.stages, self.stage, self.micro_batches,
                              self.chunks)

    def _run(self, step: _Step, kind: str, c: int, i: int) -> None:
        """One forward or backward, its time outside receives counted as busy; the
        sends completed by then dropped first (see [Note: sent outputs])."""
        step.sends = [handle for handle in step.sends if not handle.test()]
        idle, t0 = self.idle_seconds, time.perf_counter()
        (self._forward if kind == "F" else self._backward)(step, c, i)
        self.busy_seconds += time.perf_counter() - t0 - (self.idle_seconds - idle)

    def _schedule(self, step: _Step) -> None:
        """The schedule's order over the stages, communicating no gradients over dp."""
        with self.strategy.no_sync():
            for kind, c, i in self.order():
                self._run(step, kind, c, i)

    def _recv(self, buf, source: int, tag: int) -> None:
        t0 = time.perf_counter()
        self.pp.recv(buf, source, tag)
        self.idle_seconds += time.perf_counter() - t0

    # [Note: scattered pipeline messages]
    # Without sequence parallelism every tp rank holds the same (N, C) activations
    # at a stage boundary, and the same gradient of them coming back. So, as
    # Megatron-LM does (Narayanan et al. 2021, arXiv:2104.04473, section 4.1,
    # "scatter/gather"), each tp rank sends only its block of rows (rank r: rows
    # sp_rows(N, tp)) to the same tp rank of the next stage, which receives it into
    # that block of its buffer and all-gathers the others over tp: 1/tp of the
    # bytes over the pipeline link, the rest over tp, the same values. Under
    # sequence parallelism the rows are split already; rows that do not divide
    # by tp go whole. The plan counts the same (_pp_bytes in
    # mpishard/planning/memory.py).
    def _scattered(self, rows: int) -> bool:
        """Whether a message of ``rows`` rows goes as tp blocks (see the note)."""
        tp = self.mesh.tp.size
        return tp > 1 and getattr(self.model, "sequence_parallel_size", 1) == 1 \
            and rows % tp == 0

    def _rows_to_send(self, array):
        """``array`` itself, or this tp rank's block of its rows (a view)."""
        if not self._scattered(array.shape[0]):
            return array
        block = array.shape[0] // self.mesh.tp.size
        return array[self.mesh.tp.rank * block:(self.mesh.tp.rank + 1) * block]

    def _recv_rows(self, buf, source: int, tag: int) -> None:
        """Receive ``buf`` whole, or this tp rank's block of it and the rest gathered."""
        if not self._scattered(buf.shape[0]):
            self._recv(buf, source, tag)
            return
        mine = self._rows_to_send(buf)
        self._recv(mine, source, tag)
        self.mesh.tp.all_gather(mine, recv=buf)       # in place: mine is buf's block

    # -- the step ---------------------------------------------------------------
    def train_step(self, x, y) -> float:
        """Forward and backward of one batch on this rank's stage; returns the mean loss.

        Every rank of the pipeline must pass the same ``x``, ``y``. Gradients are
        left for ``strategy.step(...)`` to reduce; tied parameters are summed here.
        """
        return float(self.forward_backward(x, y))

    def forward_backward(self, x, y) -> StepLoss:
        """:meth:`train_step` with the loss not yet read: read it after
        ``strategy.step(...)`` (``float(loss)``, on every rank of the pipeline)."""
        step = self._prepare(x, y, self.micro_batches)
        m = self.micro_batches
        t0 = time.perf_counter()
        self.activation_bytes = 0
        if self.stages == 1:  # plain accumulation: the last backward communicates (overlap)
            for i, context in enumerate(self.strategy.accumulation(m)):
                with context:
                    self._run(step, "F", 0, i)
                    self._run(step, "B", 0, i)
        else:  # tied copies are summed first, then step() reduces over dp
            self._schedule(step)
        for handle in step.sends:
            handle.wait()
        self._sum_tied_gradients()
        self.step_seconds = time.perf_counter() - t0
        if self.measure_activations:  # the peak stays in the ledger; nothing is alive now
            self.strategy.ledger.record_activations(self.activation_bytes)
            self.strategy.ledger.release_activations()
        losses, weights = step.losses, step.weights
        return StepLoss(lambda: self._mean_loss(losses, weights))

    def eval_step(self, x, y) -> float:
        """Forward only (no graph); returns the mean loss. Micro-batch by micro-batch,
        as in training, so that a loss over a micro-batch's rows (a mixture of experts'
        load-balancing loss, its capacity) is the same for every split of the same
        global batch over dp ranks and micro-batches; one stage takes a batch that
        does not split into them (a whole validation set) at once."""
        m = self.micro_batches if self.stages > 1 or len(x) % self.micro_batches == 0 else 1
        step = self._prepare(x, y, m)
        forwards = [(c, i) for kind, c, i in self.order() if kind == "F"] \
            if self.stages > 1 else [(0, i) for i in range(m)]
        with no_grad():
            for c, i in forwards:    # the training order's forwards: no deadlock
                self._run_forward(step, c, i)
                step.saved.pop((c, i))
        for handle in step.sends:
            handle.wait()
        return self._mean_loss(step.losses, step.weights)

    def _prepare(self, x, y, m: int) -> _Step:
        B = len(x)
        if B % m:
            raise ValueError(f"batch of {B} does not split into {m} micro-batches; pick a "
                             f"batch size that is a multiple of micro_batches")
        b = B // m
        self.idle_seconds = self.busy_seconds = 0.0
        step = _Step([x[k * b:(k + 1) * b] for k in range(m)],
                     [y[k * b:(k + 1) * b] for k in range(m)], b,
                     int(np.shape(x)[1]) if np.ndim(x) > 1 else 1)
        step.weights = self._loss_weights(step.y) if self.last else [1.0 / m] * m
        return step

    # [Note: global token count]
    # A micro-batch's loss is the mean over its valid targets (those not equal to
    # the loss's ignore_index), and gradients are averaged over the G ranks of
    # dp x cp. Weighting micro-batch i's loss by w_i = n_i * G / N, with n_i its
    # valid targets and N the count over every micro-batch of every rank of the
    # group (one all-reduce of a number), makes the averaged gradient that of the
    # mean over all N targets, however unevenly they fall (padding, a context
    # chunk of ignored targets); plain 1/m weights would average means instead.
    # With every target valid w_i is exactly 1/m.
    def _loss_weights(self, ys) -> list:
        m = len(ys)
        group = getattr(self.mesh, "dp_cp", None) or self.mesh.dp
        ignore = getattr(getattr(self.model, "loss", None), "ignore_index", -100)
        if all(isinstance(y, (np.ndarray, list)) for y in ys):   # host targets: count there
            counts = [int(np.count_nonzero(np.asarray(y) != ignore)) for y in ys]
        else:  # targets on the device: one read of all the counts
            xp = xp_of(next(y for y in ys if not isinstance(y, (np.ndarray, list))))
            counts = to_numpy(xp.stack([(xp.asarray(y) != ignore).sum() for y in ys])).tolist()
        total = np.array([float(sum(counts))])
        if group.size > 1:
            group.all_reduce(total, op="sum")
        if total[0] == 0 or all(c * group.size * m == total[0] for c in counts):
            return [1.0 / m] * m
        return [c * group.size / total[0] for c in counts]

    def _mean_loss(self, losses: list, weights: list) -> float:
        """The step's loss: the micro-batches' ``losses`` read back at once (one host sync
        on a device), weighted, and broadcast from the last stage."""
        mean = 0.0
        if losses:
            losses = to_numpy(xp_of(losses[0]).stack(losses)).astype(np.float64)
            uniform = all(w == 1.0 / len(weights) for w in weights)
            # a micro-batch without a valid target has a mean of none (nan) and weight 0
            kept = np.where(np.asarray(weights) == 0, 0.0, losses)
            mean = np.mean(losses) if uniform else float(np.dot(kept, weights))
        loss = np.array([mean])
        self.pp.broadcast(loss, root=self.stages - 1)
        return float(loss[0])

    def _sum_tied_gradients(self) -> None:
        if self.tie is None:
            return
        for p in self.tied:
            dtype = p.grad_dtype or self._dtype  # float32 under mixed precision (see Tensor)
            grad = self._xp.zeros(p.shape, dtype=dtype) if p.grad is None else \
                self._xp.ascontiguousarray(p.grad, dtype=dtype)
            self.tie.all_reduce(grad, op="sum")
            p.grad = grad

    @property
    def idle_fraction(self) -> float:
        """Share of the last step this stage spent waiting for its neighbours' messages."""
        return self.idle_seconds / self.step_seconds if self.step_seconds else 0.0

    @property
    def bubble(self) -> float:
        """The last step's time outside forwards and backwards over the time in them,
        ``(step - busy) / busy``: the bubble as Narayanan et al. count it, ``(p - 1) /
        (V m)`` for an ideal pipeline (with the step's own communication on top)."""
        busy = self.busy_seconds
        return (self.step_seconds - busy) / busy if busy else 0.0

"""Pipeline parallelism: whole blocks per stage, micro-batches, GPipe and 1F1B.

    mpiexec -n 4 python -m mpi4py -m mpishard train --pp 2 --dp 2 --micro-steps 4

Stage ``s`` of ``mesh.pp`` holds a contiguous run of blocks (the first stage also
the embeddings, the last the final norm and the output layer). A step splits the
batch into ``m`` micro-batches; activations ``(b*T, C)`` go forward and their
gradients back with point-to-point messages whose shapes every stage knows from
the batch, tagged ``2*i`` (activations of micro-batch ``i``) and ``2*i + 1``
(gradients), so no two messages can be confused.

- GPipe (Huang et al., 2019, arXiv:1811.06965): all forwards, then all backwards.
- 1F1B (PipeDream-Flush; Narayanan et al., 2021, arXiv:2104.04473): stage ``s``
  runs ``p - s - 1`` warm-up forwards, then alternates one forward and one
  backward, then drains; the same bubble, at most ``p - s`` micro-batches of
  activations alive instead of ``m``.

The bubble, the idle fraction of an ideal pipeline, is ``(p - 1) / (m + p - 1)``.
Gradients are communicated once after the last micro-batch: the tied token
table's two copies (first and last stage) are summed, then the strategy
reduces over dp in ``step``. Activations and their gradients stay in the
model's array module (device memory on CuPy); the communicator sends them
directly (CUDA-aware MPI) or through its pinned staging buffers.
"""
from __future__ import annotations

import time

import numpy as np

from ..autodiff.tensor import Tensor, no_grad

__all__ = ["partition_blocks", "Pipeline", "bubble_fraction"]


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The ideal pipeline's idle fraction, ``(p - 1) / (m + p - 1)``."""
    return (stages - 1) / (micro_batches + stages - 1)


def partition_blocks(n_layer: int, stages: int, block_params: int = 1, first_extra: int = 0,
                     last_extra: int = 0, plan=None) -> list[range]:
    """Split ``n_layer`` blocks into ``stages`` contiguous runs.

    Balanced by parameter count: each block counts ``block_params``, the first
    stage also ``first_extra`` (embeddings), the last ``last_extra`` (final
    norm); the split minimises the largest stage. ``plan`` (blocks per stage,
    e.g. ``[1, 3]``) overrides it.

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
        # best[k][j]: smallest possible largest stage using stages 0..k for blocks 0..j-1
        inf = float("inf")
        best = [[inf] * (n_layer + 1) for _ in range(stages)]
        cut = [[0] * (n_layer + 1) for _ in range(stages)]
        for j in range(1, n_layer + 1):
            best[0][j] = first_extra + j * block_params + (last_extra if stages == 1 else 0)
        for k in range(1, stages):
            for j in range(k + 1, n_layer + 1):
                for i in range(k, j):
                    cost = (j - i) * block_params + (last_extra if k == stages - 1 else 0)
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


class Pipeline:
    """Drive one step of micro-batches through the stages (any ``pp``, also 1).

    Args:
        strategy: the stage's model wrapped in a strategy (DataParallel/ZeRO);
            its module is a GPT stage (``first_stage``/``last_stage``).
        mesh: the :class:`~mpishard.comm.Mesh`.
        micro_batches: ``m >= 1``; the per-rank batch must divide by it.
        schedule: ``"1f1b"`` or ``"gpipe"``.
        tie: Communicator joining this rank with the other end of the pipeline
            (first <-> last stage) for the tied token table, or ``None``.
    """

    def __init__(self, strategy, mesh, micro_batches: int = 1, schedule: str = "1f1b",
                 tie=None):
        if schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"unknown pipeline schedule {schedule!r}; use '1f1b' or 'gpipe'")
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
        self.strategy, self.mesh, self.pp = strategy, mesh, mesh.pp
        self.model = strategy.module
        self.micro_batches, self.schedule, self.tie = micro_batches, schedule, tie
        self.stage, self.stages = self.pp.rank, self.pp.size
        self.idle_seconds = 0.0
        self.step_seconds = 0.0
        self._dtype = strategy.compute_dtype  # activations cross stages in it
        self._xp = self.model.backend.xp
        #: set to measure the next training step's activations (see [Note: measured activations])
        self.measure_activations = False
        self.activation_bytes = 0
        self._alive: dict = {}

    # [Note: measured activations]
    # With measure_activations set, each micro-batch's forward runs inside the
    # ledger's measure_activations() (tracemalloc on NumPy: slower, so one step
    # at a time) and its bytes count as alive until its backward starts. The
    # step's peak of that sum, what the schedule keeps at once (all m
    # micro-batches under GPipe, at most p - s under 1F1B), becomes the ledger's
    # "activations" peak and ``activation_bytes``.
    def _forward(self, i: int) -> None:
        if not self.measure_activations:
            return self._run_forward(i)
        with self.strategy.ledger.measure_activations() as measured:
            self._run_forward(i)
        self._alive[i] = measured.nbytes
        self.activation_bytes = max(self.activation_bytes, sum(self._alive.values()))

    # -- one micro-batch ------------------------------------------------------
    def _run_forward(self, i: int) -> None:
        x, y = self._x[i], self._y[i]
        if self.model.first_stage:
            inp = x
        else:
            buf = self._xp.empty((self._rows, self.model.config.n_embd), dtype=self._dtype)
            self._recv(buf, self.stage - 1, 2 * i)
            inp = Tensor(buf, requires_grad=True)
        if self.model.last_stage:
            _, loss = self.strategy(inp, y, batch_size=self._b) if not self.model.first_stage \
                else self.strategy(inp, y)
            self._losses.append(loss.item())
            self._saved[i] = (inp, self.strategy.scale_loss(loss) * (1.0 / self.micro_batches))
        else:
            out = self.strategy(inp) if self.model.first_stage else \
                self.strategy(inp, batch_size=self._b)
            send = self._xp.ascontiguousarray(out.data)
            self._sends.append(self.pp.isend(send, self.stage + 1, 2 * i))
            self._saved[i] = (inp, out)

    def _backward(self, i: int) -> None:
        self._alive.pop(i, None)
        inp, out = self._saved.pop(i)
        if self.model.last_stage:
            out.backward()
        else:
            grad = self._xp.empty(out.shape, dtype=self._dtype)
            self._recv(grad, self.stage + 1, 2 * i + 1)
            out.backward(grad)
        if not self.model.first_stage:
            send = self._xp.zeros(inp.shape, self._dtype) if inp.grad is None else \
                self._xp.ascontiguousarray(inp.grad, dtype=self._dtype)
            self._sends.append(self.pp.isend(send, self.stage - 1, 2 * i + 1))

    def _recv(self, buf, source: int, tag: int) -> None:
        t0 = time.perf_counter()
        self.pp.recv(buf, source, tag)
        self.idle_seconds += time.perf_counter() - t0

    # -- the step ---------------------------------------------------------------
    def train_step(self, x, y) -> float:
        """Forward and backward of one batch on this rank's stage; returns the mean loss.

        Every rank of the pipeline must pass the same ``x``, ``y``. Gradients are
        left for ``strategy.step(...)`` to reduce; the tied token table is summed
        here.
        """
        m = self._prepare(x, y)
        t0 = time.perf_counter()
        self.activation_bytes, self._alive = 0, {}
        with self.strategy.no_sync():
            if self.schedule == "gpipe" or self.stages == 1:
                for i in range(m):
                    self._forward(i)
                for i in range(m):
                    self._backward(i)
            else:
                warmup = min(self.stages - self.stage - 1, m)
                for i in range(warmup):
                    self._forward(i)
                for i in range(m - warmup):
                    self._forward(warmup + i)
                    self._backward(i)
                for i in range(m - warmup, m):
                    self._backward(i)
        for handle in self._sends:
            handle.wait()
        self._sends = []
        self._sum_tied_gradients()
        self.step_seconds = time.perf_counter() - t0
        if self.measure_activations:  # the peak stays in the ledger; nothing is alive now
            self.strategy.ledger.record_activations(self.activation_bytes)
            self.strategy.ledger.release_activations()
        return self._mean_loss()

    def eval_step(self, x, y) -> float:
        """Forward only (no graph), micro-batch by micro-batch; returns the mean loss."""
        m = self._prepare(x, y)
        with no_grad():
            for i in range(m):
                self._run_forward(i)
                self._saved.pop(i)
        for handle in self._sends:
            handle.wait()
        self._sends = []
        return self._mean_loss()

    def _prepare(self, x, y) -> int:
        B, m = len(x), self.micro_batches
        if B % m:
            raise ValueError(f"batch of {B} does not split into {m} micro-batches; pick a "
                             f"batch size that is a multiple of micro_batches")
        self._b = B // m
        self._rows = self._b * np.shape(x)[1]
        self._x = [x[k * self._b:(k + 1) * self._b] for k in range(m)]
        self._y = [y[k * self._b:(k + 1) * self._b] for k in range(m)]
        self._saved, self._sends, self._losses = {}, [], []
        self.idle_seconds = 0.0
        return m

    def _mean_loss(self) -> float:
        loss = np.array([np.mean(self._losses) if self._losses else 0.0])
        self.pp.broadcast(loss, root=self.stages - 1)
        return float(loss[0])

    def _sum_tied_gradients(self) -> None:
        if self.tie is None:
            return
        p = self.model.transformer.wte.weight
        dtype = p.grad_dtype or self._dtype  # float32 under mixed precision (see Tensor)
        grad = self._xp.zeros(p.shape, dtype=dtype) if p.grad is None else \
            self._xp.ascontiguousarray(p.grad, dtype=dtype)
        self.tie.all_reduce(grad, op="sum")
        p.grad = grad

    @property
    def idle_fraction(self) -> float:
        """Share of the last step this stage spent waiting for its neighbours."""
        return self.idle_seconds / self.step_seconds if self.step_seconds else 0.0


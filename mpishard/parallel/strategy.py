"""The strategy contract, the one registry of strategies, and the step every strategy shares.

A strategy wraps a model once. The training loop then reads like the
single-process one::

    model = ZeRO(GPT(cfg, materialize_now=False), mesh, stage=3)
    opt = AdamW(model.parameters(), lr=3e-4, ledger=model.ledger)
    for step in range(steps):
        for micro in range(accum):
            with model.no_sync(micro < accum - 1):     # communicate on the last only
                _, loss = model(x[micro], y[micro])
                (loss * (1.0 / accum)).backward()
        result = model.step(opt, max_norm=1.0)          # reduce, clip, update, zero

[Note: strategy contract]
Everything outside a strategy -- the trainer, the checkpoint package, the
planner, the CLI -- talks to it through these verbs and nothing else:

==================  ================================================================
``parameters()``    the optimizer's targets (parameters, flat shards or masters)
forward hooks       registered on the module in ``__init__`` (gather, settle, ...)
``reduce_grads()``  finish this step's gradient communication
``local_grad_sq()`` this rank's share of the squared global norm ([Note: counted once])
``scale_grads(f)``  multiply the optimizer targets' gradients (unscale, clip)
``after_update()``  after the optimizer ran: refresh compute copies, re-gather
``pieces(opt)``     what this rank holds, as pieces of global tensors ([Note: pieces])
``after_load()``    after checkpoint pieces were written into the buffers
``state_dict()``    counters and loss scale for the manifest; ``load_state_dict``
==================  ================================================================

A strategy is listed once, with :func:`register_strategy`, in
:data:`STRATEGIES`; config validation, ``mpishard train``/``estimate``,
:func:`~mpishard.parallel.wrap_model`, the planner and checkpoints all find it
there. A new strategy is one class (this base gives it the step, clipping,
accumulation and replicated checkpoint pieces) plus that one line, which also
tells the planner, as data, what it keeps sharded between steps (:class:`Sharded`).

[Note: collective step decisions]
Clipping and the non-finite check must come out the same on every rank, or
ranks would diverge (or one would skip a collective and the others hang). So
the squared gradient norm is combined with one all-reduce that also carries a
"model changed" flag; every rank then computes the same norm, the same clip
coefficient and the same skip decision. A skipped step leaves parameters and
optimizer state bit-unchanged and is counted in ``skipped_steps``.

[Note: device step decisions]
On a device (CuPy, or the strict module standing in for it) :meth:`Strategy.step`
reads nothing back between its first launch and its last, so that a step can be
captured as a CUDA graph and the host never waits for the device inside it:

* the squared norm stays a 0-d float64 device array (``grad_sq_sum``), is all-reduced
  on the device (staged through host buffers where MPI is not CUDA-aware: moved, not
  read), and the norm, the unscale-and-clip factor ``min(1, max_norm / (norm +
  1e-6)) / scale`` and the overflow flag ``not isfinite(norm)`` are 0-d device arrays
  computed in float64 with the host's operations in the host's order (the same bits);
* the optimizer gets ``step(grad_scale=factor, skip=overflow)``: Adam's kernel reads
  the factor, its step size and bias correction (its step count kept on the device)
  and the flag from device memory and returns at once where the flag is set, so a
  skipped step leaves everything bit-unchanged. ``after_update`` runs either way (it
  re-gathers and re-casts unchanged masters). An optimizer without ``skip`` (SGD, or
  another library's) gets the flag read on the host: one read;
* the dynamic loss scale and its clean-step count are device arrays updated with
  ``where`` (:class:`~mpishard.parallel.precision.LossScaler`), and ``scale_loss``
  multiplies by the device scale;
* what the host wants to know -- the norm and ``skipped`` of the returned
  :class:`StepResult`, ``skipped_steps``, the optimizer's ``step_count``, the scale --
  is read when asked, after the step (one read of the norm and the flag together);
* the "model changed" check is a host flag: all-reduced on the host, on its own.

The loss is read after the step too (:meth:`~mpishard.parallel.ParallelModel.
forward_backward`). Host arrays (NumPy) take the host path above, unchanged.

[Note: counted once]
The norm all-reduce runs over the whole mesh (dp x tp x pp), so every element
of the model's gradient must be added by exactly one rank: a dp replica only on
dp rank 0 (DataParallel; ZeRO shards are disjoint), a tensor replicated over tp
(layer norms, row-parallel biases, position embeddings) only on tp rank 0, and a
tied copy on another pipeline stage (``spec.replica``) never.
"""
from __future__ import annotations

import contextlib
import enum
import inspect
import math
from dataclasses import dataclass, field

import numpy as np

from mpishard.core.backend import MemoryLedger, to_numpy, xp_of
from mpishard.core.dtypes import resolve_dtype
from mpishard.nn.init import materialize
from mpishard.optim.clip import clip_coefficient
from mpishard.parallel.pieces import gather_full_params, replicated_pieces
from mpishard.parallel.precision import LossScaler, Precision

__all__ = ["Strategy", "StepResult", "Sharded", "StrategyEntry", "STRATEGIES",
           "register_strategy", "strategy_entry"]


class StepResult:
    """What :meth:`Strategy.step` did: the global gradient norm before clipping,
    whether the update was skipped (non-finite gradients), and the step count.

    On a device the norm and the skip flag stay there until ``grad_norm`` or
    ``skipped`` is first read: one read of both, after the step (see [Note: device
    step decisions])."""

    def __init__(self, grad_norm, skipped, step: int, on_read=None):
        self._values = None if on_read is not None else (float(grad_norm), bool(skipped))
        self._pending, self._on_read, self.step = (grad_norm, skipped), on_read, step

    def _read(self) -> tuple:
        if self._values is None:
            norm, skipped = self._on_read(*self._pending)
            self._values, self._pending = (float(norm), bool(skipped)), None
        return self._values

    @property
    def grad_norm(self) -> float:
        return self._read()[0]

    @property
    def skipped(self) -> bool:
        return self._read()[1]

    def __eq__(self, other):
        return isinstance(other, StepResult) and (self.grad_norm, self.skipped, self.step) == \
            (other.grad_norm, other.skipped, other.step)

    def __repr__(self) -> str:
        return f"StepResult(grad_norm={self.grad_norm}, skipped={self.skipped}, step={self.step})"


class Sharded(enum.IntEnum):
    """What a strategy keeps sharded between steps: ZeRO's stages, each adding to the last."""
    NOTHING = 0            # every rank holds everything (DDP)
    OPTIMIZER_STATE = 1    # ZeRO-1
    GRADIENTS = 2          # + gradients: ZeRO-2
    PARAMETERS = 3         # + parameters, gathered per unit to compute: ZeRO-3 / FSDP


@dataclass(frozen=True)
class StrategyEntry:
    """One line of :data:`STRATEGIES`: a name, the class, the options the name implies,
    and what it keeps sharded between steps (:class:`Sharded`, read by the planner).

    ``build(module, mesh, **kwargs)`` is ``cls(module, mesh, **options, **kwargs)``.
    """

    name: str
    cls: type
    summary: str
    options: dict = field(default_factory=dict)
    keeps_sharded: Sharded = Sharded.NOTHING

    def build(self, module, mesh, **kwargs):
        return self.cls(module, mesh, **self.options, **kwargs)


#: name -> :class:`StrategyEntry`, in registration order (see [Note: strategy contract])
STRATEGIES: dict[str, StrategyEntry] = {}


def register_strategy(name: str, summary: str, keeps_sharded: Sharded = Sharded.NOTHING,
                      **options):
    """Class decorator: list a :class:`Strategy` under ``name`` in :data:`STRATEGIES`.

    ``keeps_sharded`` is a :class:`Sharded` level; ``options`` are the keyword arguments
    the name stands for (``zero2`` is ``ZeRO`` with ``stage=2``). Registering a name
    twice is an error.
    """
    if not name or not isinstance(name, str):
        raise ValueError(f"strategy name {name!r} must be a non-empty string")
    if isinstance(keeps_sharded, bool) or keeps_sharded not in list(Sharded):
        levels = ", ".join(f"Sharded.{level.name}" for level in Sharded)
        raise ValueError(f"strategy {name!r}: keeps_sharded={keeps_sharded!r} is not a "
                         f"level of Sharded; pass one of {levels}")

    def register(cls):
        if name in STRATEGIES and STRATEGIES[name].cls is not cls:
            raise ValueError(f"strategy {name!r} is already registered "
                             f"({STRATEGIES[name].cls.__name__}); pick another name")
        STRATEGIES[name] = StrategyEntry(name, cls, summary, dict(options),
                                         Sharded(keeps_sharded))
        return cls
    return register


def strategy_entry(name: str) -> StrategyEntry:
    """The registered strategy ``name``, or a ValueError listing the registered ones."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; use one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


class Strategy:
    """Base class of every strategy: the contract's shared half (see [Note: strategy contract]).

    Subclasses implement :meth:`parameters`, :meth:`reduce_grads` and
    :meth:`local_grad_sq`, and override :meth:`after_update`, :meth:`pieces` and
    :meth:`optimizer_target` where they keep something other than whole replicated
    parameters.

    An unmaterialised model is materialised from ``seed`` (default
    ``module.seed``) before the subclass sees it, unless the class sets
    ``materializes_shards`` (ZeRO materialises straight into its flat shards).
    ``precision`` (a name or a :class:`Precision`) sets mixed precision; see
    [Note: mixed precision] in precision.py. Subclasses read ``master_dtype``
    (the model's dtype: master weights, optimizer state), ``compute_dtype``
    and ``reduce_dtype``, and ``mixed`` (whether the first two differ).
    """

    #: the class materialises deferred parameters itself (into shards)
    materializes_shards = False
    #: gradient reductions in flight before backward waits for the oldest (``None``: no
    #: limit); the planner counts their buffers
    max_inflight_reductions: int | None = None

    def __init__(self, module, mesh, ledger: MemoryLedger | None = None, precision=None,
                 seed: int | None = None):
        if not hasattr(mesh, "dp"):
            raise TypeError(f"{type(self).__name__} takes a mpishard Mesh, got "
                            f"{type(mesh).__name__}; build one: Mesh(Communicator("
                            f"MPI.COMM_WORLD)) for data parallelism over every rank")
        self.module = module
        self.mesh = mesh
        # every rank holding these parameters: dp x cp (see [Note: mesh layout])
        self.dp = getattr(mesh, "dp_cp", mesh.dp)
        backend = getattr(module, "backend", None)
        self.seed = getattr(module, "seed", 0) if seed is None else seed
        if not self.materializes_shards and any(p.data is None for p in module.parameters()):
            materialize(module, self.seed, backend)
        self.ledger = ledger or (backend.ledger if backend is not None else MemoryLedger())
        self.sync_gradients = True
        self.steps = 0
        self._skipped = 0        # a host int, or a 0-d device array (see skipped_steps)
        self._param_ids = [id(p) for p in module.parameters()]
        self.precision = Precision.of(precision)
        self.xp = backend.xp if backend is not None else np
        params = module.parameters()
        self.master_dtype = resolve_dtype(params[0].spec.dtype) if params else np.dtype("float32")
        self.mixed = self.precision.mixed
        self.compute_dtype = (resolve_dtype(self.precision.param_dtype, self.xp) if self.mixed
                              else self.master_dtype)
        self.reduce_dtype = (resolve_dtype(self.precision.reduce_dtype, self.xp) if self.mixed
                             else self.master_dtype)
        self.scaler = LossScaler(self.precision, self.xp)
        if self.mixed:  # every gradient contribution is added in reduce_dtype, not 16 bits
            for p in params:
                p.grad_dtype = self.reduce_dtype
        for p in params:   # no gradient buffers of an earlier wrapper (DDP sets its own)
            p.grad_out = None
        self._backward_since_step = False       # see _check_model
        self.stepping = False    # inside step(): its optimizer's step is ours (see Targets)
        for p in params:
            if p.requires_grad:
                p.register_grad_ready_hook(self._saw_backward)

    def _saw_backward(self, p) -> None:
        self._backward_since_step = True

    # -- forward / modes ----------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    @contextlib.contextmanager
    def no_sync(self, skip: bool = True):
        """Within the block, backward accumulates local gradients and communicates nothing.

        ``with model.no_sync(micro < accum - 1):`` communicates on the last
        micro-step only; ``no_sync(False)`` is a no-op so the loop needs no branch.
        """
        previous = self.sync_gradients
        self.sync_gradients = previous and not skip
        try:
            yield self
        finally:
            self.sync_gradients = previous

    def accumulation(self, micro_steps: int) -> list:
        """``micro_steps`` contexts: all but the last skip gradient communication.

        ``for ctx in model.accumulation(4): with ctx: (loss / 4).backward()``
        """
        if not isinstance(micro_steps, int) or micro_steps < 1:
            raise ValueError(f"gradient accumulation needs micro_steps >= 1, got "
                             f"{micro_steps!r}")
        return [self.no_sync(i < micro_steps - 1) for i in range(micro_steps)]

    # -- the contract: to implement -------------------------------------------
    def parameters(self) -> list:
        """The optimizer's targets (full parameters, or this rank's flat shards)."""
        raise NotImplementedError

    def reduce_grads(self) -> None:
        """Finish all gradient communication for this step (launch what is left, wait)."""
        raise NotImplementedError

    def local_grad_sq(self) -> float:
        """This rank's share of the squared global gradient norm (see [Note: counted once])."""
        raise NotImplementedError

    # -- the contract: defaults -------------------------------------------------
    def scale_grads(self, factor: float) -> None:
        """Multiply every optimizer target's gradient by ``factor`` (unscaling, clipping):
        a Python float, or a 0-d device array (cast to each gradient's dtype first, as a
        Python float would be)."""
        for p in self.parameters():
            if p.grad is not None:
                p.grad *= factor.astype(p.grad.dtype) if hasattr(factor, "astype") else factor

    def after_update(self) -> None:
        """Runs after the optimizer updated this rank's targets (ZeRO-1/2 all-gather,
        16-bit copies refreshed from their masters)."""

    def after_load(self) -> None:
        """Runs after a checkpoint filled :meth:`pieces`: by default as after an update."""
        self.after_update()

    def optimizer_target(self, p):
        """What the optimizer updates for parameter ``p`` (``p`` itself, or its master)."""
        return p

    def pieces(self, optimizer=None) -> list:
        """What this rank holds of parameters and optimizer state, as :class:`Piece`\\ s.

        The default: every parameter whole, owned by dp rank 0 (a replicated model).
        """
        return replicated_pieces(self, optimizer)

    def describe(self) -> dict:
        """``{"name": class name, "stage": ZeRO stage or None}`` for checkpoint manifests."""
        return {"name": type(self).__name__, "stage": None}

    def state_dict(self) -> dict:
        """Step counters and the loss scale (what a checkpoint keeps of the strategy)."""
        return {**self.describe(), "steps": int(self.steps),
                "skipped_steps": int(self.skipped_steps),
                "precision": {"compute_dtype": self.compute_dtype.name,
                              "loss_scale": self.scaler.state_dict()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s counters; a dynamic loss scale only from a
        checkpoint that had one (see :class:`LossScaler`)."""
        self.steps = int(state["steps"])
        self.skipped_steps = int(state["skipped_steps"])
        saved = (state.get("precision") or {}).get("loss_scale")
        if saved:
            self.scaler.load_state_dict(saved)

    # -- provided ---------------------------------------------------------------
    def gather_full_params(self) -> dict:
        """Name -> whole parameter (host NumPy) on every rank; see :func:`pieces.gather_full_params`."""
        return gather_full_params(self)

    def scale_loss(self, loss):
        """``loss`` times the current loss scale (itself when there is none): call
        ``backward()`` on this. :meth:`step` divides the scale out again. A dynamic
        scale on a device multiplies as a device scalar of the loss's dtype (no read)."""
        if self.scaler.on_device:
            return loss * self.scaler.device_scale(loss.data.dtype)
        return loss if self.scaler.scale == 1.0 else loss * self.scaler.scale

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients (on a device: one read, after the step)."""
        if not isinstance(self._skipped, int):
            self._skipped = int(self._skipped)
        return self._skipped

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped = int(value)

    def zero_grad(self) -> None:
        self._backward_since_step = False
        for p in self.module.parameters():
            p.grad = None
        for p in self.parameters():
            p.grad = None

    def _model_changed(self) -> bool:
        return [id(p) for p in self.module.parameters()] != self._param_ids

    def replica_group(self, p):
        """The ranks holding the same values of parameter ``p`` as this one: ``dp x cp``,
        or for an expert split over ep, the ranks holding the same experts (``edp``)."""
        if p.spec.ep_range is not None:
            return self.mesh.edp
        return self.dp

    def counts_once(self, spec) -> bool:
        """Whether this rank adds a parameter's gradient to norms (see [Note: counted once])."""
        if spec.replica:
            return False
        return spec.tp_dim is not None or self.mesh.tp.rank == 0

    def _check_model(self, changed: float, flags=None) -> None:
        """All-reduce whether the model changed and whether this rank saw a backward since
        the last step (with the host ``flags`` they ride on, or alone) and raise on every
        rank if the model changed on any, or, inside :meth:`step`, no rank saw a backward
        (a rank may see none: a pipeline stage whose parameters are all frozen)."""
        if flags is None:
            flags = np.array([changed, 0.0])
        flags[-2:] = changed, float(self._backward_since_step or not self.stepping)
        self.mesh.world.all_reduce(flags, op="sum")
        if flags[-2] > 0:
            raise RuntimeError(
                "the model's parameters changed after it was wrapped (a parameter was "
                "added, removed or replaced); build the model completely, then wrap it once")
        if flags[-1] == 0:
            self.zero_grad()
            raise RuntimeError(f"{type(self).__name__}.step: no backward since the last step "
                               f"or zero_grad, so no gradients to apply (an update would "
                               f"still decay the weights and count a step); run "
                               f"loss.backward() (or forward_backward) first")

    def grad_norm(self):
        """Global gradient norm, the same on every rank. See [Note: collective step decisions].

        A Python float; with the strategy on a device a 0-d float64 device array (+inf
        for any non-finite value), never read here (see [Note: device step decisions]).
        """
        sq = self.local_grad_sq()
        changed = float(self._model_changed())
        if self.xp is np:
            # +inf stands for any non-finite value (NaN + x stays NaN, but is harder to read)
            flags = np.array([sq if math.isfinite(sq) else math.inf, 0.0, 0.0])
            self._check_model(changed, flags)
            return math.sqrt(flags[0])
        self._check_model(changed)          # a host flag: no read of the device
        xp = self.xp
        sq = xp.full((), sq, dtype=np.float64) if isinstance(sq, float) else sq
        total = xp.where(xp.isfinite(sq), sq, math.inf).reshape(1)
        self.mesh.world.all_reduce(total, op="sum")
        return xp.sqrt(total[0])

    def grad_factor(self, max_norm: float | None) -> tuple:
        """``(norm, factor)``: the unscaled global gradient norm, and what to multiply
        the gradients by to divide out the loss scale and clip to ``max_norm`` (1.0
        when the norm is not finite: the step is skipped). On a device both are 0-d
        float64 device arrays (the factor then meaningless where the norm is not
        finite: the update is skipped on the device)."""
        scale = self.scaler.scale_value()
        if self.xp is np:
            norm = self.grad_norm() / scale
            factor = 1.0
            if math.isfinite(norm):
                factor = 1.0 / scale
                if max_norm is not None:
                    factor *= clip_coefficient(norm, max_norm)
            return norm, factor
        norm = self.grad_norm()
        if not (isinstance(scale, float) and scale == 1.0):
            norm = norm / scale
        factor = 1.0 / scale
        if max_norm is not None:
            factor = factor * clip_coefficient(norm, max_norm, self.xp)
        elif isinstance(factor, float):
            factor = self.xp.full((), factor, dtype=np.float64)
        return norm, factor

    def _check_optimizer(self, optimizer) -> None:
        """Refuse an optimizer whose targets are not this strategy's (once per optimizer).

        Built from the model before wrapping, it would update arrays the strategy
        overwrites or never reads (ZeRO's shards, mixed precision's masters).
        """
        if getattr(self, "_checked_optimizer", None) is optimizer:
            return
        mine = {id(t) for t in self.parameters()}
        stray = next((i for i, t in enumerate(optimizer.params) if id(t) not in mine), None)
        if stray is not None:
            raise ValueError(
                f"{type(optimizer).__name__}: target {stray} is not one of "
                f"{type(self).__name__}.parameters(); build the optimizer from the wrapped "
                f"model, after wrapping (e.g. AdamW(model.parameters()) with model the "
                f"strategy): ZeRO updates flat shards and mixed precision float32 masters")
        self._checked_optimizer = optimizer

    def step(self, optimizer, max_norm: float | None = None) -> StepResult:
        """Reduce gradients, unscale and clip (optional), update unless non-finite, zero gradients.

        A non-finite norm skips the update on every rank and, with a dynamic
        loss scale, halves the scale (see [Note: mixed precision]). On a device the
        decisions stay there (see [Note: device step decisions]).
        """
        self._check_optimizer(optimizer)
        self.stepping = True              # the optimizer's step is ours (see Targets)
        try:
            return self._reduce_and_update(optimizer, max_norm)
        finally:
            self.stepping = False

    def _reduce_and_update(self, optimizer, max_norm) -> StepResult:
        """:meth:`step` once its checks have passed."""
        self.reduce_grads()
        norm, factor = self.grad_factor(max_norm)
        if self.xp is not np:
            return self._device_step(optimizer, norm, factor)
        skipped = not math.isfinite(norm)
        if skipped:
            self.skipped_steps += 1
        else:
            if _takes_grad_scale(optimizer):       # the factor inside the update
                optimizer.step(grad_scale=factor)
            else:
                if factor != 1.0:
                    self.scale_grads(factor)
                optimizer.step()
            self.after_update()
        self.scaler.update(overflow=skipped)
        self.zero_grad()
        self.steps += 1
        return StepResult(norm, skipped, self.steps)

    def _device_step(self, optimizer, norm, factor) -> StepResult:
        """:meth:`step`'s update and bookkeeping with the norm and the factor on the device."""
        xp = self.xp
        overflow = ~xp.isfinite(norm)
        if _takes_grad_scale(optimizer, "skip"):
            optimizer.step(grad_scale=factor, skip=overflow)
        elif not bool(overflow):        # another optimizer: it decides on the host (a read)
            if _takes_grad_scale(optimizer):
                optimizer.step(grad_scale=factor)
            else:
                self.scale_grads(factor)
                optimizer.step()
        self.after_update()             # a skipped update left the masters as they were
        self._skipped = self._skipped + overflow
        self.scaler.update(overflow=overflow)
        self.zero_grad()
        self.steps += 1
        return StepResult(norm, overflow, self.steps, on_read=_read_pair)


def _read_pair(norm, overflow) -> tuple:
    """``(norm, overflow)`` of a device step, read back together (one sync)."""
    xp = xp_of(norm)
    norm, overflow = to_numpy(xp.stack([norm, overflow.astype(np.float64)])).tolist()
    return norm, overflow != 0.0


def _takes_grad_scale(optimizer, name: str = "grad_scale") -> bool:
    """Whether ``optimizer.step`` takes ``name`` (``grad_scale``, ``skip``: mpishard's
    optimizers do; another one, or a subclass with its own ``step()``, gets its
    gradients scaled first and is skipped by the host)."""
    try:
        return name in inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):
        return False

"""SGD, Adam and AdamW over flat arrays.

An optimizer updates *targets*: objects with ``data`` (an array updated in
place), ``grad`` (an array of the same size, or ``None`` to skip) and
``decay_ranges`` (flat element ranges of ``data`` that get weight decay). A
:class:`mpishard.nn.Parameter` is one; a ZeRO strategy hands in flat shards
that span several parameters, each with its own ranges, and the update is the
same elementwise math either way. Optimizer state is one flat array per target
and per kind (``exp_avg``, ...), so it shards with the target.

All arithmetic uses Python-float scalars so float32 state never promotes to
float64 (a NumPy float64 scalar times a float32 array computes in float64,
about 4x slower), and writes in place with ``out=``.

A strategy on a device decides a step there (see [Note: device step decisions] in
mpishard/parallel/strategy.py): ``step(grad_scale=factor, skip=overflow)`` with both
0-d device arrays. Adam and AdamW then count their steps on the device too (the bias
corrections are computed there) and hand the scalars to the kernel, which leaves every
target and its state unchanged where ``skip`` is set: nothing is read back.
``step_count`` reads the device count when asked. SGD decides on the host (one read).
"""
from __future__ import annotations

import math
import numbers
import weakref
from typing import Iterable

import numpy as np

from mpishard.core.backend import MemoryLedger, to_numpy, xp_of
from mpishard.core.dtypes import weak_scalar
from mpishard.kernels import kernels_for
from mpishard.kernels.cpu.threads import for_rows

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "Targets"]


class Targets(list):
    """The targets a strategy hands out (``model.parameters()`` of a DDP or ZeRO model), with
    the strategy (a weak reference): an optimizer built from them is that strategy's to
    step, and refuses a :meth:`Optimizer.step` outside the strategy's ``step`` (which
    reduces the gradients over the data-parallel ranks first: stepped directly, DDP's
    replicas drift apart and ZeRO's shards never see a gradient). Inside it, any
    wrapper's call reaches the optimizer as the strategy's."""

    def __init__(self, targets, owner):
        super().__init__(targets)
        self.owner = weakref.ref(owner)


class Optimizer:
    """Shared machinery: targets, hyper-parameters, flat state, (de)serialisation.

    Args:
        params: targets (see the module docstring), e.g. ``model.parameters()``.
        lr: learning rate; may be changed between steps (``opt.lr = ...``).
        ledger: optional memory ledger that counts the state ("optim").
    """

    state_names: tuple = ()

    def __init__(self, params: Iterable, lr: float, ledger: MemoryLedger | None = None):
        if hasattr(params, "parameters") and callable(params.parameters):
            raise TypeError(f"{type(self).__name__} takes the targets, not the model: pass "
                            f"model.parameters() (of the wrapped model, after wrapping)")
        self.params = list(params)
        if not self.params:
            raise ValueError(f"{type(self).__name__} got an empty parameter list")
        if isinstance(lr, bool) or not isinstance(lr, numbers.Real):
            raise TypeError(f"{type(self).__name__}: lr must be a number, got {lr!r}")
        if not lr >= 0.0:
            raise ValueError(f"{type(self).__name__}: lr must be >= 0, got {lr}")
        self.lr = float(lr)
        self.ledger = ledger
        self._owner = getattr(params, "owner", None)       # see Targets
        self._steps, self._device_steps = 0, None
        self.state: list[dict] = [{} for _ in self.params]

    @property
    def step_count(self) -> int:
        """Updates made so far (skipped steps not counted; on a device: one read)."""
        if self._device_steps is not None:
            self._steps, self._device_steps = int(self._device_steps), None
        return self._steps

    @step_count.setter
    def step_count(self, value: int) -> None:
        self._steps, self._device_steps = int(value), None

    def _count_on_device(self, skip):
        """This step's number as a 0-d float64 array of ``skip``'s module: the count so
        far plus one unless ``skip`` is set (kept on the device, see ``step_count``)."""
        xp = xp_of(skip)
        if self._device_steps is None:
            self._device_steps = xp.full((), float(self._steps), dtype=np.float64)
        self._device_steps = self._device_steps + xp.logical_not(skip)
        return self._device_steps

    def _decide_on_host(self, grad_scale, skip) -> tuple:
        """``(grad_scale, skip)`` with host arrays' values as Python numbers and, where
        this optimizer cannot skip on the device (``device_skip`` false, or its targets
        on the host), a device ``skip`` read (and for host targets its ``grad_scale``):
        ``skip`` is then ``None`` or a bool."""
        if hasattr(grad_scale, "shape") and isinstance(grad_scale, np.ndarray):
            grad_scale = float(grad_scale)
        if skip is None or isinstance(skip, (bool, np.ndarray, np.bool_)):
            return grad_scale, None if skip is None else bool(skip)
        on_host = xp_of(self.params[0].data) is np       # offloaded targets
        if self.device_skip and not on_host:
            return grad_scale, skip
        if on_host and hasattr(grad_scale, "shape"):
            grad_scale = float(grad_scale)
        return grad_scale, bool(skip)

    #: whether :meth:`step` takes a device ``skip`` flag without reading it
    device_skip = False

    def _state(self, i: int, name: str, like):
        slot = self.state[i]
        if name not in slot:
            xp = xp_of(like)
            if self.ledger is not None:   # counted where its target is (host: offload)
                slot[name] = self.ledger.zeros("optim", (like.size,), like.dtype,
                                               f"{name}[{i}]", xp=xp,
                                               host=self.ledger.on_host(self.params[i].data))
            else:
                slot[name] = xp.zeros(like.size, dtype=like.dtype)
        return slot[name]

    def allocate_state(self) -> None:
        """Create every state array now (they are otherwise made on first use)."""
        for i, p in enumerate(self.params):
            for name in self.state_names:
                self._state(i, name, p.data)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _check_caller(self) -> None:
        """RuntimeError for a step of a strategy's targets outside the strategy's step."""
        owner = self._owner() if self._owner is not None else None
        if owner is not None and not getattr(owner, "stepping", True):
            raise RuntimeError(f"{type(self).__name__}.step() was called on the targets of "
                               f"{type(owner).__name__}, which reduces their gradients over "
                               f"the data-parallel ranks before the update: call "
                               f"model.step(opt) instead of opt.step() (it reduces, "
                               f"clips, steps and zeroes the gradients)")

    def step(self, grad_scale=1.0, skip=None) -> None:
        """Apply one update to every target that has a gradient, each gradient taken
        times ``grad_scale`` (a strategy's unscaling and clipping factor, applied here
        rather than to the gradients in place: on a GPU inside the update's kernel),
        unless ``skip`` is set (see the module docstring)."""
        self._check_caller()
        grad_scale, skip = self._decide_on_host(grad_scale, skip)
        if skip:
            return
        self.step_count += 1
        for i, param, grad in self._flat_targets():
            self._update(i, param, grad, tuple(self.params[i].decay_ranges), grad_scale)

    def _flat_targets(self):
        """``(index, param, grad)`` of the targets to update, flat (views)."""
        for i, p in enumerate(self.params):
            if p.grad is None or p.data.size == 0:
                continue
            if not p.data.flags.c_contiguous:
                raise ValueError(f"{type(self).__name__}: target {i} is not a contiguous "
                                 f"array (shape {tuple(p.data.shape)}); updates must "
                                 f"happen in place")
            yield i, p.data.reshape(-1), p.grad.reshape(-1)

    def _update(self, i: int, param, grad, decay_ranges: tuple, grad_scale: float) -> None:
        """Update flat ``param`` from flat ``grad`` times ``grad_scale`` (cast to
        ``param``'s dtype after the product)."""
        raise NotImplementedError

    # -- state (de)serialisation ------------------------------------------
    def state_dict(self) -> dict:
        """``{"step": n, "lr": lr, "state": [{name: flat array}, ...]}``."""
        return {"step": self.step_count, "lr": self.lr,
                "state": [dict(slot) for slot in self.state]}

    def load_state_dict(self, state: dict) -> None:
        """Copy state arrays in (each must have its target's size)."""
        if len(state["state"]) != len(self.params):
            raise ValueError(f"optimizer state has {len(state['state'])} entries, "
                             f"this optimizer has {len(self.params)} targets")
        self.step_count = int(state["step"])
        self.lr = float(state.get("lr", self.lr))
        for i, (p, slot) in enumerate(zip(self.params, state["state"])):
            for name, value in slot.items():
                if value.size != p.data.size:
                    raise ValueError(f"optimizer state {name}[{i}] has {value.size} "
                                     f"elements, its target has {p.data.size}")
                xp = xp_of(p.data)
                if xp is np:  # device state onto a host optimizer: an explicit copy
                    value = to_numpy(value)
                self._state(i, name, p.data)[...] = xp.asarray(
                    value, dtype=p.data.dtype).reshape(-1)


#: host arrays are updated in blocks of rows this wide, spread over ``MPISHARD_THREADS``
#: threads (see [Note: cache blocking] in mpishard/kernels/cpu/threads.py)
_ROW = 1 << 12


def _in_blocks(update, size: int, host: bool) -> None:
    """``update(lo, hi)`` over ``[0, size)``: cache-sized blocks over threads for host
    arrays, one call for device arrays (elementwise updates: the same bits either way)."""
    if not host:
        update(0, size)
        return
    for_rows(lambda rows: update(rows.start * _ROW, min(rows.stop * _ROW, size)),
             -(-size // _ROW), _ROW)


def _scaled(grad, grad_scale):
    """``grad * grad_scale``: a Python float (``grad`` itself for 1.0) in the gradient's
    dtype as NumPy takes it (bfloat16 too, which CuPy 14 would make float32:
    :func:`~mpishard.core.dtypes.weak_scalar`), or a 0-d device array cast to the
    gradient's dtype first, as a Python float would be."""
    if not hasattr(grad_scale, "astype"):
        return grad if grad_scale == 1.0 else grad * weak_scalar(grad_scale, grad)
    return grad * grad_scale.astype(grad.dtype)


def _add_l2(grad, param, decay_ranges: tuple, weight_decay: float):
    """``grad + weight_decay * param`` on the decayed ranges (a fresh array)."""
    grad = grad.copy()
    for start, stop in decay_ranges:
        grad[start:stop] += weight_decay * param[start:stop]
    return grad


class SGD(Optimizer):
    """Stochastic gradient descent with momentum, Nesterov and L2 weight decay (torch semantics)."""

    def __init__(self, params, lr: float = 0.01, momentum: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, dampening: float = 0.0,
                 ledger: MemoryLedger | None = None):
        super().__init__(params, lr, ledger)
        if nesterov and (momentum <= 0.0 or dampening != 0.0):
            raise ValueError("SGD: nesterov needs momentum > 0 and dampening == 0")
        self.momentum, self.weight_decay = float(momentum), float(weight_decay)
        self.nesterov, self.dampening = bool(nesterov), float(dampening)
        self.state_names = ("momentum_buffer",) if momentum else ()

    def _update(self, i, param, grad, decay_ranges, grad_scale):
        fresh = self.momentum and "momentum_buffer" not in self.state[i]
        buf = self._state(i, "momentum_buffer", param) if self.momentum else None
        decayed = decay_ranges if self.weight_decay else ()

        def update(lo: int, hi: int) -> None:     # elements [lo, hi): in cache on a host
            g = _scaled(grad[lo:hi], grad_scale)
            if g.dtype != param.dtype:
                g = g.astype(param.dtype)
            ranges = [(max(a, lo) - lo, min(b, hi) - lo) for a, b in decayed if a < hi and b > lo]
            if ranges:
                g = _add_l2(g, param[lo:hi], tuple(ranges), self.weight_decay)
            if buf is not None:
                b = buf[lo:hi]
                if fresh:
                    b[...] = g
                else:
                    b *= self.momentum
                    b += (1.0 - self.dampening) * g
                g = g + self.momentum * b if self.nesterov else b
            view = param[lo:hi]
            view -= self.lr * g
        _in_blocks(update, param.size, xp_of(param) is np)


class Adam(Optimizer):
    """Adam (Kingma & Ba, 2015) with optional L2 weight decay added to the gradient."""

    state_names = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def __init__(self, params, lr: float = 1e-3, betas: tuple = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0,
                 ledger: MemoryLedger | None = None):
        super().__init__(params, lr, ledger)
        b1, b2 = betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"{type(self).__name__}: betas must be in [0, 1), got {betas}")
        self.beta1, self.beta2 = float(b1), float(b2)
        self.eps, self.weight_decay = float(eps), float(weight_decay)

    device_skip = True

    def step(self, grad_scale=1.0, skip=None) -> None:
        """Every target's update as one multi-tensor call per array module and dtype (on
        a GPU one kernel launch for all targets: the gradients' scaling, the decoupled
        weight decay and Adam's update together); a gradient of another dtype than its
        target, or plain Adam's L2 decay, is prepared on the way, target by target.
        With a device ``skip`` the step's number and bias corrections are computed on
        the device and the kernel skips there (see the module docstring)."""
        self._check_caller()
        grad_scale, skip = self._decide_on_host(grad_scale, skip)
        if skip is True:
            return
        b1, b2, lr = self.beta1, self.beta2, self.lr
        if skip is None or skip is False:
            skip = None
            self.step_count += 1
            t = self.step_count
            step_size, inv_bias2 = lr / (1.0 - b1 ** t), 1.0 / math.sqrt(1.0 - b2 ** t)
        else:        # Python's arithmetic above, on the device (pow, sqrt: the same libm)
            xp = xp_of(skip)
            t = self._count_on_device(skip)
            step_size = lr / (1.0 - xp.power(b1, t))
            inv_bias2 = 1.0 / xp.sqrt(1.0 - xp.power(b2, t))
        decay = 1.0 - lr * self.weight_decay if self.decoupled and self.weight_decay else 1.0
        groups: dict = {}
        for i, param, grad in self._flat_targets():
            ranges = tuple(self.params[i].decay_ranges)
            scale = grad_scale
            if grad.dtype != param.dtype or (self.weight_decay and not self.decoupled):
                grad = _scaled(grad, grad_scale).astype(param.dtype, copy=False)
                if self.weight_decay and not self.decoupled and ranges:
                    grad = _add_l2(grad, param, ranges, self.weight_decay)
                scale = 1.0                               # applied here
            m = self._state(i, "exp_avg", param)
            v = self._state(i, "exp_avg_sq", param)
            key = (id(xp_of(param)), param.dtype.name,
                   id(scale) if hasattr(scale, "shape") else scale)
            groups.setdefault(key, (scale, []))[1].append((param, grad, m, v, ranges))
        for scale, targets in groups.values():
            extra = {} if skip is None else {"skip": skip}
            kernels_for(xp_of(targets[0][0])).multi_adam_update(
                targets, b1, b2, step_size, inv_bias2, self.eps, scale, decay, **extra)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter, 2019), torch defaults."""

    decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas: tuple = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01,
                 ledger: MemoryLedger | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, ledger)

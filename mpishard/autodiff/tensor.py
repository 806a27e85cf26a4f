"""The Tensor and the backward engine.

A :class:`Tensor` wraps one NumPy or CuPy array (``data``) and, once backward
has run, its gradient (``grad``, an array of the same module and shape). Ops in
:mod:`mpishard.autodiff.ops` build the graph: each result remembers its parent
tensors and a closure that maps the result's gradient to its parents'.

[Note: parameter storage]
An op's backward closure holds references to its input *Tensors* and reads
``tensor.data`` when backward runs, never an array captured at forward time.
So a strategy may swap a parameter's ``data`` between forward and backward:
ZeRO-3 releases a unit's full parameters after forward (``data`` becomes an
empty placeholder) and gathers them again before that unit's backward. The only
promise required is that ``data`` holds the same values again when the
backward closures that read it run. Activations are different: they are owned
by the graph and stay alive until backward has used them.

[Note: backward order]
Backward visits the graph in reverse topological order computed by an
iterative depth-first search over parents in the order each op lists them. No
recursion (deep graphs are fine) and no set or hash order (two runs visit the
same nodes in the same order and give bit-identical gradients).

[Note: grad-ready hooks]
``register_grad_ready_hook(fn)`` calls ``fn(tensor)`` once the tensor's
gradient is final for this backward pass: for an interior tensor just before its
own backward closure runs; for a leaf (a parameter) as soon as the last op that
consumed it has contributed, which is how data parallelism launches a bucket's
all-reduce while backward carries on, and how ZeRO-3 gathers a unit's
parameters just before they are needed (a hook on the unit's output).
"""
from __future__ import annotations

import functools
import threading
from typing import Callable

import numpy as np

from mpishard.autodiff import profile as _profile

__all__ = ["Tensor", "no_grad", "enable_grad", "is_grad_enabled", "HookHandle", "grad_buffer",
           "grad_so_far"]

# [Note: gradient buffers]
# Data parallelism averages gradients in flat buckets. Copying each parameter's
# gradient into its bucket view costs one pass over every gradient (on a GPU,
# one kernel launch per parameter). So a strategy may set ``p.grad_out`` to the
# view, and an op whose backward computes a parameter's gradient (a linear
# layer's weight and bias products, a norm's column sums) asks
# ``grad_buffer(p, dtype)`` for it: it gets the view when ``p`` has no gradient
# yet in this step and the view has the dtype the gradient would be kept in,
# writes the product there (``matmul(..., out=view)``), and returns the view,
# which ``_accumulate`` keeps as ``p.grad``; the bucket then finds it in place.
# Later contributions (a tied weight's second use, the next micro-batch) add
# into ``p.grad`` as before. Every other case (no buffer, a gradient already
# there, a dtype the gradient is cast to) gets ``None``: the op computes a
# fresh array as usual.
#
# The same holds for the other end: a norm's backward adds its input gradient
# straight into the gradient that input already has (``grad_so_far``: the
# residual stream's, handed down by the residual add), in its own kernel,
# instead of returning a fresh array for ``_accumulate`` to add; it returns that
# very array, which ``_accumulate`` then leaves as it is. That is the in-place
# addition ``_accumulate`` would do, done one pass earlier.


class _GradMode(threading.local):
    enabled = True


_grad_mode = _GradMode()


def is_grad_enabled() -> bool:
    """Whether new ops record the graph (off inside :class:`no_grad`)."""
    return _grad_mode.enabled


class no_grad:
    """Context manager (and decorator) that stops ops from recording the graph."""

    _target = False

    def __enter__(self):
        self._prev = _grad_mode.enabled
        _grad_mode.enabled = self._target
        return self

    def __exit__(self, *exc):
        _grad_mode.enabled = self._prev
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with type(self)():
                return fn(*args, **kwargs)
        return wrapper


class enable_grad(no_grad):
    """Context manager that turns graph recording back on."""

    _target = True


class HookHandle:
    """Returned by hook registration; ``remove()`` unregisters the hook."""

    __slots__ = ("_hooks", "_fn")

    def __init__(self, hooks: list, fn):
        self._hooks, self._fn = hooks, fn

    def remove(self) -> None:
        if self._fn in self._hooks:
            self._hooks.remove(self._fn)


class Tensor:
    """An array plus the record of how it was computed.

    Args:
        data: a NumPy or CuPy array (Python scalars and lists are converted
            with NumPy, float64 for floats).
        requires_grad: whether backward should compute ``grad`` for it.
        name: optional label, shown in errors.

    ``grad_dtype`` (default ``None``: the data's dtype) is the dtype gradients
    accumulate in; mixed precision sets float32 on 16-bit parameters so that
    every contribution (tied uses, micro-batches) is added in float32.
    ``grad_out`` (default ``None``) is a buffer the gradient may be computed
    straight into (see [Note: gradient buffers]).
    """

    __slots__ = ("data", "grad", "requires_grad", "name", "grad_dtype", "grad_out",
                 "_parents", "_backward", "_op", "_hooks", "__weakref__")
    __array_priority__ = 1000  # so ndarray + Tensor defers to Tensor.__radd__

    def __init__(self, data, requires_grad: bool = False, name: str = ""):
        if isinstance(data, Tensor):
            data = data.data
        elif not hasattr(data, "__array_interface__") and not hasattr(
                data, "__cuda_array_interface__"):
            data = np.asarray(data)
        self.data = data
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self.name = name
        self.grad_dtype = None
        self.grad_out = None        # see [Note: gradient buffers]
        self._parents: tuple = ()
        self._backward: Callable | None = None
        self._op = ""
        self._hooks: list | None = None

    # -- basic facts ------------------------------------------------------
    @property
    def shape(self) -> tuple:
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        return self.data.size

    @property
    def is_leaf(self) -> bool:
        return self._backward is None

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        op = f", op={self._op}" if self._op else ""
        return f"Tensor(shape={self.shape}, dtype={self.dtype}{grad}{op})"

    def item(self) -> float:
        return float(self.data.reshape(-1)[0]) if self.data.size == 1 else float(self.data)

    def numpy(self) -> np.ndarray:
        """The data as a host NumPy array (a copy only for device arrays)."""
        from mpishard.core.backend import to_numpy  # noqa: PLC0415

        return to_numpy(self.data)

    def detach(self) -> "Tensor":
        """A new leaf sharing this tensor's data, outside the graph."""
        return Tensor(self.data, requires_grad=False)

    # -- hooks ------------------------------------------------------------
    def register_grad_ready_hook(self, fn: Callable[["Tensor"], None]) -> HookHandle:
        """Call ``fn(self)`` when this tensor's gradient is final in a backward pass.

        See [Note: grad-ready hooks]. Returns a handle whose ``remove()`` undoes it.
        """
        if self._hooks is None:
            self._hooks = []
        self._hooks.append(fn)
        return HookHandle(self._hooks, fn)

    def _fire_hooks(self) -> None:
        if self._hooks:
            for fn in tuple(self._hooks):
                fn(self)

    # -- backward ---------------------------------------------------------
    def backward(self, grad=None) -> None:
        """Compute gradients of this tensor with respect to every leaf that requires them.

        Args:
            grad: gradient of the final objective w.r.t. this tensor; defaults
                to ones for a scalar (one-element) tensor.

        Leaf gradients accumulate into ``.grad`` (call ``zero_grad`` between
        steps); interior gradients and the graph are freed as backward goes.
        """
        if not self.requires_grad:
            raise RuntimeError(
                "backward() on a tensor that does not require grad: no input of "
                "the computation had requires_grad=True (or it ran under no_grad)")
        if grad is None:
            if self.data.size != 1:
                raise ValueError(
                    f"backward() without a gradient needs a one-element tensor, "
                    f"got shape {self.shape}; pass grad= of that shape")
            grad = _ones_like(self.data)
        elif isinstance(grad, Tensor):
            grad = grad.data
        if tuple(grad.shape) != tuple(self.shape):
            raise ValueError(
                f"backward(): gradient shape {tuple(grad.shape)} does not match "
                f"tensor shape {tuple(self.shape)}")
        run_backward(self, grad)

    # Operators and methods are attached in ops.py (one place for every op).


def _ones_like(array):
    from mpishard.core.backend import xp_of  # noqa: PLC0415

    return xp_of(array).ones(array.shape, dtype=array.dtype)


def _topological_order(root: Tensor) -> list[Tensor]:
    """Iterative DFS post-order of the tensors that require grad. See [Note: backward order]."""
    order: list[Tensor] = []
    visited: set[int] = set()  # membership only; iteration order never depends on it
    stack: list[tuple[Tensor, int]] = [(root, 0)]
    visited.add(id(root))
    while stack:
        node, i = stack[-1]
        parents = node._parents
        while i < len(parents):
            parent = parents[i]
            i += 1
            if parent is not None and parent.requires_grad and id(parent) not in visited:
                visited.add(id(parent))
                stack[-1] = (node, i)
                stack.append((parent, 0))
                break
        else:
            stack.pop()
            order.append(node)
    return order


def run_backward(root: Tensor, grad) -> None:
    """The backward engine (see the notes at the top of this module)."""
    order = _topological_order(root)
    # How many graph edges still have to deliver a gradient to each leaf, so
    # its grad-ready hooks fire at the earliest correct moment.
    pending: dict[int, int] = {}
    for node in order:
        for parent in node._parents:
            if parent is not None and parent.requires_grad and parent._backward is None:
                pending[id(parent)] = pending.get(id(parent), 0) + 1

    if root._backward is None:  # backward on a leaf itself
        _accumulate(root, grad)
        root._fire_hooks()
        return
    root.grad = grad
    for node in reversed(order):
        backward_fn = node._backward
        if backward_fn is None:
            continue  # leaves: gradients arrive through their consumers
        g = node.grad
        parents = node._parents
        if g is not None:
            node._fire_hooks()
            recording = _profile.active                # see profile.py
            parent_grads = backward_fn(g) if recording is None else \
                recording.backward(node._op, backward_fn, g)
            seen: list = []
            for parent, pg in zip(parents, parent_grads):
                if parent is None or not parent.requires_grad:
                    continue
                if pg is not None:
                    # Two parents handed the very same array must not share it,
                    # or an in-place accumulation into one would change the other.
                    if any(pg is s for s in seen):
                        pg = pg.copy()
                    seen.append(pg)
                    _accumulate(parent, pg)
        # Free this node's gradient and the graph behind it as we go.
        node.grad = None
        node._backward = None
        node._parents = ()
        for parent in parents:
            if parent is not None and parent.requires_grad and parent._backward is None:
                left = pending[id(parent)] - 1
                pending[id(parent)] = left
                if left == 0:
                    parent._fire_hooks()


def grad_buffer(tensor, dtype):
    """``tensor.grad_out`` when the op computing ``tensor``'s gradient in ``dtype`` may
    write it straight there (see [Note: gradient buffers]), else ``None``."""
    out = tensor.grad_out
    if out is None or tensor.grad is not None or out.dtype != dtype:
        return None
    if (tensor.grad_dtype or tensor.data.dtype) != dtype:
        return None
    return out


def grad_so_far(tensor, dtype):
    """``tensor.grad`` when an op whose gradient for ``tensor`` comes out in ``dtype`` may
    add it in place there (see [Note: gradient buffers]; the op then returns
    ``tensor.grad`` itself), else ``None``."""
    g = tensor.grad
    if g is None or g.dtype != dtype or tensor.data.dtype != dtype or not g.flags.c_contiguous:
        return None
    return g


def _accumulate(tensor: Tensor, g) -> None:
    if g is tensor.grad:                   # the op added into it (see grad_so_far)
        return
    if g.shape != tuple(tensor.shape):  # a Parameter's shape holds even while released
        raise RuntimeError(
            f"internal error: gradient of shape {g.shape} for tensor {tensor!r} "
            f"{tensor.name!r}; an op's backward returned the wrong shape")
    # A gradient is added in the dtype of the buffer already there (a strategy's
    # bucket view), else in the tensor's grad_dtype, else in its data's dtype.
    if tensor.grad is not None:
        dtype = tensor.grad.dtype
    else:
        dtype = tensor.grad_dtype or tensor.data.dtype
    if g.dtype != dtype:
        g = g.astype(dtype)
    if tensor.grad is None:
        tensor.grad = g
    else:
        tensor.grad += g

"""The Tensor: an array, its gradient, the record of how it was computed, its operators.

A :class:`Tensor` wraps one NumPy or CuPy array (``data``) and, once backward
has run, its gradient (``grad``, an array of the same module and shape). Ops
(:mod:`.ops`, :mod:`.shape_ops`, :mod:`.nn_ops`, ...) build the graph: each result
remembers its parent tensors and a closure that maps the result's gradient to its
parents'. A Tensor's operators and methods (``a + b``, ``a @ b``, ``a[i]``,
``a.sum()``, ...) run those ops, found by name in :data:`OPS`, where every op
registers itself (``graph.register_op``): the ops build on this class, so it names
them rather than importing them. Backward is the engine's (:mod:`.engine`).

[Note: parameter storage]
An op's backward closure holds references to its input *Tensors* and reads
``tensor.data`` when backward runs, never an array captured at forward time.
So a strategy may swap a parameter's ``data`` between forward and backward:
ZeRO-3 releases a unit's full parameters after forward (``data`` becomes an
empty placeholder) and gathers them again before that unit's backward. The only
promise required is that ``data`` holds the same values again when the
backward closures that read it run. Activations are different: they are owned
by the graph and stay alive until backward has used them.
"""
from __future__ import annotations

import functools
import threading
from typing import Callable

import numpy as np

from mpishard.autodiff.engine import run_backward

__all__ = ["Tensor", "no_grad", "enable_grad", "is_grad_enabled", "HookHandle", "grad_buffer",
           "grad_so_far", "OPS", "is_python_number"]

#: name -> op function, for every differentiable op (``graph.register_op`` adds each;
#: the gradcheck test reads it, and Tensor's operators run theirs from it)
OPS: dict[str, Callable] = {}


def is_python_number(x) -> bool:
    """Whether ``x`` is a Python int or float (not a bool): an op keeps it a Python
    scalar, so that it takes the array's dtype instead of promoting it."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# [Note: gradient buffers]
# Data parallelism averages gradients in flat buckets. Copying each parameter's
# gradient into its bucket view costs one pass over every gradient (on a GPU,
# one kernel launch per parameter). So a strategy may set ``p.grad_out`` to the
# view, and an op whose backward computes a parameter's gradient (a linear
# layer's weight and bias products, a norm's column sums) asks
# ``grad_buffer(p, dtype)`` for it: it gets the view when ``p`` has no gradient
# yet in this step and the view has the dtype the gradient would be kept in,
# writes the product there (``matmul(..., out=view)``), and returns the view,
# which the engine's ``_accumulate`` keeps as ``p.grad``; the bucket then finds it in
# place.
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

        See [Note: grad-ready hooks] in engine.py. Returns a handle whose ``remove()``
        undoes it.
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

    # -- operators and methods: each runs the op of that name (see the module docstring)
    def __add__(self, other) -> Tensor:
        return OPS["add"](self, other)

    __radd__ = __add__                  # 2 + a is a + 2

    def __sub__(self, other) -> Tensor:
        return OPS["sub"](self, other)

    def __rsub__(self, other) -> Tensor:
        """``other - self``: ``-self + other`` for a Python number, else ``sub``."""
        if is_python_number(other):
            return OPS["add"](OPS["neg"](self), other)
        return OPS["sub"](other, self)

    def __mul__(self, other) -> Tensor:
        return OPS["mul"](self, other)

    __rmul__ = __mul__                  # 2 * a is a * 2

    def __truediv__(self, other) -> Tensor:
        return OPS["div"](self, other)

    def __rtruediv__(self, other) -> Tensor:
        """``other / self``: ``self ** -1 * other`` for a Python number, else ``div``."""
        if is_python_number(other):
            return OPS["mul"](OPS["pow"](self, -1), other)
        return OPS["div"](other, self)

    def __neg__(self) -> Tensor:
        return OPS["neg"](self)

    def __pow__(self, p) -> Tensor:
        return OPS["pow"](self, p)

    def __matmul__(self, other) -> Tensor:
        return OPS["matmul"](self, other)

    def __rmatmul__(self, other) -> Tensor:
        return OPS["matmul"](other, self)

    def __getitem__(self, index) -> Tensor:
        return OPS["getitem"](self, index)

    def sum(self, axis=None, keepdims: bool = False) -> Tensor:
        """Sum over ``axis`` (all axes by default)."""
        return OPS["sum"](self, axis, keepdims)

    def mean(self, axis=None, keepdims: bool = False) -> Tensor:
        """Mean over ``axis`` (all axes by default)."""
        return OPS["mean"](self, axis, keepdims)

    def max(self, axis=None, keepdims: bool = False) -> Tensor:
        """Maximum over ``axis``; tied maxima share the gradient."""
        return OPS["max"](self, axis, keepdims)

    def reshape(self, *shape) -> Tensor:
        """A view with a new shape (``-1`` allowed once)."""
        return OPS["reshape"](self, *shape)

    def permute(self, *axes) -> Tensor:
        """The dimensions reordered."""
        return OPS["permute"](self, *axes)

    def transpose(self, dim0: int = -2, dim1: int = -1) -> Tensor:
        """Dimensions ``dim0`` and ``dim1`` swapped."""
        return OPS["transpose"](self, dim0, dim1)

    @property
    def T(self) -> Tensor:
        """The dimensions reversed (a matrix transposed)."""
        return OPS["permute"](self, tuple(reversed(range(self.ndim))))

    def exp(self) -> Tensor:
        """``e ** self``."""
        return OPS["exp"](self)

    def log(self) -> Tensor:
        """Natural logarithm."""
        return OPS["log"](self)

    def tanh(self) -> Tensor:
        """Hyperbolic tangent."""
        return OPS["tanh"](self)

    def sqrt(self) -> Tensor:
        """Square root."""
        return OPS["sqrt"](self)

    def relu(self) -> Tensor:
        """``max(self, 0)``."""
        return OPS["relu"](self)

    def astype(self, dtype) -> Tensor:
        """This tensor in ``dtype``, differentiably (``ops.astype``)."""
        return OPS["astype"](self, dtype)

    def masked_fill(self, mask, value: float) -> Tensor:
        """A copy with ``value`` where ``mask`` is true."""
        return OPS["masked_fill"](self, mask, value)


def _ones_like(array):
    from mpishard.core.backend import xp_of  # noqa: PLC0415

    return xp_of(array).ones(array.shape, dtype=array.dtype)


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

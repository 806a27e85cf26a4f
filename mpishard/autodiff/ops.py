"""Core ops: elementwise math, matmul and reductions, each forward beside its backward.

Every op takes Tensors (Python scalars and arrays are accepted as constants),
computes its result with the array module of its input data, and, when any input
requires grad, records a closure that maps the result's gradient to the
gradients of its inputs (``None`` for inputs that need none). Closures read
``tensor.data`` when they run: see [Note: parameter storage] in tensor.py.

Broadcasting is undone in one place, :func:`.graph.unbroadcast`. Every op is
registered in :data:`.tensor.OPS` (Tensor's operators run them from there); the
test suite checks each one against finite differences and fails for an op that
has no such test.

Shape ops (reshape, permute, indexing, concat, split) are in :mod:`.shape_ops` and
neural-network ops (linear, layer_norm, softmax, cross_entropy, attention, ...) in
:mod:`.nn_ops` and :mod:`.softmax_ops`; the helpers all of them share
(:func:`~.graph.register_op`, :func:`~.graph.make_result`, ...) in :mod:`.graph`.
"""
from __future__ import annotations

import numpy as np

from mpishard.core.backend import xp_of
from mpishard.core.dtypes import is_low_precision, resolve_dtype, weak_scalar, where_kept
from mpishard.autodiff.graph import as_tensor, as_tensors, make_result, register_op, unbroadcast
from mpishard.autodiff.tensor import Tensor, is_python_number

__all__ = [
    "add", "sub", "mul", "div", "neg", "pow", "matmul",
    "sum", "mean", "max", "exp", "log", "tanh", "sqrt", "relu", "where", "masked_fill",
    "astype",
]


def _is_float(dtype) -> bool:
    """A float dtype, bfloat16 included (``ml_dtypes`` gives it kind ``'V'``)."""
    return dtype.kind == "f" or is_low_precision(dtype)


def _check_dtypes(name: str, a: Tensor, b: Tensor) -> None:
    """Refuse floats of two dtypes meeting in op ``name``, bfloat16 among them."""
    da, db = a.data.dtype, b.data.dtype
    if da != db and _is_float(da) and _is_float(db):
        raise ValueError(
            f"{name}: dtype mismatch {da} vs {db} (shapes {tuple(a.shape)} and "
            f"{tuple(b.shape)}); cast one side with .astype()")


def _check_binary(name: str, a: Tensor, b: Tensor) -> None:
    _check_dtypes(name, a, b)
    if a.shape != b.shape:
        try:
            np.broadcast_shapes(a.shape, b.shape)
        except ValueError:
            raise ValueError(
                f"{name}: shapes {tuple(a.shape)} and {tuple(b.shape)} do not "
                f"broadcast") from None


def _scalar_op(name, a: Tensor, s, forward, backward_scale):
    """Tensor (op) Python scalar: the scalar stays a Python number (no float64), a
    float meeting bfloat16 data a bfloat16 one (:func:`~mpishard.core.dtypes.weak_scalar`:
    on CuPy 14 a bare float would make the result float32)."""
    s = weak_scalar(s, a.data)
    data = forward(a.data, s)

    def backward(g):
        return (backward_scale(g, a, s),)
    return make_result(data, (a,), backward, name)


# -- elementwise binary ----------------------------------------------------

@register_op
def add(a, b) -> Tensor:
    """``a + b`` with broadcasting."""
    if is_python_number(b):
        return _scalar_op("add", as_tensor(a), b, lambda x, s: x + s, lambda g, a, s: g)
    a, b = as_tensors(a, b)
    _check_binary("add", a, b)

    def backward(g):
        return unbroadcast(g, a.shape), unbroadcast(g, b.shape)
    return make_result(a.data + b.data, (a, b), backward, "add")


@register_op
def sub(a, b) -> Tensor:
    """``a - b`` with broadcasting."""
    if is_python_number(b):
        return _scalar_op("sub", as_tensor(a), b, lambda x, s: x - s, lambda g, a, s: g)
    a, b = as_tensors(a, b)
    _check_binary("sub", a, b)

    def backward(g):
        return unbroadcast(g, a.shape), unbroadcast(-g, b.shape)
    return make_result(a.data - b.data, (a, b), backward, "sub")


@register_op
def mul(a, b) -> Tensor:
    """``a * b`` with broadcasting."""
    if is_python_number(b):
        return _scalar_op("mul", as_tensor(a), b, lambda x, s: x * s, lambda g, a, s: g * s)
    a, b = as_tensors(a, b)
    _check_binary("mul", a, b)

    def backward(g):
        ga = unbroadcast(g * b.data, a.shape) if a.requires_grad else None
        gb = unbroadcast(g * a.data, b.shape) if b.requires_grad else None
        return ga, gb
    return make_result(a.data * b.data, (a, b), backward, "mul")


@register_op
def div(a, b) -> Tensor:
    """``a / b`` with broadcasting."""
    if is_python_number(b):
        return _scalar_op("div", as_tensor(a), b, lambda x, s: x / s, lambda g, a, s: g / s)
    a, b = as_tensors(a, b)
    _check_binary("div", a, b)

    def backward(g):
        ga = unbroadcast(g / b.data, a.shape) if a.requires_grad else None
        gb = unbroadcast(-g * a.data / (b.data * b.data), b.shape) if b.requires_grad else None
        return ga, gb
    return make_result(a.data / b.data, (a, b), backward, "div")


@register_op
def neg(a) -> Tensor:
    """``-a``."""
    a = as_tensor(a)
    return make_result(-a.data, (a,), lambda g: (-g,), "neg")


def _power(x, p):
    # float32 x**3 with negative values goes through np.power and is ~260x
    # slower than x*x*x (measured on NumPy 2); only **2 has a fast path.
    if p == 2:
        return x * x
    if p == 3:
        return x * x * x
    if p == 1:
        return x.copy()
    return x ** p


@register_op
def pow(a, p) -> Tensor:
    """``a ** p``: a scalar exponent, or a Tensor exponent (then ``a`` must be > 0)."""
    a = as_tensor(a)
    if is_python_number(p):
        def backward(g):
            if p == 0:
                return (g * 0,)
            return (g * (weak_scalar(p, a.data) * _power(a.data, p - 1)),)
        return make_result(_power(a.data, weak_scalar(p, a.data)), (a,), backward, "pow")
    p = as_tensor(p, a)
    _check_binary("pow", a, p)
    xp = xp_of(a.data)
    out = a.data ** p.data

    def backward_t(g):
        base, expo = a.data, p.data
        ga = unbroadcast(g * expo * base ** (expo - 1), a.shape) if a.requires_grad else None
        gp = unbroadcast(g * (base ** expo) * xp.log(base), p.shape) if p.requires_grad else None
        return ga, gp
    return make_result(out, (a, p), backward_t, "pow")


# -- matmul ----------------------------------------------------------------

@register_op
def matmul(a, b) -> Tensor:
    """``a @ b`` (NumPy semantics: 1-D promotion, broadcast batch dimensions)."""
    a, b = as_tensors(a, b)
    _check_dtypes("matmul", a, b)
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"matmul: scalar operand (shapes {tuple(a.shape)} and "
                         f"{tuple(b.shape)}); use mul")
    ka = a.shape[-1]
    kb = b.shape[0] if b.ndim == 1 else b.shape[-2]
    if ka != kb:
        raise ValueError(f"matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} "
                         f"do not align ({ka} != {kb})")
    try:
        out = a.data @ b.data
    except ValueError:
        raise ValueError(f"matmul: batch dimensions of shapes {tuple(a.shape)} and "
                         f"{tuple(b.shape)} do not broadcast") from None

    def backward(g):
        A, B = a.data, b.data
        if A.ndim == 1:
            A, g2 = A[None, :], g[..., None, :]
        else:
            g2 = g
        if B.ndim == 1:
            B, g2 = B[:, None], g2[..., None]
        ga = gb = None
        if a.requires_grad:
            ga = g2 @ B.swapaxes(-1, -2)
            ga = unbroadcast(ga, A.shape).reshape(a.shape)
        if b.requires_grad:
            gb = A.swapaxes(-1, -2) @ g2
            gb = unbroadcast(gb, B.shape).reshape(b.shape)
        return ga, gb
    return make_result(out, (a, b), backward, "matmul")


# -- reductions ------------------------------------------------------------

def _norm_axes(axis, ndim) -> tuple:
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    out = []
    for ax in axes:
        if not -ndim <= ax < ndim:
            raise ValueError(f"axis {ax} is out of range for a tensor with {ndim} dimensions")
        out.append(ax % ndim)
    return tuple(sorted(out))


def _expand_to(g, shape, axes, keepdims):
    """Broadcast a reduced gradient back over the reduced axes (a fresh array)."""
    xp = xp_of(g)
    if not keepdims:
        g = g.reshape([1 if i in axes else n for i, n in enumerate(shape)])
    out = xp.empty(shape, dtype=g.dtype)
    out[...] = g
    return out


@register_op
def sum(a, axis=None, keepdims: bool = False) -> Tensor:  # noqa: A001 (mirrors NumPy)
    """Sum over ``axis`` (all axes by default)."""
    a = as_tensor(a)
    axes = _norm_axes(axis, a.ndim)
    out = a.data.sum(axis=axes, keepdims=keepdims)

    def backward(g):
        return (_expand_to(g, a.shape, axes, keepdims),)
    return make_result(out, (a,), backward, "sum")


@register_op
def mean(a, axis=None, keepdims: bool = False) -> Tensor:
    """Mean over ``axis`` (all axes by default)."""
    a = as_tensor(a)
    axes = _norm_axes(axis, a.ndim)
    count = 1
    for ax in axes:
        count *= a.shape[ax]
    out = a.data.sum(axis=axes, keepdims=keepdims) / count

    def backward(g):
        return (_expand_to(g / count, a.shape, axes, keepdims),)
    return make_result(out, (a,), backward, "mean")


@register_op
def max(a, axis=None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Maximum over ``axis``; the gradient is shared equally among tied maxima."""
    a = as_tensor(a)
    axes = _norm_axes(axis, a.ndim)
    out = a.data.max(axis=axes, keepdims=keepdims)

    def backward(g):
        kept = out if keepdims else out.reshape(
            [1 if i in axes else n for i, n in enumerate(a.shape)])
        hit = (a.data == kept).astype(g.dtype)
        hit /= hit.sum(axis=axes, keepdims=True)
        return (hit * _expand_to(g, a.shape, axes, keepdims),)
    return make_result(out, (a,), backward, "max")


# -- elementwise unary -----------------------------------------------------

@register_op
def exp(a) -> Tensor:
    """``e ** a``."""
    a = as_tensor(a)
    out = xp_of(a.data).exp(a.data)
    return make_result(out, (a,), lambda g: (g * out,), "exp")


@register_op
def log(a) -> Tensor:
    """Natural logarithm."""
    a = as_tensor(a)
    return make_result(xp_of(a.data).log(a.data), (a,), lambda g: (g / a.data,), "log")


@register_op
def tanh(a) -> Tensor:
    """Hyperbolic tangent."""
    a = as_tensor(a)
    out = xp_of(a.data).tanh(a.data)

    def backward(g):
        return (g * (weak_scalar(1.0, out) - out * out),)
    return make_result(out, (a,), backward, "tanh")


@register_op
def sqrt(a) -> Tensor:
    """Square root."""
    a = as_tensor(a)
    out = xp_of(a.data).sqrt(a.data)
    return make_result(out, (a,), lambda g: (g * weak_scalar(0.5, g) / out,), "sqrt")


@register_op
def relu(a) -> Tensor:
    """``max(a, 0)``."""
    a = as_tensor(a)
    xp = xp_of(a.data)
    out = xp.maximum(a.data, 0)
    return make_result(out, (a,), lambda g: (g * (a.data > 0),), "relu")


@register_op
def where(cond, a, b) -> Tensor:
    """Elementwise ``a`` where ``cond`` is true, else ``b`` (constants allowed)."""
    a, b = as_tensors(a, b)
    cond = as_tensor(cond, a).data
    xp = xp_of(a.data)
    out = where_kept(xp, cond, a.data, b.data)

    def backward(g):
        ga = unbroadcast(where_kept(xp, cond, g, 0), a.shape) if a.requires_grad else None
        gb = unbroadcast(where_kept(xp, cond, 0, g), b.shape) if b.requires_grad else None
        return ga, gb
    return make_result(out, (a, b), backward, "where")


@register_op
def astype(a, dtype) -> Tensor:
    """``a`` in ``dtype`` (itself when it already is); its gradient goes back in ``a``'s
    dtype. How two dtypes meet in an op is said with it: ops refuse floats of two
    dtypes (see :func:`_check_binary`)."""
    a = as_tensor(a)
    dtype = resolve_dtype(dtype, xp_of(a.data))      # a float dtype, or a clear error
    if a.data.dtype == dtype:
        return a
    source = a.data.dtype
    return make_result(a.data.astype(dtype), (a,), lambda g: (g.astype(source),), "astype")


@register_op
def masked_fill(a, mask, value: float) -> Tensor:
    """Copy of ``a`` with ``value`` where ``mask`` is true (e.g. a causal mask)."""
    a = as_tensor(a)
    mask = mask.data if isinstance(mask, Tensor) else mask
    xp = xp_of(a.data)
    out = where_kept(xp, mask, a.data.dtype.type(value), a.data)
    return make_result(out, (a,), lambda g: (where_kept(xp, mask, 0, g).astype(g.dtype),),
                       "masked_fill")

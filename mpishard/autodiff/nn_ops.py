"""Neural-network ops, each a fused forward beside its hand-written backward.

These are the ops the models spend their time in, so each one is written the
way NumPy was measured to be fast (:mod:`.rows`, :mod:`mpishard.kernels.rows`):
activations flattened to 2-D
before a matmul, reductions over a short last axis through ``einsum``, bias
gradients as a ones-vector matmul, Python-float scalars only (a NumPy float64
scalar would silently promote float32 work to float64), and ``x*x*x`` instead
of ``x**3``. The softmax family, cross-entropy and attention are in
:mod:`.softmax_ops`.

Weights are read through ``tensor.data`` inside backward, see
[Note: parameter storage] in tensor.py.

[Note: 16-bit inputs]
A float16 or bfloat16 input (mixed precision) gives an output of the same
dtype, but the arithmetic inside runs wider: matrix products in
:func:`mpishard.core.dtypes.matmul_dtype` (float32 on NumPy, native on CuPy, whose
float16 GEMMs accumulate in float32) and every reduction (layer-norm
statistics, softmax, cross-entropy) in float32. The cast happens at the op's
boundary, in forward and again in backward, so what backward keeps is what
forward kept (16-bit inputs, float32 statistics) and nothing ties a weight's
float32 copy to the graph. Cross-entropy returns a float32 loss.
"""
from __future__ import annotations

import numpy as np

from mpishard.core.backend import xp_of
from mpishard.core.dtypes import matmul_dtype, where_kept
from mpishard.kernels import kernels_for
from mpishard.kernels.cuda.gemm import SUPPORTED as SUPPORTED_PRODUCTS, batched_matmul, matmul
from mpishard.kernels.rows import col_sum_dtype
from mpishard.autodiff.graph import as_tensor, make_result, register_op
from mpishard.autodiff.recompute import kept_product
from mpishard.autodiff.rows import (bias_grad, cast, check_last_dim, draw_uniform,
                                    kept_mask, native_float16, scatter_add_rows, up)
from mpishard.autodiff.tensor import Tensor, grad_buffer, grad_so_far

__all__ = ["linear", "layer_norm", "gelu", "embedding", "dropout", "dropout_add"]


# -- linear ----------------------------------------------------------------

@register_op
def linear(x, weight, bias=None) -> Tensor:
    """``x @ weight.T + bias`` with ``weight`` stored ``[out, in]`` like torch.nn.Linear."""
    x, weight = as_tensor(x), as_tensor(weight)
    n_out, n_in = weight.shape
    check_last_dim("linear", x, n_in, f"weight {tuple(weight.shape)} in_features")
    if x.data.dtype != weight.data.dtype:  # the arrays: a Parameter's dtype is its master's
        raise ValueError(f"linear: dtype mismatch {x.data.dtype} (input {tuple(x.shape)}) vs "
                         f"{weight.data.dtype} (weight {tuple(weight.shape)})")
    dtype, cd = x.dtype, matmul_dtype(x.data)           # see [Note: 16-bit inputs]
    out_shape = x.shape[:-1] + (n_out,)
    if bias is not None:
        bias = as_tensor(bias)

    def product():                       # (N, out), or kept (see [Note: kept products])
        y = matmul(cast(x.data.reshape(-1, n_in), cd), cast(weight.data, cd).T)
        if bias is not None:
            y += bias.data
        return cast(y, dtype).reshape(out_shape)
    y = kept_product(product, (tuple(weight.shape), out_shape))

    def backward(g):
        g2 = cast(g.reshape(-1, n_out), cd)               # (N, out)
        gx = (cast(matmul(g2, cast(weight.data, cd)), dtype).reshape(x.shape)
              if x.requires_grad else None)
        gw = gb = None                                    # see [Note: gradient buffers]
        if weight.requires_grad:  # on a GPU one cuBLAS call, g2's transpose a flag, 16-bit
            gd = _product_grad_dtype(weight, cd)         # in, float32 out if mixed
            gw = batched_matmul(g2, cast(x.data.reshape(-1, n_in), cd), trans_a=True,
                                out=grad_buffer(weight, gd), out_dtype=gd)
        if bias is not None:
            gb = bias_grad(bias, g2)
        return gx, gw, gb
    return make_result(y, (x, weight, bias), backward, "linear")


def _product_grad_dtype(weight, cd) -> np.dtype:
    """The dtype a device product computes ``weight``'s gradient in: its ``grad_dtype``
    (float32 under mixed precision, where the gradient is added in float32) when cuBLAS
    takes that output for ``cd`` inputs, else ``cd``."""
    gd = np.dtype(weight.grad_dtype or cd)
    return gd if (cd.name, gd.name) in SUPPORTED_PRODUCTS else cd


# -- layer norm ------------------------------------------------------------

@register_op
def layer_norm(x, weight=None, bias=None, eps: float = 1e-5) -> Tensor:
    """Normalise over the last axis, then scale by ``weight`` and shift by ``bias``."""
    x = as_tensor(x)
    n = x.shape[-1]
    xp = xp_of(x.data)
    if weight is not None:
        weight = as_tensor(weight)
        check_last_dim("layer_norm", x, weight.shape[0], "weight size")
    if bias is not None:
        bias = as_tensor(bias)
    dtype = x.dtype
    kernels = kernels_for(xp)
    # float16 rows straight into a GPU's kernels (see [Note: float16 rows] in
    # mpishard/kernels/cuda/norms.py), else cast up (see [Note: 16-bit inputs])
    native = native_float16(kernels, dtype) and all(
        t is None or t.data.dtype == dtype for t in (weight, bias))
    lift = (lambda a: a) if native else up

    def normalise():                                    # (y, xhat, rstd), (N, C) rows
        return kernels.layer_norm_forward(
            lift(x.data.reshape(-1, n)), lift(weight.data) if weight is not None else None,
            lift(bias.data) if bias is not None else None, eps)
    y = normalise()[0]

    def backward(g):      # xhat and rstd again from the input, which the graph keeps: the
        xhat, rstd = normalise()[1:]     # same bits (see [Note: what ops keep] in rows.py)
        g2 = lift(g.reshape(-1, n))
        need_w = weight is not None and weight.requires_grad
        need_b = bias is not None and bias.requires_grad
        gw, gb = kernels.norm_param_grads(                # see [Note: gradient buffers]
            g2, xhat, need_w, need_b, grad_buffer(weight, xhat.dtype) if need_w else None,
            grad_buffer(bias, xhat.dtype) if need_b else None)
        gx = None
        if x.requires_grad:
            w = lift(weight.data) if weight is not None else None
            into = None if native else grad_so_far(x, xhat.dtype)  # [Note: gradient
            #                        buffers]; float16 rows: added after, as when cast
            gx = kernels.layer_norm_backward(g2, xhat, rstd, w, None if into is None
                                             else into.reshape(-1, n))
            gx = into if into is not None else cast(gx, dtype).reshape(x.shape)
        return gx, gw, gb
    return make_result(cast(y, dtype).reshape(x.shape), (x, weight, bias), backward,
                       "layer_norm")


# -- activations -----------------------------------------------------------

@register_op
def gelu(x, bias=None) -> Tensor:
    """GELU, tanh approximation: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``;
    with ``bias`` (a linear layer's, left out of its output: see
    :func:`mpishard.nn.unbiased`), of ``x + bias``, the add in GELU's kernel and the
    bias's gradient in its backward's."""
    x = as_tensor(x)
    xp = xp_of(x.data)
    a2 = x.data.reshape(-1, x.shape[-1]) if x.ndim else x.data.reshape(1, 1)
    kernels = kernels_for(xp)
    if bias is not None:
        bias = as_tensor(bias)
        check_last_dim("gelu", x, bias.shape[0], "bias size")
        if bias.data.dtype != x.data.dtype:
            raise ValueError(f"gelu: bias dtype {bias.data.dtype} differs from x's "
                             f"{x.data.dtype}")
    if native_float16(kernels, x.data.dtype):
        return _gelu16(x, bias, a2, kernels)              # one kernel each way
    y2 = kernels.gelu_forward(up(a2), None if bias is None else up(bias.data))[0]
    shape2 = a2.shape                                   # see [Note: 16-bit inputs]

    def backward(g):     # tanh again from the input, which the graph keeps (see [Note:
        a2 = up(x.data.reshape(shape2))                 # what ops keep] in rows.py)
        t2 = kernels.gelu_forward(a2, None if bias is None else up(bias.data))[1]
        g2 = up(g.reshape(shape2))
        if bias is None:
            return (cast(kernels.gelu_backward(a2, t2, g2), x.dtype).reshape(x.shape),)
        gx, gb = kernels.bias_gelu_backward(                # see [Note: gradient buffers]
            a2, up(bias.data), t2, g2, grad_buffer(bias, g2.dtype))
        return cast(gx, x.dtype).reshape(x.shape), gb if bias.requires_grad else None
    return make_result(cast(y2, x.dtype).reshape(x.shape), (x, bias), backward, "gelu")


def _gelu16(x, bias, a2, kernels) -> Tensor:
    """:func:`gelu` of float16 ``x`` on a GPU: float16 in and out, float32 inside (the
    same values as casting up, computing and casting down), its float32 tanh computed
    again in backward (one launch), not kept."""
    y2 = kernels.gelu16_forward(a2, None if bias is None else bias.data)[0]
    shape2 = a2.shape

    def backward(g):
        t2 = kernels.gelu16_forward(x.data.reshape(shape2),
                                    None if bias is None else bias.data)[1]
        need_b = bias is not None and bias.requires_grad
        gx, gb = kernels.gelu16_backward(                   # see [Note: gradient buffers]
            x.data.reshape(t2.shape), None if bias is None else bias.data, t2,
            g.reshape(t2.shape), need_b,
            grad_buffer(bias, np.dtype(np.float32)) if need_b else None)
        return (gx.reshape(x.shape),) if bias is None else (gx.reshape(x.shape), gb)
    return make_result(y2.reshape(x.shape), (x, bias), backward, "gelu")


# -- embedding -------------------------------------------------------------

@register_op
def embedding(indices, weight) -> Tensor:
    """Rows of ``weight`` picked by integer ``indices``: output ``indices.shape + (C,)``.

    Indices out of ``[0, rows)`` raise ValueError on NumPy. On a device, reading
    them back to check would be a host sync per call, so the check stays there:
    such rows come out NaN (and get no gradient), the loss turns NaN, and the
    step's one norm read skips the update (see [Note: collective step decisions]
    in mpishard/parallel/strategy.py).
    """
    weight = as_tensor(weight)
    idx = indices.data if isinstance(indices, Tensor) else indices
    n_rows, width = weight.shape
    if idx.dtype.kind not in "iu":
        raise ValueError(f"embedding: indices must be integers, got dtype {idx.dtype}")
    flat, bad = idx.reshape(-1), None
    if isinstance(idx, np.ndarray):
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n_rows):
            raise ValueError(f"embedding: index out of range [0, {n_rows}) for weight of "
                             f"shape {tuple(weight.shape)} (got min {int(idx.min())}, "
                             f"max {int(idx.max())})")
        out = weight.data[flat]
    else:
        xp = xp_of(idx)
        bad = ((flat < 0) | (flat >= n_rows))[:, None]
        flat = xp.clip(flat, 0, n_rows - 1)
        out = weight.data[flat]
        # a scalar of out's dtype, a kernel argument (asarray would copy it from the host)
        out = where_kept(xp, bad, out.dtype.type(float("nan")), out)
    out = out.reshape(idx.shape + (width,))

    def backward(g):
        g2 = up(g.reshape(-1, width))
        if bad is not None:
            g2 = xp_of(g2).where(bad, 0.0, g2)
        return (scatter_add_rows(n_rows, flat, g2),)
    return make_result(out, (weight,), backward, "embedding")


# -- dropout ---------------------------------------------------------------

@register_op
def dropout(x, p: float, rng, training: bool = True) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by ``1/(1-p)``.

    Args:
        rng: a seeded generator with ``random(shape, dtype=...)`` (NumPy's
            ``Generator`` or CuPy's), so masks are reproducible.

    One draw of float32 uniforms ``u`` (an element stays where ``u >= p``), then
    one kernel each way; backward keeps which elements stayed, a byte each, or the
    draws on a device (see [Note: what ops keep] in rows.py).
    """
    x = as_tensor(x)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: p must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    xp = xp_of(x.data)
    kernels = kernels_for(xp)
    u = draw_uniform(rng, x.shape, xp)
    kept = kept_mask(u, p)
    return make_result(kernels.dropout_add(None, x.data, u, p), (x,),
                       lambda g: (kernels.dropout_backward(g, kept, p),), "dropout")


@register_op
def dropout_add(x, y, p: float, rng, training: bool = True, bias=None) -> Tensor:
    """``x + dropout(y + bias, p)``: a residual connection, its branch's dropout and the
    branch's last bias (a linear layer's, left out of its output: see
    :func:`mpishard.nn.unbiased`) in one kernel each way, the draw of ``u`` as in
    :func:`dropout` (the same mask for the same generator state). ``x`` (None: no
    residual) and ``y`` have one shape; ``bias`` (None: none) is a row of it."""
    y = as_tensor(y)
    x = None if x is None else as_tensor(x)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_add: p must be in [0, 1), got {p}")
    drop = training and p > 0.0
    if bias is None:
        if x is None:
            return dropout(y, p, rng, training)
        if not drop:
            return x + y
    if x is not None and (x.shape != y.shape or x.data.dtype != y.data.dtype):
        raise ValueError(f"dropout_add: x {tuple(x.shape)} {x.data.dtype} and y "
                         f"{tuple(y.shape)} {y.data.dtype} must have one shape and dtype")
    xp = xp_of(y.data)
    kernels = kernels_for(xp)
    u = draw_uniform(rng, y.shape, xp) if drop else None
    kept = kept_mask(u, p) if drop else None     # see [Note: what ops keep] in rows.py
    if bias is None:
        return make_result(kernels.dropout_add(x.data, y.data, u, p), (x, y),
                           lambda g: (g, kernels.dropout_backward(g, kept, p)),
                           "dropout_add")
    bias = as_tensor(bias)
    check_last_dim("dropout_add", y, bias.shape[0], "bias size")
    if bias.data.dtype != y.data.dtype:
        raise ValueError(f"dropout_add: bias dtype {bias.data.dtype} differs from y's "
                         f"{y.data.dtype}")
    n = y.shape[-1]
    out = kernels.dropout_add(None if x is None else x.data.reshape(-1, n),
                              y.data.reshape(-1, n), u if u is None else u.reshape(-1, n),
                              p, bias.data)

    del u

    def backward(g):
        g2 = g.reshape(-1, n)
        gy, gb = kernels.bias_dropout_backward(           # see [Note: gradient buffers]
            g2, None if kept is None else kept.reshape(-1, n), p,
            grad_buffer(bias, col_sum_dtype(g2.dtype)))
        gy = gy.reshape(y.shape)
        if x is not None and kept is None:                # no dropout: both get g (a view
            gy = gy.copy()                                # of it: each its own array)
        return g, gy, gb if bias.requires_grad else None
    return make_result(out.reshape(y.shape), (x, y, bias), backward, "dropout_add")

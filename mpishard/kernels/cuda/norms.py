"""Layer norm and RMS norm on a GPU: one RawKernel each way, and one for the weight's
and bias's gradients; the fallbacks for rows the RawKernels do not take (part of
the GPU kernel set, :mod:`.ops`; the sources are :mod:`.norms_src`'s)."""
from __future__ import annotations

import numpy as np

from mpishard.core.backend import xp_of
from mpishard.core.dtypes import is_low_precision
from mpishard.kernels import reference
from mpishard.kernels.reference import up32
from mpishard.kernels.cuda.launch import (ROW_THREADS, column_launch, elementwise_kernel,
                                          is_strict_module, presence_flag, raw_function,
                                          raw_kernels_take, reduction_kernel)
from mpishard.kernels.cuda.norms_src import REDUCTIONS, SOURCES, norm_kernel_source
from mpishard.kernels.cuda.ops_src import ROWS16

__all__ = ["layer_norm_forward", "layer_norm_backward", "rms_norm_forward",
           "rms_norm_backward", "norm_param_grads"]


def _norm_kernel(xp, name: str, dtype, rows16=None):
    """The RawKernel ``name`` of :data:`.norms_src.NORM_KERNELS` for ``dtype`` (float32 or
    float64; with ``rows16`` a 16-bit dtype, float32 with the rows in that dtype)."""
    T = "float" if dtype == "float32" else "double"
    if rows16 is None:
        return raw_function(xp, f"{name}_{T}", lambda: norm_kernel_source(T))
    S, _, suffix = ROWS16[np.dtype(rows16).name]
    return raw_function(xp, f"{name}_{T}_{suffix}", lambda: norm_kernel_source(T, S))


def _fallback(xp, name: str):
    """The fallback's ElementwiseKernel or ReductionKernel ``name`` (see :mod:`.norms_src`)."""
    if name in SOURCES:
        return elementwise_kernel(xp, name, SOURCES)
    return reduction_kernel(xp, name, REDUCTIONS)


def _rows16(rows, *float32s) -> bool:
    """Whether the norms' RawKernels take ``rows`` (arrays or None) as 16-bit rows of one
    dtype and ``float32s`` as their float32 statistics: all C-contiguous (see [Note:
    float16 rows])."""
    first = rows[0]
    return (first is not None and first.dtype.name in ROWS16
            and all(a is None or (a.dtype == first.dtype and a.flags.c_contiguous)
                    for a in rows)
            and all(a is None or (a.dtype == np.float32 and a.flags.c_contiguous)
                    for a in float32s))


# [Note: float16 rows]
# Under float16 mixed precision a norm's input, weight, bias, output and gradients are
# float16 while its statistics (xhat, rstd) and the weight's and bias's gradients are
# float32. The norms' RawKernels read and write the float16 rows themselves (the
# module built with S = __half, computing in float): the values of casting the rows
# up, running the float32 kernel and casting its results down, without the 7 cast
# launches per layer norm around it (RMS norm: the same kernels, not centred).
# bfloat16 rows are the same with S = __nv_bfloat16 (a module of their own). The ops
# use this where NATIVE_FLOAT16 says so;
# on the strict module the same math runs as the reference on the cast rows, one
# launch per kernel.


def _norm_forward(x, weight, bias, eps: float, centred: bool):
    """Layer norm (``centred``) or RMS norm forward: one RawKernel launch."""
    xp = xp_of(x)
    y, xhat = xp.empty_like(x), xp.empty_like(x)
    rstd = xp.empty(x.shape[0], dtype=x.dtype)
    if x.shape[0]:
        _norm_kernel(xp, "mpishard_norm_forward", x.dtype.name)(
            (x.shape[0],), (ROW_THREADS,),
            (x, x if weight is None else weight, x if bias is None else bias, y, xhat, rstd,
             np.int32(x.shape[1]), x.dtype.type(eps), np.int32(centred), presence_flag(weight),
             presence_flag(bias)))
    return y, xhat, rstd


def _ones_zeros(x, weight, bias):
    xp, n = xp_of(x), x.shape[1]
    return (weight if weight is not None else xp.ones(n, x.dtype),
            bias if bias is not None else xp.zeros(n, x.dtype))


def _norm_forward16(x, weight, bias, eps: float, centred: bool):
    xp = xp_of(x)
    y = xp.empty_like(x)
    xhat = xp.empty(x.shape, dtype=np.float32)
    rstd = xp.empty(x.shape[0], dtype=np.float32)
    if x.shape[0]:
        _norm_kernel(xp, "mpishard_norm_forward", "float32", rows16=x.dtype)(
            (x.shape[0],), (ROW_THREADS,),
            (x, x if weight is None else weight, x if bias is None else bias, y, xhat, rstd,
             np.int32(x.shape[1]), np.float32(eps), np.int32(centred), presence_flag(weight),
             presence_flag(bias)))
    return y, xhat, rstd


def _forward16(x, weight, bias, eps: float, centred: bool):
    """Either norm's forward of 16-bit rows (see [Note: float16 rows]): the 16-bit
    kernel (on the strict module the reference on the cast rows, one launch), or for
    rows it does not take the float32 path on rows cast up, cast down after."""
    xp = xp_of(x)
    if _rows16((x, weight, bias)) and not is_strict_module(xp):
        return _norm_forward16(x, weight, bias, eps, centred)

    def cast_up(layer_norm, rms_norm):      # the float32 math on the rows cast up, the
        if centred:                         # output cast down
            y, h, r = layer_norm(up32(x), up32(weight), up32(bias), eps)
        else:
            y, h, r = rms_norm(up32(x), up32(weight), eps)
        return y.astype(x.dtype), h, r
    if _rows16((x, weight, bias)):                              # the strict module
        with xp.syncs.fused("mpishard_layer_norm_forward" if centred
                            else "mpishard_rms_norm_forward"):
            return cast_up(reference.layer_norm_forward, reference.rms_norm_forward)
    return cast_up(layer_norm_forward, rms_norm_forward)


def layer_norm_forward(x, weight, bias, eps: float):
    xp = xp_of(x)
    if is_low_precision(x.dtype):                               # see [Note: float16 rows]
        return _forward16(x, weight, bias, eps, centred=True)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_layer_norm_forward"):
            return reference.layer_norm_forward(x, weight, bias, eps)
    if raw_kernels_take(x, weight, bias):
        return _norm_forward(x, weight, bias, eps, centred=True)
    inv_n = 1.0 / max(x.shape[1], 1)    # the fallback: 2 row reductions and 1 map
    w, b = _ones_zeros(x, weight, bias)
    mu = _fallback(xp, "mpishard_row_mean")(x, inv_n, axis=1)
    rstd = _fallback(xp, "mpishard_row_rstd")(x, mu[:, None], inv_n, eps, axis=1)
    y, h = _fallback(xp, "mpishard_norm_apply")(x, mu[:, None], rstd[:, None], w, b)
    return y, h, rstd


def _norm_backward(g, xhat, rstd, weight, centred: bool, into=None):
    """Layer norm's input gradient (``centred``) or RMS norm's: one RawKernel launch,
    also when added ``into`` the gradient so far (the fallback: 3 launches, or 2, and
    one more to add)."""
    xp = xp_of(g)
    sixteen = is_low_precision(g.dtype)
    if sixteen and into is not None:                            # see [Note: float16 rows]
        into += _norm_backward(g, xhat, rstd, weight, centred)
        return into
    if sixteen and not _rows16((g, weight), xhat, rstd):        # cast up, down
        return _norm_backward(up32(g), xhat, rstd, up32(weight), centred).astype(g.dtype)
    if sixteen:
        if is_strict_module(xp):
            name = "layer_norm_backward" if centred else "rms_norm_backward"
            with xp.syncs.fused(f"mpishard_{name}"):
                return getattr(reference, name)(up32(g), xhat, rstd, up32(weight)) \
                    .astype(g.dtype)
        gx = xp.empty_like(g)
        if g.shape[0]:
            _norm_kernel(xp, "mpishard_norm_backward", "float32", rows16=g.dtype)(
                (g.shape[0],), (ROW_THREADS,),
                (g, xhat, rstd, g if weight is None else weight, gx, np.int32(g.shape[1]),
                 np.int32(centred), presence_flag(weight), np.int32(0)))
        return gx
    if is_strict_module(xp):
        name = "layer_norm_backward" if centred else "rms_norm_backward"
        with xp.syncs.fused(f"mpishard_{name}"):
            return getattr(reference, name)(g, xhat, rstd, weight, into)
    if raw_kernels_take(g, xhat, rstd, weight, into):
        gx = xp.empty_like(g) if into is None else into
        if g.shape[0]:
            _norm_kernel(xp, "mpishard_norm_backward", g.dtype.name)(
                (g.shape[0],), (ROW_THREADS,),
                (g, xhat, rstd, g if weight is None else weight, gx, np.int32(g.shape[1]),
                 np.int32(centred), presence_flag(weight), presence_flag(into)))
        return gx
    if into is not None:
        into += _norm_backward(g, xhat, rstd, weight, centred)
        return into
    inv_n = 1.0 / max(g.shape[1], 1)
    w, _ = _ones_zeros(g, weight, None)
    mgh = _fallback(xp, "mpishard_row_mean_gwh")(g, w, xhat, inv_n, axis=1)
    if not centred:
        return _fallback(xp, "mpishard_rms_norm_grad")(g, w, xhat, mgh[:, None], rstd[:, None])
    mg = _fallback(xp, "mpishard_row_mean_gw")(g, w, inv_n, axis=1)
    return _fallback(xp, "mpishard_layer_norm_grad")(g, w, xhat, mg[:, None], mgh[:, None],
                                                   rstd[:, None])


def layer_norm_backward(g, xhat, rstd, weight, into=None):
    return _norm_backward(g, xhat, rstd, weight, centred=True, into=into)


def rms_norm_forward(x, weight, eps: float):
    xp = xp_of(x)
    if is_low_precision(x.dtype):                               # see [Note: float16 rows]
        return _forward16(x, weight, None, eps, centred=False)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_rms_norm_forward"):
            return reference.rms_norm_forward(x, weight, eps)
    if raw_kernels_take(x, weight):
        return _norm_forward(x, weight, None, eps, centred=False)
    inv_n = 1.0 / max(x.shape[1], 1)    # the fallback: 1 row reduction and 1 map
    w, _ = _ones_zeros(x, weight, None)
    rstd = _fallback(xp, "mpishard_row_rms_rstd")(x, inv_n, eps, axis=1)
    y, h = _fallback(xp, "mpishard_rms_apply")(x, rstd[:, None], w)
    return y, h, rstd


def rms_norm_backward(g, xhat, rstd, weight, into=None):
    return _norm_backward(g, xhat, rstd, weight, centred=False, into=into)


def norm_param_grads(g, xhat, need_weight: bool, need_bias: bool, out_weight=None,
                     out_bias=None):
    xp = xp_of(g)
    if not (need_weight or need_bias):
        return None, None
    rows16 = is_low_precision(g.dtype) and _rows16(
        (g,), xhat, out_weight if need_weight else None, out_bias if need_bias else None)
    if is_low_precision(g.dtype) and not rows16:                # cast up
        return norm_param_grads(up32(g), xhat, need_weight, need_bias, out_weight, out_bias)
    if rows16 and is_strict_module(xp):                               # see [Note: float16 rows]
        with xp.syncs.fused("mpishard_norm_param_grads"):
            return reference.norm_param_grads(up32(g), xhat, need_weight, need_bias,
                                              out_weight, out_bias)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_norm_param_grads"):
            return reference.norm_param_grads(g, xhat, need_weight, need_bias, out_weight,
                                              out_bias)
    if not rows16 and not raw_kernels_take(g, xhat, out_weight if need_weight else None,
                                     out_bias if need_bias else None):
        return reference.norm_param_grads(g, xhat, need_weight, need_bias, out_weight,
                                          out_bias)
    rows, n = g.shape

    def into(need, out):                # the given buffer, else a fresh one, if needed
        if not need:
            return None
        return xp.empty(n, dtype=xhat.dtype) if out is None else out
    gw, gb = into(need_weight, out_weight), into(need_bias, out_bias)
    if n:
        grid, block, tail = column_launch(xp, rows, n, need_weight + need_bias, xhat.dtype)
        _norm_kernel(xp, "mpishard_norm_param_grads", xhat.dtype.name,
                     g.dtype if rows16 else None)(
            grid, block,
            (g, xhat, g if gw is None else gw, g if gb is None else gb, np.int64(rows),
             np.int32(n), presence_flag(gw), presence_flag(gb), *tail))
    return gw, gb

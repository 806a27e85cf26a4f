"""GPU kernels: each op as one compiled CuPy kernel launch, the rest as the references.

A chain of NumPy-style operations on CuPy is one kernel launch per operation,
each reading and writing the whole array in device memory. Here each kernel is
one launch, reading its inputs once and writing its outputs once:

* GELU, SwiGLU, Adam and dropout (``dropout_add``, ``dropout_backward``; also on
  float16) are each one ``cupy.ElementwiseKernel`` (compiled once per dtype, on
  first use), where the references take 5 to 12 launches;
* layer norm and RMS norm, forward and backward, are one ``cupy.RawKernel`` each
  (:data:`ROW_KERNELS`: a thread block per row, the row's sums as block
  reductions, then its outputs), where the reference takes about 10; their weight
  and bias gradients (:func:`norm_param_grads`) are one more, a thread block per 32
  columns, where the models took a product and two column sums;
* attention's softmax is one RawKernel each way, a thread block per row (scale,
  causal mask, max, exp, sum and normalise forward, and the dropout of the
  weights; the dropout of the gradient, the row dot product and the product
  backward), where the reference takes 7 and 4 launches and a mask array (and
  dropout 4 and 2 more); plain row softmax runs as the reference.

The RawKernels take C-contiguous float32 / float64 rows; other inputs fall back
to the reference (the norms: to a row reduction per statistic and one
elementwise kernel, 3 launches for layer norm and 2 for RMS norm each way).

On the CuPy-strict test module the same functions run the reference math inside
``strict.syncs.fused(name)``, so a test or ``benchmarks/syncs.py`` counts each
fused kernel as the one launch it is on a GPU. The CUDA bodies below are the
reference formulas, term for term; the GPU check compares them with NumPy.
"""
from __future__ import annotations

import numpy as np

from ..backend import xp_of
from . import reference
from .cuda_sources import FLOAT16_SOURCES, REDUCTIONS, ROW_KERNELS, SOURCES  # noqa: F401

__all__ = ["NAME", "gelu_forward", "gelu_backward", "layer_norm_forward",
           "layer_norm_backward", "rms_norm_forward", "rms_norm_backward", "norm_param_grads",
           "swiglu_forward", "swiglu_backward", "dropout_add", "dropout_backward",
           "bias_gelu_backward", "bias_dropout_backward",
           "softmax_rows", "causal_softmax", "softmax_backward", "unpack_heads",
           "adam_update", "sq_sum"]

NAME = "gpu"

softmax_rows = reference.softmax_rows

ROW_THREADS = 256
#: row threads per block of :func:`norm_param_grads` (32 columns each; at most 32)
PARAM_ROW_THREADS = 32
_compiled: dict = {}


def _is_strict(xp) -> bool:
    return getattr(xp, "NAME", None) == "strict"


def _kernel(xp, name: str):
    """The compiled kernel ``name`` (CuPy caches the binaries per dtype)."""
    kernel = _compiled.get(name)
    if kernel is None:
        if name in SOURCES:
            inputs, outputs, body = SOURCES[name]
            kernel = xp.ElementwiseKernel(inputs, outputs, body, name)
        else:
            inputs, outputs, mapped, reduce, post = REDUCTIONS[name]
            kernel = xp.ReductionKernel(inputs, outputs, mapped, reduce, post, "0", name)
        _compiled[name] = kernel
    return kernel


def _row_kernel(xp, name: str, dtype):
    """The RawKernel ``name`` of :data:`ROW_KERNELS` for ``dtype`` (float32 or float64)."""
    T = "float" if dtype == "float32" else "double"
    key = f"{name}_{T}"
    kernel = _compiled.get(key)
    if kernel is None:
        kernel = _compiled[key] = xp.RawModule(code=ROW_KERNELS.replace("{T}", T)) \
            .get_function(key)
    return kernel


def _raw_ready(*arrays, drop_u=None) -> bool:
    """Whether the RawKernels take these arrays (None: absent): one dtype, float32 or
    float64, all C-contiguous; dropout draws ``drop_u`` float32 and C-contiguous."""
    present = [a for a in arrays if a is not None]
    dtype = present[0].dtype
    return (dtype.name in ("float32", "float64")
            and all(a.dtype == dtype and a.flags.c_contiguous for a in present)
            and (drop_u is None or (drop_u.dtype.name == "float32"
                                    and drop_u.flags.c_contiguous)))


def _flag(a) -> np.int32:
    return np.int32(a is not None)


def _dropout_args(drop_u, drop_p: float, stand_in, dtype) -> tuple:
    """The row kernels' dropout arguments: the flag, draws, p and 1 / (1 - p) in T (with
    no dropout: flag 0, ``stand_in`` for the draws)."""
    return (_flag(drop_u), stand_in if drop_u is None else drop_u, np.float32(drop_p),
            dtype.type(1.0 / (1.0 - drop_p)))


def causal_softmax(a, T: int, scale: float, drop_u=None, drop_p: float = 0.0, dropped=None):
    xp = xp_of(a)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_causal_softmax"):
            return reference.causal_softmax(a, T, scale, drop_u, drop_p, dropped)
    if not _raw_ready(a, dropped, drop_u=drop_u):
        return reference.causal_softmax(a, T, scale, drop_u, drop_p, dropped)
    if drop_u is not None and dropped is None:
        dropped = xp.empty_like(a)
    if a.shape[0]:                        # no rows: no blocks to launch
        _row_kernel(xp, "mpishard_causal_softmax", a.dtype.name)(
            (a.shape[0],), (ROW_THREADS,),
            (a, np.int32(T), a.dtype.type(scale), *_dropout_args(drop_u, drop_p, a, a.dtype),
             a if dropped is None else dropped))
    return dropped


def softmax_backward(d, p, scale: float, drop_u=None, drop_p: float = 0.0,
                     dropped=None) -> None:
    xp = xp_of(d)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_softmax_backward"):
            reference.softmax_backward(d, p, scale, drop_u, drop_p, dropped)
        return
    if not _raw_ready(d, p, dropped, drop_u=drop_u):
        reference.softmax_backward(d, p, scale, drop_u, drop_p, dropped)
        return
    if d.shape[0]:
        _row_kernel(xp, "mpishard_softmax_backward", d.dtype.name)(
            (d.shape[0],), (ROW_THREADS,),
            (d, p, np.int32(d.shape[1]), d.dtype.type(scale),
             *_dropout_args(drop_u, drop_p, d, d.dtype),
             np.int32(drop_u is not None and dropped is not None),
             d if dropped is None else dropped))


def _norm_forward(x, weight, bias, eps: float, centred: bool):
    """Layer norm (``centred``) or RMS norm forward: one RawKernel launch."""
    xp = xp_of(x)
    y, xhat = xp.empty_like(x), xp.empty_like(x)
    rstd = xp.empty(x.shape[0], dtype=x.dtype)
    if x.shape[0]:
        _row_kernel(xp, "mpishard_norm_forward", x.dtype.name)(
            (x.shape[0],), (ROW_THREADS,),
            (x, x if weight is None else weight, x if bias is None else bias, y, xhat, rstd,
             np.int32(x.shape[1]), x.dtype.type(eps), np.int32(centred), _flag(weight),
             _flag(bias)))
    return y, xhat, rstd


def _ones_zeros(x, weight, bias):
    xp, n = xp_of(x), x.shape[1]
    return (weight if weight is not None else xp.ones(n, x.dtype),
            bias if bias is not None else xp.zeros(n, x.dtype))


def layer_norm_forward(x, weight, bias, eps: float):
    xp = xp_of(x)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_layer_norm_forward"):
            return reference.layer_norm_forward(x, weight, bias, eps)
    if _raw_ready(x, weight, bias):
        return _norm_forward(x, weight, bias, eps, centred=True)
    inv_n = 1.0 / max(x.shape[1], 1)    # the fallback: 2 row reductions and 1 map
    w, b = _ones_zeros(x, weight, bias)
    mu = _kernel(xp, "mpishard_row_mean")(x, inv_n, axis=1)
    rstd = _kernel(xp, "mpishard_row_rstd")(x, mu[:, None], inv_n, eps, axis=1)
    y, h = _kernel(xp, "mpishard_norm_apply")(x, mu[:, None], rstd[:, None], w, b)
    return y, h, rstd


def _norm_backward(g, xhat, rstd, weight, centred: bool, into=None):
    """Layer norm's input gradient (``centred``) or RMS norm's: one RawKernel launch,
    also when added ``into`` the gradient so far (the fallback: 3 launches, or 2, and
    one more to add)."""
    xp = xp_of(g)
    if _is_strict(xp):
        name = "layer_norm_backward" if centred else "rms_norm_backward"
        with xp.syncs.fused(f"mpishard_{name}"):
            return getattr(reference, name)(g, xhat, rstd, weight, into)
    if _raw_ready(g, xhat, rstd, weight, into):
        gx = xp.empty_like(g) if into is None else into
        if g.shape[0]:
            _row_kernel(xp, "mpishard_norm_backward", g.dtype.name)(
                (g.shape[0],), (ROW_THREADS,),
                (g, xhat, rstd, g if weight is None else weight, gx, np.int32(g.shape[1]),
                 np.int32(centred), _flag(weight), _flag(into)))
        return gx
    if into is not None:
        into += _norm_backward(g, xhat, rstd, weight, centred)
        return into
    inv_n = 1.0 / max(g.shape[1], 1)
    w, _ = _ones_zeros(g, weight, None)
    mgh = _kernel(xp, "mpishard_row_mean_gwh")(g, w, xhat, inv_n, axis=1)
    if not centred:
        return _kernel(xp, "mpishard_rms_norm_grad")(g, w, xhat, mgh[:, None], rstd[:, None])
    mg = _kernel(xp, "mpishard_row_mean_gw")(g, w, inv_n, axis=1)
    return _kernel(xp, "mpishard_layer_norm_grad")(g, w, xhat, mg[:, None], mgh[:, None],
                                                   rstd[:, None])


def layer_norm_backward(g, xhat, rstd, weight, into=None):
    return _norm_backward(g, xhat, rstd, weight, centred=True, into=into)


def rms_norm_forward(x, weight, eps: float):
    xp = xp_of(x)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_rms_norm_forward"):
            return reference.rms_norm_forward(x, weight, eps)
    if _raw_ready(x, weight):
        return _norm_forward(x, weight, None, eps, centred=False)
    inv_n = 1.0 / max(x.shape[1], 1)    # the fallback: 1 row reduction and 1 map
    w, _ = _ones_zeros(x, weight, None)
    rstd = _kernel(xp, "mpishard_row_rms_rstd")(x, inv_n, eps, axis=1)
    y, h = _kernel(xp, "mpishard_rms_apply")(x, rstd[:, None], w)
    return y, h, rstd


def rms_norm_backward(g, xhat, rstd, weight, into=None):
    return _norm_backward(g, xhat, rstd, weight, centred=False, into=into)


def norm_param_grads(g, xhat, need_weight: bool, need_bias: bool, out_weight=None,
                     out_bias=None):
    xp = xp_of(g)
    if not (need_weight or need_bias):
        return None, None
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_norm_param_grads"):
            return reference.norm_param_grads(g, xhat, need_weight, need_bias, out_weight,
                                              out_bias)
    if not _raw_ready(g, xhat, out_weight if need_weight else None,
                      out_bias if need_bias else None):
        return reference.norm_param_grads(g, xhat, need_weight, need_bias, out_weight,
                                          out_bias)
    rows, n = g.shape

    def into(need, out):                # the given buffer, else a fresh one, if needed
        if not need:
            return None
        return xp.empty(n, dtype=g.dtype) if out is None else out
    gw, gb = into(need_weight, out_weight), into(need_bias, out_bias)
    if n:
        _row_kernel(xp, "mpishard_norm_param_grads", g.dtype.name)(
            *_column_blocks(n),
            (g, xhat, g if gw is None else gw, g if gb is None else gb, np.int64(rows),
             np.int32(n), _flag(gw), _flag(gb)))
    return gw, gb


def dropout_add(x, y, u, p: float, bias=None):
    xp = xp_of(y)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_dropout_add"):
            return reference.dropout_add(x, y, u, p, bias)
    if u is None and bias is None:
        return reference.dropout_add(x, y, u, p)
    scale = 1.0 / (1.0 - p)
    if bias is None:
        if x is None:
            return _kernel(xp, "mpishard_dropout")(y, u, p, scale)
        return _kernel(xp, "mpishard_dropout_add")(x, y, u, p, scale)
    if u is None:                               # the bias and the residual, no dropout
        return _kernel(xp, "mpishard_add_bias")(y, bias) if x is None else \
            _kernel(xp, "mpishard_bias_add")(x, y, bias)
    if x is None:
        return _kernel(xp, "mpishard_bias_dropout")(y, bias, u, p, scale)
    return _kernel(xp, "mpishard_bias_dropout_add")(x, y, bias, u, p, scale)


def _column_blocks(n: int) -> tuple:
    """Grid and block of the column-sum RawKernels: 32 columns per block."""
    return (-(-n // 32),), (32, PARAM_ROW_THREADS)


def bias_dropout_backward(g, u, p: float, out_bias=None):
    xp = xp_of(g)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_bias_dropout_backward"):
            return reference.bias_dropout_backward(g, u, p, out_bias)
    if not _raw_ready(g, out_bias, drop_u=u):
        return reference.bias_dropout_backward(g, u, p, out_bias)
    rows, n = g.shape
    gy = g if u is None else xp.empty_like(g)
    gb = xp.empty(n, dtype=g.dtype) if out_bias is None else out_bias
    if n:
        _row_kernel(xp, "mpishard_bias_dropout_backward", g.dtype.name)(
            *_column_blocks(n), (g, *_dropout_args(u, p, g, g.dtype), gy, gb,
                                 np.int64(rows), np.int32(n)))
    return gy, gb


def bias_gelu_backward(a, bias, t, g, out_bias=None):
    xp = xp_of(a)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_bias_gelu_backward"):
            return reference.bias_gelu_backward(a, bias, t, g, out_bias)
    if not _raw_ready(a, bias, t, g, out_bias):
        return reference.bias_gelu_backward(a, bias, t, g, out_bias)
    rows, n = g.shape
    gx = xp.empty_like(g)
    gb = xp.empty(n, dtype=g.dtype) if out_bias is None else out_bias
    if n:
        _row_kernel(xp, "mpishard_bias_gelu_backward", g.dtype.name)(
            *_column_blocks(n), (a, bias, t, g, gx, gb, np.int64(rows), np.int32(n)))
    return gx, gb


def unpack_heads(h, need_sum: bool = False, out_sum=None, dtype=None):
    xp = xp_of(h)
    if not (_raw_ready(h, out_sum if need_sum else None)      # 16-bit: the copy, the
            and (dtype is None or np.dtype(dtype) == h.dtype)):  # cast, the sums
        return reference.unpack_heads(h, need_sum, out_sum, dtype)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_unpack_heads"):
            return reference.unpack_heads(h, need_sum, out_sum, dtype)
    _, B, nh, T, hs = h.shape
    n = 3 * nh * hs
    rows = xp.empty((B * T, n), dtype=h.dtype)
    sums = (xp.empty(n, dtype=h.dtype) if out_sum is None else out_sum) if need_sum else None
    if n:                                 # no rows: the sums are zeros
        _row_kernel(xp, "mpishard_unpack_heads", h.dtype.name)(
            *_column_blocks(n), (h, rows, _flag(sums), h if sums is None else sums,
                                 np.int64(B), np.int32(T), np.int32(nh), np.int32(hs)))
    return rows, sums


def sq_sum(x, out):
    xp = xp_of(x)
    if x.dtype.name not in ("float32", "float64"):  # 16-bit: the copy, the product
        return reference.sq_sum(x, out)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_sq_sum"):
            return reference.sq_sum(x, out)
    return _kernel(xp, "mpishard_sq_sum")(x.reshape(-1), axis=0, keepdims=True, out=out)


def dropout_backward(g, u, p: float):
    xp = xp_of(g)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_dropout_backward"):
            return reference.dropout_backward(g, u, p)
    return _kernel(xp, "mpishard_dropout")(g, u, p, 1.0 / (1.0 - p))


def gelu_forward(a, bias=None):
    xp = xp_of(a)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_gelu_forward"):
            return reference.gelu_forward(a, bias)
    if bias is not None:
        return _kernel(xp, "mpishard_bias_gelu_forward")(a, bias)
    return _kernel(xp, "mpishard_gelu_forward")(a)


def gelu_backward(a, t, g):
    xp = xp_of(a)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_gelu_backward"):
            return reference.gelu_backward(a, t, g)
    return _kernel(xp, "mpishard_gelu_backward")(a, t, g)


def swiglu_forward(gate, up):
    xp = xp_of(gate)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_swiglu_forward"):
            return reference.swiglu_forward(gate, up)
    return _kernel(xp, "mpishard_swiglu_forward")(gate, up)


def swiglu_backward(gate, up, s, grad, need_gate: bool = True, need_up: bool = True):
    xp = xp_of(gate)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_swiglu_backward"):
            g_gate, g_up = reference.swiglu_backward(gate, up, s, grad)
    else:
        g_gate, g_up = _kernel(xp, "mpishard_swiglu_backward")(gate, up, s, grad)
    return (g_gate if need_gate else None), (g_up if need_up else None)


def adam_update(param, grad, m, v, beta1: float, beta2: float, step_size: float,
                inv_bias2: float, eps: float) -> None:
    xp = xp_of(param)
    if _is_strict(xp):
        with xp.syncs.fused("mpishard_adam_update"):
            reference.adam_update(param, grad, m, v, beta1, beta2, step_size, inv_bias2, eps)
        return
    _kernel(xp, "mpishard_adam_update")(grad, beta1, beta2, step_size, inv_bias2, eps,
                                        param, m, v)

"""GPU kernels: a kernel set (:class:`~mpishard.kernels.protocol.KernelSet`), each kernel
one compiled CuPy kernel launch, the rest as the references.

A chain of NumPy-style operations on CuPy is one kernel launch per operation,
each reading and writing the whole array in device memory. Here each kernel is
one launch, reading its inputs once and writing its outputs once:

* GELU, SwiGLU and dropout (``dropout_add``, ``dropout_backward``; also on float16,
  and on bfloat16 through twins that take the arrays' 16-bit words) are each one
  ``cupy.ElementwiseKernel`` (compiled once per dtype, on first use), where the
  references take 5 to 12 launches;
* attention's softmax is one RawKernel each way, a thread block per row (scale,
  causal mask, max, exp, sum and normalise forward, and the dropout of the
  weights; the dropout of the gradient, the row dot product and the product
  backward), where the reference takes 7 and 4 launches and a mask array (and
  dropout 4 and 2 more); a bias's gradient with GELU's or dropout's backward, and
  attention's q, k and v gradients back to rows, one RawKernel each, a thread block
  per 32 columns and group of rows (see [Note: column sums] in ops_src.py); plain row
  softmax runs as the reference;
* layer norm and RMS norm are :mod:`.norms`' (one RawKernel each way, and one for
  their weight and bias gradients), fused attention :mod:`.attention`'s, the rotary
  embeddings packed with grouped key/value heads :mod:`.rotary`'s, Adam and the
  gradients' sums of squares :mod:`.multi`'s.

The sources are :mod:`.ops_src`'s. The RawKernels take C-contiguous float32 / float64
rows; GELU and SwiGLU take float16 and bfloat16 rows through their 16-bit
ElementwiseKernels (``NATIVE_FLOAT16``), as the norms and fused attention do (see
[Note: float16 rows] in norms.py); other inputs fall back to the reference.

On the CuPy-strict test module the same functions run the reference math inside
``strict.syncs.fused(name)``, so a test or ``benchmarks/syncs.py`` counts each
fused kernel as the one launch it is on a GPU. The CUDA bodies are the reference
formulas, term for term; the GPU check compares them with NumPy.
"""
from __future__ import annotations

import contextlib

import numpy as np

from mpishard.core.backend import xp_of
from mpishard.core.dtypes import bfloat16_words
from mpishard.kernels import reference
from mpishard.kernels.reference import up32
from mpishard.kernels.protocol import KERNEL_NAMES
from mpishard.kernels.cuda.ops_src import (BF16_WORDS, BFLOAT16_SOURCES, ROWS16, SOURCES,
                                           row_kernel_source)
from mpishard.kernels.cuda.launch import (ROW_THREADS, column_launch, dropout_arguments,
                                          elementwise_kernel, is_strict_module,
                                          presence_flag, raw_function, raw_kernels_take)
# the rest of the set, each kernel beside its own source (see mpishard/kernels/cuda/__init__.py)
from mpishard.kernels.cuda.attention import flash_attention_backward, flash_attention_forward
from mpishard.kernels.cuda.loss import cross_entropy_backward, cross_entropy_forward
from mpishard.kernels.cuda.multi import adam_update, multi_adam_update, multi_sq_sum, sq_sum
from mpishard.kernels.cuda.norms import (layer_norm_backward, layer_norm_forward,
                                         norm_param_grads, rms_norm_backward,
                                         rms_norm_forward)
from mpishard.kernels.cuda.rotary import rope_qkv_backward, rope_qkv_forward

__all__ = ["NAME", "NATIVE_FLOAT16", *KERNEL_NAMES, "row_kernel"]

NAME = "gpu"
#: :func:`gelu16_forward` / :func:`gelu16_backward` take float16 and bfloat16 rows in one
#: kernel each way, and the norms and SwiGLU 16-bit rows (the ops use them instead of
#: casting up and down)
NATIVE_FLOAT16 = True


def _elementwise(xp, name: str, *args):
    """ElementwiseKernel ``name`` of :data:`.ops_src.SOURCES` run on ``args``; on bfloat16
    data its twin of :data:`.ops_src.BFLOAT16_SOURCES`, which takes the arrays' 16-bit
    words and gives words back, returned as bfloat16 arrays (see [Note: bfloat16 on
    devices] in mpishard/core/dtypes.py)."""
    bf16 = next((a.dtype for a in args if getattr(a, "dtype", None) is not None
                 and a.dtype.name == "bfloat16"), None)
    if bf16 is None:
        return elementwise_kernel(xp, name, SOURCES)(*args)
    kernel = elementwise_kernel(xp, f"{name}_bf16", BFLOAT16_SOURCES, BF16_WORDS)
    out = kernel(*(bfloat16_words(a) if getattr(a, "dtype", None) == bf16 else a
                   for a in args))
    back = tuple(o.view(bf16) if o.dtype == np.uint16 else o
                 for o in (out if isinstance(out, tuple) else (out,)))
    return back if isinstance(out, tuple) else back[0]


def row_kernel(xp, name: str, dtype):
    """The RawKernel ``name`` of :data:`.ops_src.ROW_KERNELS` for ``dtype`` (float32 or
    float64)."""
    T = "float" if dtype == "float32" else "double"
    return raw_function(xp, f"{name}_{T}", lambda: row_kernel_source(T))


softmax_rows = reference.softmax_rows


def causal_softmax(a, T: int, scale: float, drop_u=None, drop_p: float = 0.0, dropped=None):
    xp = xp_of(a)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_causal_softmax"):
            return reference.causal_softmax(a, T, scale, drop_u, drop_p, dropped)
    if not raw_kernels_take(a, dropped, drop_u=drop_u):
        return reference.causal_softmax(a, T, scale, drop_u, drop_p, dropped)
    if drop_u is not None and dropped is None:
        dropped = xp.empty_like(a)
    if a.shape[0]:                        # no rows: no blocks to launch
        row_kernel(xp, "mpishard_causal_softmax", a.dtype.name)(
            (a.shape[0],), (ROW_THREADS,),
            (a, np.int32(T), a.dtype.type(scale),
             *dropout_arguments(drop_u, drop_p, a, a.dtype), a if dropped is None else dropped))
    return dropped


def softmax_backward(d, p, scale: float, drop_u=None, drop_p: float = 0.0,
                     dropped=None) -> None:
    xp = xp_of(d)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_softmax_backward"):
            reference.softmax_backward(d, p, scale, drop_u, drop_p, dropped)
        return
    if not raw_kernels_take(d, p, dropped, drop_u=drop_u):
        reference.softmax_backward(d, p, scale, drop_u, drop_p, dropped)
        return
    if d.shape[0]:
        row_kernel(xp, "mpishard_softmax_backward", d.dtype.name)(
            (d.shape[0],), (ROW_THREADS,),
            (d, p, np.int32(d.shape[1]), d.dtype.type(scale),
             *dropout_arguments(drop_u, drop_p, d, d.dtype),
             np.int32(drop_u is not None and dropped is not None),
             d if dropped is None else dropped))


def dropout_add(x, y, u, p: float, bias=None):
    xp = xp_of(y)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_dropout_add"):
            return reference.dropout_add(x, y, u, p, bias)
    if u is None and bias is None:
        return reference.dropout_add(x, y, u, p)
    scale = 1.0 / (1.0 - p)
    if bias is None:
        if x is None:
            return _elementwise(xp, "mpishard_dropout", y, u, p, scale)
        return _elementwise(xp, "mpishard_dropout_add", x, y, u, p, scale)
    if u is None:                               # the bias and the residual, no dropout
        return _elementwise(xp, "mpishard_add_bias", y, bias) if x is None else \
            _elementwise(xp, "mpishard_bias_add", x, y, bias)
    if x is None:
        return _elementwise(xp, "mpishard_bias_dropout", y, bias, u, p, scale)
    return _elementwise(xp, "mpishard_bias_dropout_add", x, y, bias, u, p, scale)


def bias_dropout_backward(g, u, p: float, out_bias=None):
    xp = xp_of(g)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_bias_dropout_backward"):
            return reference.bias_dropout_backward(g, u, p, out_bias)
    if not raw_kernels_take(g, out_bias, drop_u=u):
        return reference.bias_dropout_backward(g, u, p, out_bias)
    rows, n = g.shape
    gy = g if u is None else xp.empty_like(g)
    gb = xp.empty(n, dtype=g.dtype) if out_bias is None else out_bias
    if n:
        grid, block, tail = column_launch(xp, rows, n, 1, g.dtype)
        row_kernel(xp, "mpishard_bias_dropout_backward", g.dtype.name)(
            grid, block, (g, *dropout_arguments(u, p, g, g.dtype), gy, gb, np.int64(rows),
                          np.int32(n), *tail))
    return gy, gb


def bias_gelu_backward(a, bias, t, g, out_bias=None):
    xp = xp_of(a)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_bias_gelu_backward"):
            return reference.bias_gelu_backward(a, bias, t, g, out_bias)
    if not raw_kernels_take(a, bias, t, g, out_bias):
        return reference.bias_gelu_backward(a, bias, t, g, out_bias)
    rows, n = g.shape
    gx = xp.empty_like(g)
    gb = xp.empty(n, dtype=g.dtype) if out_bias is None else out_bias
    if n:
        grid, block, tail = column_launch(xp, rows, n, 1, g.dtype)
        row_kernel(xp, "mpishard_bias_gelu_backward", g.dtype.name)(
            grid, block, (a, bias, t, g, gx, gb, np.int64(rows), np.int32(n), *tail))
    return gx, gb


def unpack_heads(h, need_sum: bool = False, out_sum=None, dtype=None):
    xp = xp_of(h)
    if not (raw_kernels_take(h, out_sum if need_sum else None)      # 16-bit: the copy, the
            and (dtype is None or np.dtype(dtype) == h.dtype)):  # cast, the sums
        return reference.unpack_heads(h, need_sum, out_sum, dtype)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_unpack_heads"):
            return reference.unpack_heads(h, need_sum, out_sum, dtype)
    _, B, nh, T, hs = h.shape
    n = 3 * nh * hs
    rows = xp.empty((B * T, n), dtype=h.dtype)
    sums = (xp.empty(n, dtype=h.dtype) if out_sum is None else out_sum) if need_sum else None
    if n:                                 # no rows: the sums are zeros
        grid, block, tail = column_launch(xp, B * T, n, int(need_sum), h.dtype)
        row_kernel(xp, "mpishard_unpack_heads", h.dtype.name)(
            grid, block, (h, rows, presence_flag(sums), h if sums is None else sums,
                          np.int64(B), np.int32(T), np.int32(nh), np.int32(hs), *tail))
    return rows, sums


def dropout_backward(g, u, p: float):
    xp = xp_of(g)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_dropout_backward"):
            return reference.dropout_backward(g, u, p)
    return _elementwise(xp, "mpishard_dropout", g, u, p, 1.0 / (1.0 - p))


def gelu_forward(a, bias=None):
    xp = xp_of(a)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_gelu_forward"):
            return reference.gelu_forward(a, bias)
    if bias is not None:
        return _elementwise(xp, "mpishard_bias_gelu_forward", a, bias)
    return _elementwise(xp, "mpishard_gelu_forward", a)


def gelu16_forward(a, bias=None):
    xp = xp_of(a)
    if a.dtype.name not in ROWS16 or (bias is not None and bias.dtype != a.dtype):
        return reference.gelu16_forward(a, bias)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_gelu16_forward"):
            return reference.gelu16_forward(a, bias)
    if bias is not None:
        return _elementwise(xp, "mpishard_bias_gelu16_forward", a, bias)
    return _elementwise(xp, "mpishard_gelu16_forward", a)


def gelu16_backward(a, bias, t, g, need_bias: bool, out_bias=None):
    xp = xp_of(a)
    if (a.dtype.name not in ROWS16 or g.dtype != a.dtype or t.dtype != np.float32
            or (bias is not None and bias.dtype != a.dtype)):
        return reference.gelu16_backward(a, bias, t, g, need_bias, out_bias)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_gelu16_backward"):     # gx, and with a bias the
            gf = reference.gelu16_grad32(a, bias, t, g)       # float32 gradient too
            gx = gf.astype(a.dtype)
        return gx, (gf.sum(axis=0, out=out_bias) if need_bias else None)   # the sums
    if bias is None:
        return _elementwise(xp, "mpishard_gelu16_backward", a, t, g), None
    gx, gf = _elementwise(xp, "mpishard_bias_gelu16_backward", a, bias, t, g)
    return gx, (gf.sum(axis=0, out=out_bias) if need_bias else None)


def gelu_backward(a, t, g):
    xp = xp_of(a)
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_gelu_backward"):
            return reference.gelu_backward(a, t, g)
    return _elementwise(xp, "mpishard_gelu_backward", a, t, g)


def _rows16(*arrays) -> bool:
    """Whether ``arrays`` are 16-bit rows of one dtype (SwiGLU's 16-bit kernels)."""
    return arrays[0].dtype.name in ROWS16 and all(a.dtype == arrays[0].dtype for a in arrays)


def _cast_up_math(xp, name: str, rows, math) -> tuple:
    """``math``'s float32 results on 16-bit ``rows`` cast up, cast back to the first row
    array's dtype: on the strict module as the one launch ``name`` it is on a GPU; for
    rows of mixed dtypes (which the 16-bit kernels do not take) as it comes."""
    one = is_strict_module(xp) and _rows16(*rows)
    with xp.syncs.fused(name) if one else contextlib.nullcontext():
        return tuple(a.astype(rows[0].dtype) for a in math(*(up32(a) for a in rows)))


def swiglu_forward(gate, up):
    xp = xp_of(gate)
    if gate.dtype.name in ROWS16:          # 16-bit rows (NATIVE_FLOAT16): float32 inside
        if _rows16(gate, up) and not is_strict_module(xp):
            return _elementwise(xp, "mpishard_swiglu16_forward", gate, up)
        return _cast_up_math(xp, "mpishard_swiglu16_forward", (gate, up),
                             lambda g, u: (reference.swiglu_forward(g, u),))[0]
    if is_strict_module(xp):
        with xp.syncs.fused("mpishard_swiglu_forward"):
            return reference.swiglu_forward(gate, up)
    return _elementwise(xp, "mpishard_swiglu_forward", gate, up)


def swiglu_backward(gate, up, grad, need_gate: bool = True, need_up: bool = True):
    xp = xp_of(gate)
    if gate.dtype.name in ROWS16:          # 16-bit rows: both gradients in their dtype
        if _rows16(gate, up, grad) and not is_strict_module(xp):
            g_gate, g_up = _elementwise(xp, "mpishard_swiglu16_backward", gate, up, grad)
        else:
            g_gate, g_up = _cast_up_math(xp, "mpishard_swiglu16_backward", (gate, up, grad),
                                         reference.swiglu_backward)
    elif is_strict_module(xp):
        with xp.syncs.fused("mpishard_swiglu_backward"):
            g_gate, g_up = reference.swiglu_backward(gate, up, grad)
    else:
        g_gate, g_up = _elementwise(xp, "mpishard_swiglu_backward", gate, up, grad)
    return (g_gate if need_gate else None), (g_up if need_up else None)

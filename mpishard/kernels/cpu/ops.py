"""CPU kernels: a kernel set (:class:`~mpishard.kernels.protocol.KernelSet`), the
reference math (:mod:`mpishard.kernels.reference`) as NumPy passes over cache-sized blocks of rows,
the blocks spread over a few threads (:func:`.threads.for_rows`).

Each pass writes into preallocated arrays (``out=``), so a kernel allocates only
its results; each row's arithmetic is the same whatever the blocks and threads,
so results do not depend on the thread count. Reductions over a row are
:mod:`mpishard.kernels.rows`'. A few run on whole arrays: attention's softmax
backward; the norms' parameter gradients, as the ones-vector products (BLAS) the
models have always used, bit for bit; and dropout, three passes that measured about
as fast whole as blocked (the reference's).
"""
from __future__ import annotations

import numpy as np

from mpishard.kernels import reference
from mpishard.kernels.protocol import KERNEL_NAMES
from mpishard.kernels.reference import GELU_C, GELU_K, apply_dropout, scale_and_mask, up32
from mpishard.kernels.rows import col_sum, row_dot, row_max, row_sum
from mpishard.kernels.cpu import adam
from mpishard.kernels.cpu.threads import for_rows

__all__ = ["NAME", "NATIVE_FLOAT16", *KERNEL_NAMES]

NAME = "cpu"
NATIVE_FLOAT16 = False      # the ops cast 16-bit rows up on NumPy

dropout_add = reference.dropout_add            # whole arrays (see the module docstring)
dropout_backward = reference.dropout_backward
bias_dropout_backward = reference.bias_dropout_backward
sq_sum = reference.sq_sum                      # BLAS's dot of the float64 copy
unpack_heads = reference.unpack_heads          # one copy (a GPU's layout; NumPy has none)
gelu16_forward = reference.gelu16_forward      # 16-bit rows: the reference's float32 math
gelu16_backward = reference.gelu16_backward
# NumPy's attention runs one sequence at a time, its T x T weights in cache: the fused
# attention (a GPU's, see mpishard/kernels/cuda/attention.py) is only ever the reference
# here
flash_attention_forward = reference.flash_attention_forward
flash_attention_backward = reference.flash_attention_backward
multi_sq_sum = reference.multi_sq_sum


def gelu_forward(a, bias=None):
    t2, y2 = np.empty_like(a), np.empty_like(a)

    def block(rows):
        x, t, y = a[rows] if bias is None else a[rows] + bias, t2[rows], y2[rows]
        np.multiply(x, x, out=t)
        t *= x
        t *= GELU_K
        t += x
        t *= GELU_C
        np.tanh(t, out=t)
        np.add(t, 1.0, out=y)
        y *= x
        y *= 0.5
    for_rows(block, *a.shape)
    return y2, t2


def gelu_backward(a, t, g):
    return _gelu_backward(a, t, g, None)


def _gelu_backward(a, t2, g2, bias):
    """:func:`gelu_backward` of ``a + bias`` (``bias`` None: of ``a``), the sum formed
    block by block."""
    out2 = np.empty_like(a)

    def block(rows):
        x, t, out = a[rows] if bias is None else a[rows] + bias, t2[rows], out2[rows]
        s = np.multiply(t, t)
        np.multiply(x, x, out=out)
        out *= 3.0 * GELU_K * GELU_C
        out += GELU_C
        np.subtract(1.0, s, out=s)
        out *= s
        out *= x
        out += t
        out += 1.0
        out *= 0.5
        out *= g2[rows]
    for_rows(block, *a.shape)
    return out2


def bias_gelu_backward(a, bias, t, g, out_bias=None):
    gx = _gelu_backward(a, t, g, bias)            # a + bias again, block by block
    return gx, col_sum(gx, out_bias)


def layer_norm_forward(x, weight, bias, eps: float):
    inv_n = 1.0 / x.shape[1]
    xhat, y = np.empty_like(x), np.empty_like(x)
    rstd = np.empty(x.shape[0], dtype=x.dtype)

    def block(rows):
        xb, hb, yb, rb = x[rows], xhat[rows], y[rows], rstd[rows]
        np.subtract(xb, (row_sum(xb) * inv_n)[:, None], out=hb)
        rb[...] = row_dot(hb, hb)
        rb *= inv_n
        rb += eps
        np.sqrt(rb, out=rb)
        np.divide(1.0, rb, out=rb)
        hb *= rb[:, None]
        if weight is not None:
            np.multiply(hb, weight, out=yb)
        else:
            yb[...] = hb
        if bias is not None:
            yb += bias
    for_rows(block, *x.shape)
    return y, xhat, rstd


def _norm_backward(g2, xhat, rstd, weight, centred: bool, into=None):
    """Layer norm's input gradient (``centred``) or RMS norm's (without the mean); with
    ``into``, each row block added into it while in cache."""
    inv_n = 1.0 / g2.shape[1]
    gx = np.empty_like(g2) if into is None else None

    def block(rows):
        gb = gx[rows] if into is None else np.empty_like(g2[rows])
        hb = xhat[rows]
        if weight is not None:
            np.multiply(g2[rows], weight, out=gb)
        else:
            gb[...] = g2[rows]
        mean_g = row_sum(gb) * inv_n if centred else None
        mean_gx = row_dot(gb, hb) * inv_n
        if centred:
            gb -= mean_g[:, None]
        gb -= hb * mean_gx[:, None]
        gb *= rstd[rows][:, None]
        if into is not None:
            into[rows] += gb
    for_rows(block, *g2.shape)
    return gx if into is None else into


def layer_norm_backward(g, xhat, rstd, weight, into=None):
    return _norm_backward(g, xhat, rstd, weight, centred=True, into=into)


def rms_norm_forward(x, weight, eps: float):
    inv_n = 1.0 / x.shape[1]
    xhat, y = np.empty_like(x), np.empty_like(x)
    rstd = np.empty(x.shape[0], dtype=x.dtype)

    def block(rows):
        xb, hb, rb = x[rows], xhat[rows], rstd[rows]
        rb[...] = row_dot(xb, xb)
        rb *= inv_n
        rb += eps
        np.sqrt(rb, out=rb)
        np.divide(1.0, rb, out=rb)
        np.multiply(xb, rb[:, None], out=hb)
        if weight is not None:
            np.multiply(hb, weight, out=y[rows])
        else:
            y[rows] = hb
    for_rows(block, *x.shape)
    return y, xhat, rstd


def rms_norm_backward(g, xhat, rstd, weight, into=None):
    return _norm_backward(g, xhat, rstd, weight, centred=False, into=into)


def norm_param_grads(g, xhat, need_weight: bool, need_bias: bool, out_weight=None,
                     out_bias=None):
    """Column sums as ``ones @ rows`` (:func:`.rows.col_sum`), straight into the buckets'
    views when given."""
    gw = col_sum(g * xhat, out_weight) if need_weight else None
    gb = col_sum(g, out_bias) if need_bias else None
    return gw, gb


def _sigmoid(g, out):
    """``1 / (1 + exp(-g))`` into ``out``, forward's and backward's same passes."""
    np.negative(g, out=out)
    np.exp(out, out=out)
    out += 1.0
    np.divide(1.0, out, out=out)
    return out


def swiglu_forward(gate, up):
    y2 = np.empty_like(gate)

    def block(rows):
        g, y = gate[rows], y2[rows]
        np.multiply(g, _sigmoid(g, y), out=y)
        y *= up[rows]
    for_rows(block, *gate.shape)
    return y2


def swiglu_backward(gate, up, grad, need_gate: bool = True, need_up: bool = True):
    """The sigmoid computed again block by block (in cache), not kept from forward."""
    g_gate = np.empty_like(gate) if need_gate else None
    g_up = np.empty_like(gate) if need_up else None

    def block(rows):
        g, gd = gate[rows], grad[rows]
        sb = _sigmoid(g, np.empty_like(g))
        gu = g_up[rows] if g_up is not None else np.empty_like(sb)
        np.multiply(gd, g, out=gu)                      # grad * silu(gate)
        gu *= sb
        if g_gate is not None:
            # grad * up * s * (1 + g (1 - s)) = up * (gu + s (grad - gu)): 4 passes, not 6
            b = g_gate[rows]
            np.subtract(gd, gu, out=b)
            b *= sb
            b += gu
            b *= up[rows]
    for_rows(block, *gate.shape)
    return g_gate, g_up


def rope_qkv_forward(q, k, v, cos, sin, heads):
    """The reference's math in NumPy's layout: the tables per head, a copy per query head."""
    return reference.rotate_packed(q, k, v, cos, sin, heads, per_head=True)


def rope_qkv_backward(d, cos, sin, heads, n_kv: int, need_q: bool = True, need_k: bool = True,
                      need_v: bool = True):
    return reference.rotate_packed_back(d, cos, sin, heads, n_kv, need_q, need_k, need_v,
                                        per_head=True)


def _softmax(r) -> None:
    """Softmax over each row of the block ``r``, in place."""
    r -= row_max(r)[:, None]
    np.exp(r, out=r)
    r *= (1.0 / row_sum(r))[:, None]


def softmax_rows(a) -> None:
    for_rows(lambda rows: _softmax(a[rows]), *a.shape)


def causal_softmax(a, T: int, scale: float, drop_u=None, drop_p: float = 0.0, dropped=None):
    scale_and_mask(a, T, scale)
    if drop_u is None:
        softmax_rows(a)
        return None
    dropped = np.empty_like(a) if dropped is None else dropped

    def block(rows):                    # the dropout while the block's weights are in cache
        _softmax(a[rows])
        apply_dropout(a[rows], drop_u[rows], drop_p, out=dropped[rows])
    for_rows(block, *a.shape)
    return dropped


def softmax_backward(d, p, scale: float, drop_u=None, drop_p: float = 0.0,
                     dropped=None) -> None:
    if drop_u is not None:
        if dropped is not None:
            apply_dropout(p, drop_u, drop_p, out=dropped)
        apply_dropout(d, drop_u, drop_p, out=d)
    d -= row_dot(d, p)[:, None]
    d *= p
    if scale != 1.0:
        d *= scale


# Adam: one compiled pass with numba, else NumPy passes over blocks (see cpu/adam.py)
adam_update = adam.adam_update
multi_adam_update = adam.multi_adam_update


#: float32 elements of logits cross-entropy works on at once: a block of rows that stays
#: in the CPU's L2 cache (the blocks change no bit of the loss or the gradient)
CE_BLOCK_ELEMS = 1 << 16


def _ce_blocks(n_rows: int, n_class: int):
    """Cross-entropy's row blocks: ``(r0, r1)`` pairs of :data:`CE_BLOCK_ELEMS` elements."""
    step = max(1, CE_BLOCK_ELEMS // max(n_class, 1))
    return ((r0, min(r0 + step, n_rows)) for r0 in range(0, n_rows, step))


def cross_entropy_forward(logits, targets, ignore_index: int):
    """Block by block: each row's maximum and sum of exponentials are kept, never float32
    exponentiated logits of the whole vocabulary."""
    N = logits.shape[0]
    valid = targets != ignore_index
    safe_t = np.where(valid, targets, 0)
    fd = np.dtype(np.float32) if logits.dtype.itemsize < 4 else logits.dtype  # of the math
    row_m, row_s, per_row = (np.empty(N, dtype=fd) for _ in range(3))
    for r0, r1 in _ce_blocks(N, logits.shape[1]):
        row_m[r0:r1] = row_max(up32(logits[r0:r1]))
        e = up32(logits[r0:r1]) - row_m[r0:r1, None]
        picked = e[np.arange(r1 - r0), safe_t[r0:r1]]
        np.exp(e, out=e)
        row_s[r0:r1] = row_sum(e)
        per_row[r0:r1] = np.log(row_s[r0:r1]) - picked
    count = int(valid.sum())
    total = per_row.sum() if count == valid.size else (per_row * valid).sum()
    loss = total / count if count else total * float("nan")
    return np.asarray(loss, dtype=fd), row_m, row_s, count


def cross_entropy_backward(logits, targets, ignore_index: int, row_max, row_sum, count, g):
    """The softmax recomputed block by block from the logits (the forward's operations, so
    its values), written straight into the logits' dtype."""
    valid = targets != ignore_index
    safe_t = np.where(valid, targets, 0)
    grad = np.empty(logits.shape, dtype=logits.dtype)
    scale = g / max(count, 1)
    for r0, r1 in _ce_blocks(*logits.shape):
        p = up32(logits[r0:r1]) - row_max[r0:r1, None]
        np.exp(p, out=p)
        p *= (1.0 / row_sum[r0:r1])[:, None]
        p[np.arange(r1 - r0), safe_t[r0:r1]] -= 1.0
        if count != valid.size:
            p *= valid[r0:r1, None]
        p *= scale
        grad[r0:r1] = p
    return grad

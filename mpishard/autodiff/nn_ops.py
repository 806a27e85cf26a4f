"""Neural-network ops, each a fused forward beside its hand-written backward.

These are the ops the models spend their time in, so each one is written the
way ``NUMPY_SPEED.md`` measured to be fast: activations flattened to 2-D before
a matmul, reductions over a short last axis through ``einsum``, bias gradients
as a ones-vector matmul, Python-float scalars only (a NumPy float64 scalar would
silently promote float32 work to float64), and ``x*x*x`` instead of ``x**3``.

Weights are read through ``tensor.data`` inside backward, see
[Note: parameter storage] in tensor.py.

[Note: 16-bit inputs]
A float16 or bfloat16 input (mixed precision) gives an output of the same
dtype, but the arithmetic inside runs wider: matrix products in
:func:`mpishard.dtypes.matmul_dtype` (float32 on NumPy, native on CuPy, whose
float16 GEMMs accumulate in float32) and every reduction (layer-norm
statistics, softmax, cross-entropy) in float32. The cast happens at the op's
boundary, in forward and again in backward, so what backward keeps is what
forward kept (16-bit inputs, float32 statistics) and nothing ties a weight's
float32 copy to the graph. Cross-entropy returns a float32 loss.
"""
from __future__ import annotations

import math

import numpy as np

from ..backend import xp_of
from ..dtypes import is_low_precision, matmul_dtype
from .ops import as_tensor, make_result, register_op
from .tensor import Tensor

__all__ = [
    "linear", "layer_norm", "gelu", "softmax", "log_softmax", "cross_entropy",
    "embedding", "dropout", "causal_self_attention",
]

_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715


# -- fast row reductions (NUMPY_SPEED.md item 5) ---------------------------

def _row_sum(x2d):
    """Sum over the last axis of a 2-D array."""
    if isinstance(x2d, np.ndarray):
        return np.einsum("ij->i", x2d)
    return x2d.sum(axis=1)


def _row_dot(a2d, b2d):
    """Row-wise dot product of two 2-D arrays."""
    return xp_of(a2d).einsum("ij,ij->i", a2d, b2d)


def _row_max(x2d):
    if isinstance(x2d, np.ndarray):
        return np.fmax.reduce(x2d, axis=1)
    return x2d.max(axis=1)


def _col_sum(x2d):
    """Sum over the first axis, as a ones-vector matmul."""
    xp = xp_of(x2d)
    return xp.ones(x2d.shape[0], dtype=x2d.dtype) @ x2d


def _up(a):
    """``a`` in float32 if it is a 16-bit float array, else ``a`` itself (see [Note: 16-bit inputs])."""
    return a.astype(np.float32) if is_low_precision(a.dtype) else a


def _as(a, dtype):
    """``a`` cast to ``dtype`` (no copy when it already is)."""
    return a if a is None or a.dtype == dtype else a.astype(dtype)


def _check_last_dim(op: str, x: Tensor, n: int, what: str) -> None:
    if x.ndim == 0 or x.shape[-1] != n:
        raise ValueError(f"{op}: input of shape {tuple(x.shape)} does not end in "
                         f"{what} = {n}")


# -- linear ----------------------------------------------------------------

@register_op
def linear(x, weight, bias=None) -> Tensor:
    """``x @ weight.T + bias`` with ``weight`` stored ``[out, in]`` like torch.nn.Linear."""
    x, weight = as_tensor(x), as_tensor(weight)
    n_out, n_in = weight.shape
    _check_last_dim("linear", x, n_in, f"weight {tuple(weight.shape)} in_features")
    if x.data.dtype != weight.data.dtype:  # the arrays: a Parameter's dtype is its master's
        raise ValueError(f"linear: dtype mismatch {x.data.dtype} (input {tuple(x.shape)}) vs "
                         f"{weight.data.dtype} (weight {tuple(weight.shape)})")
    dtype, cd = x.dtype, matmul_dtype(x.data)           # see [Note: 16-bit inputs]
    x2 = _as(x.data.reshape(-1, n_in), cd)               # (N, in)
    y = x2 @ _as(weight.data, cd).T                      # (N, out)
    if bias is not None:
        bias = as_tensor(bias)
        y += bias.data
    out_shape = x.shape[:-1] + (n_out,)

    def backward(g):
        g2 = _as(g.reshape(-1, n_out), cd)               # (N, out)
        gx = _as(g2 @ _as(weight.data, cd), dtype).reshape(x.shape) if x.requires_grad else None
        gw = g2.T @ _as(x.data.reshape(-1, n_in), cd) if weight.requires_grad else None
        gb = _col_sum(g2) if bias is not None and bias.requires_grad else None
        return gx, gw, gb
    return make_result(_as(y, dtype).reshape(out_shape), (x, weight, bias), backward, "linear")


# -- cache blocking ----------------------------------------------------------

# [Note: cache blocking]
# Elementwise NumPy passes over arrays larger than the CPU caches are bound by
# memory bandwidth: on the 2-core machine this project is measured on, the ten
# passes of a GELU over an (2048, 1024) float32 array took 21 ms one array at a
# time and 10 ms when run over blocks of rows that stay in L2 (backward: 15 ms
# vs 5 ms), with bit-identical results. So the fused ops below run their passes
# block by block on NumPy. On CuPy one block covers everything (a GPU wants
# few, large kernels).
_BLOCK_ELEMS = 1 << 15


def _row_blocks(x2d):
    """Slices of rows that keep a block of ``x2d`` cache-sized (all rows on GPU)."""
    n_rows, n_cols = x2d.shape
    step = n_rows if not isinstance(x2d, np.ndarray) else max(1, _BLOCK_ELEMS // max(n_cols, 1))
    return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


# -- layer norm ------------------------------------------------------------

@register_op
def layer_norm(x, weight=None, bias=None, eps: float = 1e-5) -> Tensor:
    """Normalise over the last axis, then scale by ``weight`` and shift by ``bias``."""
    x = as_tensor(x)
    n = x.shape[-1]
    xp = xp_of(x.data)
    inv_n = 1.0 / n
    if weight is not None:
        weight = as_tensor(weight)
        _check_last_dim("layer_norm", x, weight.shape[0], "weight size")
    if bias is not None:
        bias = as_tensor(bias)
    dtype = x.dtype
    x2 = _up(x.data.reshape(-1, n))                      # (N, C); see [Note: 16-bit inputs]
    xhat = xp.empty_like(x2)                             # kept for backward
    rstd = xp.empty(x2.shape[0], dtype=x2.dtype)         # (N,)
    y = xp.empty_like(x2)
    for rows in _row_blocks(x2):                         # see [Note: cache blocking]
        xb, hb, yb = x2[rows], xhat[rows], y[rows]
        xp.subtract(xb, (_row_sum(xb) * inv_n)[:, None], out=hb)
        rb = rstd[rows]
        rb[...] = _row_dot(hb, hb)
        rb *= inv_n
        rb += eps
        xp.sqrt(rb, out=rb)
        xp.divide(1.0, rb, out=rb)
        hb *= rb[:, None]
        if weight is not None:
            xp.multiply(hb, _up(weight.data), out=yb)
        else:
            yb[...] = hb
        if bias is not None:
            yb += _up(bias.data)

    def backward(g):
        g2 = _up(g.reshape(-1, n))
        need_w = weight is not None and weight.requires_grad
        gw = _col_sum(g2 * xhat) if need_w else None
        gb = _col_sum(g2) if bias is not None and bias.requires_grad else None
        gx = None
        if x.requires_grad:
            gx = xp.empty_like(g2)
            for rows in _row_blocks(g2):
                gb_, hb = gx[rows], xhat[rows]
                if weight is not None:
                    xp.multiply(g2[rows], _up(weight.data), out=gb_)
                else:
                    gb_[...] = g2[rows]
                mean_g = _row_sum(gb_) * inv_n
                mean_gx = _row_dot(gb_, hb) * inv_n
                gb_ -= mean_g[:, None]
                gb_ -= hb * mean_gx[:, None]
                gb_ *= rstd[rows][:, None]
            gx = _as(gx, dtype).reshape(x.shape)
        return gx, gw, gb
    return make_result(_as(y, dtype).reshape(x.shape), (x, weight, bias), backward,
                       "layer_norm")


# -- activations -----------------------------------------------------------

@register_op
def gelu(x) -> Tensor:
    """GELU, tanh approximation: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
    x = as_tensor(x)
    xp = xp_of(x.data)
    a2 = x.data.reshape(-1, x.shape[-1]) if x.ndim else x.data.reshape(1, 1)
    a2 = _up(a2)                                         # see [Note: 16-bit inputs]
    t2 = xp.empty_like(a2)                               # tanh(u), kept for backward
    y2 = xp.empty_like(a2)
    for rows in _row_blocks(a2):                         # see [Note: cache blocking]
        a, t, y = a2[rows], t2[rows], y2[rows]
        xp.multiply(a, a, out=t)
        t *= a
        t *= _GELU_K
        t += a
        t *= _GELU_C
        xp.tanh(t, out=t)
        xp.add(t, 1.0, out=y)
        y *= a
        y *= 0.5

    def backward(g):
        # d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3k x^2)
        a2 = _up(x.data.reshape(t2.shape))
        g2 = _up(g.reshape(t2.shape))
        out2 = xp.empty_like(a2)
        sech2 = xp.empty_like(a2[_row_blocks(a2)[0]])
        for rows in _row_blocks(a2):
            a, t, out = a2[rows], t2[rows], out2[rows]
            s = sech2[: out.shape[0]]
            xp.multiply(a, a, out=out)
            out *= 3.0 * _GELU_K * _GELU_C
            out += _GELU_C
            xp.multiply(t, t, out=s)
            xp.subtract(1.0, s, out=s)
            out *= s
            out *= a
            out += t
            out += 1.0
            out *= 0.5
            out *= g2[rows]
        return (_as(out2, x.dtype).reshape(x.shape),)
    return make_result(_as(y2, x.dtype).reshape(x.shape), (x,), backward, "gelu")


# -- softmax family ----------------------------------------------------------

def _as_rows(a, axis):
    """Move ``axis`` last and view as 2-D (a copy only when axis is not last)."""
    moved = a if axis in (-1, a.ndim - 1) else xp_of(a).moveaxis(a, axis, -1)
    return xp_of(a).ascontiguousarray(moved).reshape(-1, moved.shape[-1]), moved.shape


def _from_rows(r, moved_shape, axis, ndim):
    out = r.reshape(moved_shape)
    if axis in (-1, ndim - 1):
        return out
    return xp_of(r).moveaxis(out, -1, axis)


def _softmax_rows(rows) -> None:
    """Row-wise softmax of a 2-D array, in place (max-subtracted for stability)."""
    rows -= _row_max(rows)[:, None]
    xp_of(rows).exp(rows, out=rows)
    rows *= (1.0 / _row_sum(rows))[:, None]


@register_op
def softmax(x, axis: int = -1) -> Tensor:
    """Softmax along ``axis`` (max-subtracted for stability)."""
    x = as_tensor(x)
    r, moved = _as_rows(x.data, axis)
    p = _up(r).copy()                                    # (rows, n), see [Note: 16-bit inputs]
    _softmax_rows(p)

    def backward(g):
        gr, _ = _as_rows(_up(g), axis)
        gx = gr - _row_dot(gr, p)[:, None]
        gx *= p
        return (_from_rows(_as(gx, x.dtype), moved, axis, x.ndim),)
    return make_result(_from_rows(_as(p, x.dtype), moved, axis, x.ndim), (x,), backward,
                       "softmax")


@register_op
def log_softmax(x, axis: int = -1) -> Tensor:
    """``log(softmax(x))`` along ``axis``, computed stably."""
    x = as_tensor(x)
    xp = xp_of(x.data)
    r, moved = _as_rows(x.data, axis)
    r = _up(r)                                           # see [Note: 16-bit inputs]
    z = r - _row_max(r)[:, None]
    lse = xp.log(_row_sum(xp.exp(z)))
    z -= lse[:, None]                                    # z = log p

    def backward(g):
        gr, _ = _as_rows(_up(g), axis)
        gx = xp.exp(z)
        gx *= -_row_sum(gr)[:, None]
        gx += gr
        return (_from_rows(_as(gx, x.dtype), moved, axis, x.ndim),)
    return make_result(_from_rows(_as(z, x.dtype), moved, axis, x.ndim), (x,), backward,
                       "log_softmax")


@register_op
def cross_entropy(logits, targets, ignore_index: int = -100) -> Tensor:
    """Mean negative log-likelihood of integer ``targets`` under ``softmax(logits)``.

    Args:
        logits: ``(..., V)`` scores.
        targets: ``(...)`` integer class indices; entries equal to
            ``ignore_index`` are left out of the mean.
    """
    logits = as_tensor(logits)
    t = targets.data if isinstance(targets, Tensor) else targets
    xp = xp_of(logits.data)
    n_class = logits.shape[-1]
    if tuple(t.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"cross_entropy: targets of shape {tuple(t.shape)} do not match "
                         f"logits of shape {tuple(logits.shape)} (expected "
                         f"{tuple(logits.shape[:-1])})")
    x2 = _up(logits.data.reshape(-1, n_class))          # (N, V); see [Note: 16-bit inputs]
    t1 = t.reshape(-1)
    valid = t1 != ignore_index
    safe_t = xp.where(valid, t1, 0)
    rows = xp.arange(x2.shape[0])
    e = x2 - _row_max(x2)[:, None]
    picked = e[rows, safe_t]
    xp.exp(e, out=e)
    s = _row_sum(e)                                      # (N,)
    per_row = xp.log(s) - picked
    n_valid = int(valid.sum())
    total = (per_row * valid).sum() if n_valid != x2.shape[0] else per_row.sum()
    loss = total / n_valid if n_valid else total * float("nan")

    def backward(g):
        p = e * (1.0 / s)[:, None]                       # softmax, fresh
        p[rows, safe_t] -= 1.0
        if n_valid != x2.shape[0]:
            p *= valid[:, None]
        p *= g / max(n_valid, 1)
        return (_as(p, logits.dtype).reshape(logits.shape),)
    return make_result(xp.asarray(loss, dtype=x2.dtype), (logits,), backward,
                       "cross_entropy")


# -- embedding -------------------------------------------------------------

def _scatter_add_rows(n_rows, index, g2):
    """``out[index[i]] += g2[i]`` into a fresh ``(n_rows, C)`` array."""
    xp = xp_of(g2)
    out = xp.zeros((n_rows, g2.shape[1]), dtype=g2.dtype)
    if xp is np:
        # argsort + reduceat beats np.add.at ~4x (NUMPY_SPEED.md item 6)
        order = np.argsort(index, kind="stable")
        sorted_index = index[order]
        starts = np.flatnonzero(np.r_[True, sorted_index[1:] != sorted_index[:-1]])
        out[sorted_index[starts]] = np.add.reduceat(g2[order], starts, axis=0)
    else:
        import cupyx  # noqa: PLC0415

        cupyx.scatter_add(out, index, g2)
    return out


@register_op
def embedding(indices, weight) -> Tensor:
    """Rows of ``weight`` picked by integer ``indices``: output ``indices.shape + (C,)``."""
    weight = as_tensor(weight)
    idx = indices.data if isinstance(indices, Tensor) else indices
    n_rows, width = weight.shape
    if idx.dtype.kind not in "iu":
        raise ValueError(f"embedding: indices must be integers, got dtype {idx.dtype}")
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n_rows):
        raise ValueError(f"embedding: index out of range [0, {n_rows}) for weight of "
                         f"shape {tuple(weight.shape)} (got min {int(idx.min())}, "
                         f"max {int(idx.max())})")
    flat = idx.reshape(-1)
    out = weight.data[flat].reshape(idx.shape + (width,))

    def backward(g):
        return (_scatter_add_rows(n_rows, flat, _up(g.reshape(-1, width))),)
    return make_result(out, (weight,), backward, "embedding")


# -- dropout ---------------------------------------------------------------

@register_op
def dropout(x, p: float, rng, training: bool = True) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by ``1/(1-p)``.

    Args:
        rng: a seeded generator with ``random(shape, dtype=...)`` (NumPy's
            ``Generator`` or CuPy's), so masks are reproducible.
    """
    x = as_tensor(x)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: p must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    keep = rng.random(x.shape, dtype=np.float32) >= p
    scale = 1.0 / (1.0 - p)
    mask = keep.astype(x.dtype)
    mask *= scale
    return make_result(x.data * mask, (x,), lambda g: (g * mask,), "dropout")


# -- attention -------------------------------------------------------------

def _causal_bias(T: int, xp, dtype):
    return xp.triu(xp.full((T, T), -np.inf, dtype=dtype), 1)


@register_op
def causal_self_attention(qkv, n_head: int, batch_size: int, dropout_p: float = 0.0,
                          rng=None, training: bool = True) -> Tensor:
    """Multi-head causal attention on packed ``[q | k | v]`` rows.

    Args:
        qkv: ``(B*T, 3*C)`` rows, the output of the ``c_attn`` projection, with
            ``C = n_head * head_size`` (q, k, v side by side, heads inside each).
        n_head: number of heads in ``qkv`` (local heads under tensor parallelism).
        batch_size: ``B``; ``T`` is ``rows // B``.
        dropout_p, rng, training: dropout on the attention weights.

    Returns:
        ``(B*T, C)``: the heads' outputs side by side, ready for ``c_proj``.

    Written out as ``softmax(q k^T / sqrt(hs) + causal mask) v`` with the
    softmax backward fused in; the T x T weights are kept for backward. On
    NumPy it runs one sequence at a time so each (nh, T, T) block stays in
    cache (see [Note: cache blocking]); on CuPy all at once.
    """
    qkv = as_tensor(qkv)
    xp = xp_of(qkv.data)
    N, width = qkv.shape
    if width % (3 * n_head) or N % batch_size:
        raise ValueError(f"causal_self_attention: qkv of shape {tuple(qkv.shape)} does not "
                         f"split into batch {batch_size} x 3 x {n_head} heads")
    B, T = batch_size, N // batch_size
    C = width // 3
    hs = C // n_head
    scale = 1.0 / math.sqrt(hs)
    step = 1 if xp is np else B
    cd = matmul_dtype(qkv.data)                           # see [Note: 16-bit inputs]
    sd = np.dtype(np.float32) if is_low_precision(qkv.dtype) else cd  # softmax dtype
    bias = _causal_bias(T, xp, sd)
    use_dropout = training and dropout_p > 0.0

    def heads(packed, b, which):                          # (nb, nh, T, hs) view
        return packed[b, :, which].transpose(0, 2, 1, 3)

    packed = _as(qkv.data, cd).reshape(B, T, 3, n_head, hs)
    att = xp.empty((B, n_head, T, T), dtype=sd)          # softmax weights, kept
    drop = xp.empty_like(att) if use_dropout else None
    out = xp.empty((B, T, n_head, hs), dtype=cd)
    for b0 in range(0, B, step):
        b = slice(b0, b0 + step)
        a = att[b]
        if sd == cd:
            xp.matmul(heads(packed, b, 0), heads(packed, b, 1).swapaxes(-1, -2), out=a)
        else:  # 16-bit scores from the GPU's 16-bit product, softmax in float32
            a[...] = heads(packed, b, 0) @ heads(packed, b, 1).swapaxes(-1, -2)
        a *= scale
        a += bias
        _softmax_rows(a.reshape(-1, T))
        if use_dropout:
            d = drop[b]
            d[...] = rng.random(d.shape, dtype=np.float32) >= dropout_p
            d *= 1.0 / (1.0 - dropout_p)
            a = a * d
        out[b] = (_as(a, cd) @ heads(packed, b, 2)).transpose(0, 2, 1, 3)

    def backward(g):
        packed = _as(qkv.data, cd).reshape(B, T, 3, n_head, hs)
        gy = _as(g, cd).reshape(B, T, n_head, hs)
        dqkv = xp.empty((B, T, 3, n_head, hs), dtype=cd)
        for b0 in range(0, B, step):
            b = slice(b0, b0 + step)
            q, k, v = heads(packed, b, 0), heads(packed, b, 1), heads(packed, b, 2)
            gyb = gy[b].transpose(0, 2, 1, 3)            # (nb, nh, T, hs)
            a = att[b]
            used = a * drop[b] if use_dropout else a
            dqkv[b, :, 2] = (_as(used, cd).swapaxes(-1, -2) @ gyb).transpose(0, 2, 1, 3)
            da = _as(gyb @ v.swapaxes(-1, -2), sd)       # (nb, nh, T, T)
            if use_dropout:
                da *= drop[b]
            rows, d_rows = a.reshape(-1, T), da.reshape(-1, T)
            d_rows -= _row_dot(d_rows, rows)[:, None]    # softmax backward
            d_rows *= rows
            d_rows *= scale
            da = _as(da, cd)
            dqkv[b, :, 0] = (da @ k).transpose(0, 2, 1, 3)
            dqkv[b, :, 1] = (da.swapaxes(-1, -2) @ q).transpose(0, 2, 1, 3)
        return (_as(dqkv, qkv.dtype).reshape(N, width),)
    return make_result(_as(out, qkv.dtype).reshape(N, C), (qkv,), backward,
                       "causal_self_attention")

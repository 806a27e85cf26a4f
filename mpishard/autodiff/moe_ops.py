"""Mixture-of-experts ops: every expert's MLP in one op (SwiGLU, or GPT's GELU), and the combine.

A mixture-of-experts layer (Shazeer et al., 2017; Mixtral, Jiang et al., 2024,
arXiv:2401.04088) sends each token to the ``k`` experts its router picks. The
layer (mpishard/models/moe.py) sorts the ``N x k`` (token, expert) pairs by
expert, gathers their rows (:func:`~mpishard.autodiff.nn_ops.embedding` of
the row indices), runs :func:`expert_swiglu` over the sorted rows -- one
matrix product per expert on its contiguous run, no per-token loop -- weights
each row by its routing weight and adds the rows back into their tokens
(:func:`scatter_rows`).
"""
from __future__ import annotations

from mpishard.core.backend import xp_of
from mpishard.core.dtypes import matmul_dtype
from mpishard.kernels.reference import GELU_C, GELU_K
from mpishard.autodiff.graph import as_tensor, make_result, register_op
from mpishard.autodiff.rows import cast, scatter_add_rows, up
from mpishard.autodiff.tensor import Tensor

__all__ = ["expert_swiglu", "expert_gelu", "scatter_rows", "permute_rows"]


def _sigmoid(x):
    xp = xp_of(x)
    s = xp.negative(x)
    xp.exp(s, out=s)
    s += 1.0
    return xp.divide(1.0, s, out=s)


@register_op
def expert_swiglu(x, offsets, gate_up, down) -> Tensor:
    """``down_e(silu(gate_e(x)) * up_e(x))`` for each expert ``e`` on its run of rows.

    Args:
        x: ``(M, C)`` rows sorted by expert: rows ``offsets[e]:offsets[e+1]`` go
            to expert ``e``.
        offsets: ``E + 1`` non-decreasing row offsets (host integers).
        gate_up: ``(E, 2F, C)``: each expert's gate (first ``F`` rows) and up
            projections, as ``transformers``' Mixtral stores them.
        down: ``(E, C, F)``: each expert's down projection.

    Returns ``(M, C)``. Backward keeps the ``(M, 2F)`` projections and recomputes
    nothing else; every weight gradient is one product per expert.
    """
    x, gate_up, down = as_tensor(x), as_tensor(gate_up), as_tensor(down)
    E, F2, C = gate_up.shape
    F = F2 // 2
    offsets = [int(o) for o in offsets]
    if len(offsets) != E + 1 or offsets[0] != 0 or offsets[-1] != x.shape[0] or \
            any(b < a for a, b in zip(offsets, offsets[1:])) or F2 % 2 or \
            tuple(down.shape) != (E, C, F) or x.shape[-1] != C:
        raise ValueError(f"expert_swiglu: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, "
                         f"down {tuple(down.shape)} and {len(offsets)} offsets do not fit "
                         f"E experts of width F over M sorted rows")
    xp = xp_of(x.data)
    dtype, cd = x.dtype, matmul_dtype(x.data)
    # gate and up projections, kept in the activations' dtype (as a dense layer's output:
    # 16-bit on NumPy too, where the products run in float32)
    h = xp.empty((x.shape[0], F2), dtype=dtype)
    y = xp.empty((x.shape[0], C), dtype=cd)
    runs = [(e, slice(a, b)) for e, (a, b) in enumerate(zip(offsets, offsets[1:])) if b > a]
    for e, rows in runs:
        xe = cast(x.data[rows], cd)
        h[rows] = xe @ cast(gate_up.data[e], cd).T
        g = up(h[rows, :F])
        a = g * _sigmoid(g) * up(h[rows, F:])
        y[rows] = cast(a, cd) @ cast(down.data[e], cd).T

    def backward(grad):
        gx = xp.zeros(x.shape, dtype=dtype) if x.requires_grad else None
        g_gu = xp.zeros(gate_up.shape, dtype=cd) if gate_up.requires_grad else None
        g_dn = xp.zeros(down.shape, dtype=cd) if down.requires_grad else None
        for e, rows in runs:
            dy = cast(grad[rows], cd)
            g, u = up(h[rows, :F]), up(h[rows, F:])
            s = _sigmoid(g)
            silu = g * s
            if g_dn is not None:
                g_dn[e] = dy.T @ cast(silu * u, cd)
            da = up(dy @ cast(down.data[e], cd))           # (n_e, F)
            dh = xp.empty((rows.stop - rows.start, F2), dtype=da.dtype)
            dh[:, F:] = da * silu
            dh[:, :F] = da * u * (s * (1.0 + g * (1.0 - s)))   # d silu(g) / dg
            dh = cast(dh, cd)
            if g_gu is not None:
                g_gu[e] = dh.T @ cast(x.data[rows], cd)
            if gx is not None:
                gx[rows] = cast(dh @ cast(gate_up.data[e], cd), dtype)
        return gx, g_gu, g_dn
    return make_result(cast(y, dtype), (x, gate_up, down), backward, "expert_swiglu")


@register_op
def scatter_rows(values, index, n_rows: int) -> Tensor:
    """``out[index[i]] += values[i]`` into ``(n_rows, C)`` zeros; backward gathers rows.

    Args:
        values: ``(M, C)``.
        index: ``M`` integer row indices in ``[0, n_rows)`` (host or device array).
        n_rows: the output's rows.
    """
    values = as_tensor(values)
    idx = index.data if isinstance(index, Tensor) else index
    if values.ndim != 2 or len(idx) != values.shape[0]:
        raise ValueError(f"scatter_rows: values {tuple(values.shape)} and {len(idx)} indices "
                         f"do not pair up row by row")
    xp = xp_of(values.data)
    idx = xp.asarray(idx)
    out = scatter_add_rows(int(n_rows), idx, values.data) if len(idx) else \
        xp.zeros((int(n_rows), values.shape[1]), dtype=values.dtype)
    return make_result(out, (values,), lambda g: (g[idx],), "scatter_rows")



@register_op
def permute_rows(x, perm) -> Tensor:
    """``x[perm]`` for a permutation ``perm`` of the rows; backward puts each row's
    gradient back where it came from (a gather by the inverse, no scatter-add)."""
    x = as_tensor(x)
    idx = perm.data if isinstance(perm, Tensor) else perm
    if len(idx) != x.shape[0]:
        raise ValueError(f"permute_rows: {len(idx)} indices for {x.shape[0]} rows; pass a "
                         f"permutation of range({x.shape[0]})")
    xp = xp_of(x.data)
    idx = xp.asarray(idx)
    inverse = xp.empty_like(idx)
    inverse[idx] = xp.arange(idx.size, dtype=idx.dtype)
    return make_result(x.data[idx], (x,), lambda g: (g[inverse],), "permute_rows")


def _gelu_parts(a, xp):
    """``(gelu(a), d gelu / da)``, GELU's tanh form as :func:`~mpishard.autodiff.nn_ops.gelu`."""
    t = xp.tanh(GELU_C * (a + GELU_K * a * a * a))
    y = 0.5 * a * (1.0 + t)
    dy = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_K * a * a)
    return y, dy


@register_op
def expert_gelu(x, offsets, fc, fc_bias, proj, proj_bias) -> Tensor:
    """``proj_e(gelu(fc_e(x)))`` with biases for each expert ``e`` on its run of rows (GPT's
    MLP as experts): ``fc`` ``(E, H, C)``, ``fc_bias`` ``(E, H)``, ``proj`` ``(E, C, H)``,
    ``proj_bias`` ``(E, C)``; rows and offsets as :func:`expert_swiglu`'s."""
    x, fc, fc_bias = as_tensor(x), as_tensor(fc), as_tensor(fc_bias)
    proj, proj_bias = as_tensor(proj), as_tensor(proj_bias)
    E, H, C = fc.shape
    offsets = [int(o) for o in offsets]
    if len(offsets) != E + 1 or offsets[0] != 0 or offsets[-1] != x.shape[0] or \
            any(b < a for a, b in zip(offsets, offsets[1:])) or \
            tuple(proj.shape) != (E, C, H) or x.shape[-1] != C:
        raise ValueError(f"expert_gelu: x {tuple(x.shape)}, fc {tuple(fc.shape)}, proj "
                         f"{tuple(proj.shape)} and {len(offsets)} offsets do not fit")
    xp = xp_of(x.data)
    dtype, cd = x.dtype, matmul_dtype(x.data)
    h = xp.empty((x.shape[0], H), dtype=dtype)          # pre-activations, kept (as above)
    y = xp.empty((x.shape[0], C), dtype=cd)
    runs = [(e, slice(a, b)) for e, (a, b) in enumerate(zip(offsets, offsets[1:])) if b > a]
    for e, rows in runs:
        h[rows] = cast(x.data[rows], cd) @ cast(fc.data[e], cd).T + fc_bias.data[e]
        act, _ = _gelu_parts(up(h[rows]), xp)
        y[rows] = cast(act, cd) @ cast(proj.data[e], cd).T + proj_bias.data[e]

    def backward(grad):
        gx = xp.zeros(x.shape, dtype=dtype)
        grads = [xp.zeros(t.shape, dtype=cd) for t in (fc, fc_bias, proj, proj_bias)]
        for e, rows in runs:
            dy = cast(grad[rows], cd)
            act, dact = _gelu_parts(up(h[rows]), xp)
            grads[2][e] = dy.T @ cast(act, cd)
            grads[3][e] = dy.sum(axis=0)
            dh = cast(up(dy @ cast(proj.data[e], cd)) * dact, cd)
            grads[0][e] = dh.T @ cast(x.data[rows], cd)
            grads[1][e] = dh.sum(axis=0)
            gx[rows] = cast(dh @ cast(fc.data[e], cd), dtype)
        return (gx, *grads)
    return make_result(cast(y, dtype), (x, fc, fc_bias, proj, proj_bias), backward,
                       "expert_gelu")

"""The NumPy idioms the fused ops are built from, measured to be fast on CPUs.

Bias gradients as column sums (a ones-vector matmul, :func:`mpishard.kernels.rows.col_sum`,
where the row reductions are too), 16-bit inputs cast up, scatter-adds of rows. On
CuPy each falls back to the plain call (a GPU wants few, large kernels).
"""
from __future__ import annotations

import numpy as np

from mpishard.core.backend import xp_of
from mpishard.core.dtypes import is_low_precision
from mpishard.kernels.rows import col_sum, col_sum_dtype
from mpishard.autodiff.tensor import Tensor, grad_buffer

__all__ = ["bias_grad", "up", "cast", "check_last_dim", "scatter_add", "scatter_add_rows",
           "draw_uniform", "native_float16"]


def bias_grad(bias, g2):
    """The gradient of a ``bias`` added to rows whose gradient is ``g2``: its column sums
    (16-bit summed in float32), into its gradient buffer when it has one (see [Note:
    gradient buffers] in tensor.py); ``None`` without a bias or when it needs none."""
    if bias is None or not bias.requires_grad:
        return None
    return col_sum(g2, out=grad_buffer(bias, col_sum_dtype(g2.dtype)))


def up(a):
    """``a`` in float32 if it is a 16-bit float array, else ``a`` itself (see [Note: 16-bit inputs] in nn_ops.py)."""
    return a.astype(np.float32) if is_low_precision(a.dtype) else a


def cast(a, dtype):
    """``a`` cast to ``dtype`` (no copy when it already is)."""
    return a if a is None or a.dtype == dtype else a.astype(dtype)


def scatter_add(out, index, values) -> None:
    """``out[index] += values`` with repeated indices adding up: ``np.add.at`` on
    NumPy, ``cupyx.scatter_add`` on CuPy (the strict module has its own), which has no
    bfloat16: there bfloat16 adds up in float32, rounded once."""
    xp = xp_of(out)
    if xp is np:
        np.add.at(out, index, values)
    elif out.dtype.name == "bfloat16":
        wide = out.astype(np.float32)
        scatter_add(wide, index, values.astype(np.float32))
        out[...] = wide
    elif hasattr(xp, "scatter_add"):
        xp.scatter_add(out, index, values)
    else:
        import cupyx  # noqa: PLC0415

        cupyx.scatter_add(out, index, values)


def scatter_add_rows(n_rows, index, values):
    """``out[index[i]] += values[i]`` into a fresh ``(n_rows, C)`` array, for rows
    ``values`` ``(N, C)`` (an embedding's gradient, an expert's rows back in place)."""
    xp = xp_of(values)
    out = xp.zeros((n_rows, values.shape[1]), dtype=values.dtype)
    if len(index) == 0:
        return out
    if xp is np:
        # argsort + reduceat beats np.add.at ~4x (measured ~4x)
        order = np.argsort(index, kind="stable")
        sorted_index = index[order]
        starts = np.flatnonzero(np.r_[True, sorted_index[1:] != sorted_index[:-1]])
        out[sorted_index[starts]] = np.add.reduceat(values[order], starts, axis=0)
    else:
        scatter_add(out, index, values)
    return out


def check_last_dim(op: str, x: Tensor, n: int, what: str) -> None:
    if x.ndim == 0 or x.shape[-1] != n:
        raise ValueError(f"{op}: input of shape {tuple(x.shape)} does not end in "
                         f"{what} = {n}")


def draw_uniform(rng, shape, xp, out=None):
    """``rng``'s float32 uniforms in [0, 1) of ``shape`` (into ``out`` if given) as an
    array of ``xp``: a host generator's draws (NumPy's, driving device arrays in a
    test) are copied over."""
    if xp is np or not isinstance(rng, np.random.Generator):
        if out is None:
            return rng.random(shape, dtype=np.float32)
        return rng.random(shape, dtype=np.float32, out=out)
    u = xp.asarray(rng.random(shape, dtype=np.float32))
    if out is None:
        return u
    out[...] = u
    return out


def native_float16(kernels, dtype) -> bool:
    """Whether ``kernels`` take 16-bit (float16 or bfloat16) rows of ``dtype`` themselves
    (a GPU's GELU, layer norm and RMS norm; see [Note: float16 rows] in
    mpishard/kernels/cuda/norms.py) instead of the op casting them up and down."""
    return is_low_precision(dtype) and kernels.NATIVE_FLOAT16

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
           "draw_uniform", "keeps_least", "kept_mask", "release_values",
           "native_float16"]


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


def keeps_least(xp) -> bool:
    """Whether ops on ``xp``'s arrays keep the least for backward and compute the rest
    again there (NumPy); see [Note: what ops keep]."""
    return xp is np


def kept_mask(u, p: float):
    """What backward keeps of a dropout's draws ``u``: which elements stayed (``u >=
    p``, compared in float32 as the kernels compare), a byte each, where ops keep the
    least; else the draws themselves. The kernels take either as their draws
    (``kept >= p`` is ``u >= p`` element for element, ``0 < p < 1``)."""
    return u >= u.dtype.type(p) if keeps_least(xp_of(u)) else u


# [Note: what ops keep]
# The ops keep for backward only what cannot be computed again cheaply from the graph's
# own tensors, each recomputation the same bits as forward's:
# - a layer norm and an RMS norm keep no normalised rows (backward normalises its
#   input again: on a device one launch of the forward kernel), a GELU no tanh (one
#   launch again), a SwiGLU no sigmoid (its backward kernel computes it inline);
#   float32 rows of the model's width, or of the MLP's, would otherwise be kept per
#   norm and per block, the largest share of a 16-bit block's activations after the
#   products' inputs;
# - on NumPy a dropout keeps which elements it kept, a byte each (as Megatron-LM's
#   masks: Korthikanti et al. 2022, arXiv:2205.05198, section 4.1), not its float32
#   draws, and the rotary embeddings build their per-head tables again (a pass more
#   in backward costs no launch there). A device's fused dropout kernels read float32
#   draws, and `rope` and the one-op attention's rotations run over one (T, head size)
#   table pair broadcast over the heads, both kept (the fusion budget of
#   tests/testing/test_strict_launches.py), until the kernels take masks;
# - `rope_qkv` keeps no tables anywhere: its kernels read the model's (cos, sin) again
#   and take the rotation's sign themselves.
# The activation plans follow (:func:`mpishard.models.activations.micro_batch`).


def release_values(tensor) -> None:
    """Let go of ``tensor``'s values, keeping its place in the graph: its ``data`` becomes
    a zero-strided stand-in of the same shape and dtype (one element of memory, its
    value undefined).

    For an op's output whose only reader has already read it and whose backward, like
    every other backward in the graph, never reads it (a product summed over tensor-
    parallel ranks, a residual branch added in): the graph would otherwise keep it alive
    until backward. Only the code that made ``tensor`` and handed it to that one reader
    can know this; a caller that still holds ``tensor`` must not read it afterwards."""
    data = tensor.data
    xp = xp_of(data)           # empty: no kernel launch on a device
    tensor.data = xp.broadcast_to(xp.empty((), dtype=data.dtype), data.shape)


def release_branch(branch) -> None:
    """:func:`release_values` of a residual branch's last output once added in, where it is
    an op's output in the graph (a leaf, or a plain array, is left alone)."""
    if isinstance(branch, Tensor) and branch._backward is not None:
        release_values(branch)


def native_float16(kernels, dtype) -> bool:
    """Whether ``kernels`` take 16-bit (float16 or bfloat16) rows of ``dtype`` themselves
    (a GPU's GELU, layer norm, RMS norm and SwiGLU; see [Note: float16 rows] in
    mpishard/kernels/cuda/norms.py) instead of the op casting them up and down."""
    return is_low_precision(dtype) and kernels.NATIVE_FLOAT16

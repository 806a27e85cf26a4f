"""Sequence-parallel collectives as autodiff ops (Megatron-LM's sequence parallelism).

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (2022, arXiv:2205.05198), section 4.2.2 and figure 5: outside the
tensor-parallel matrix products (layer norms, dropout, residual adds), each
tp rank keeps only a contiguous block of the activation rows instead of a
full replica. Activations are ``(N, C)`` rows with ``N = B*T`` (b-major);
rank ``r`` of ``tp`` holds rows ``[r*N/tp, (r+1)*N/tp)`` (:func:`sp_rows`).
Megatron's ``f`` and ``g`` (:mod:`.ops`) become:

- :func:`gather_from_sp` (replaces ``f``, in front of a column-parallel layer):
  all-gather of the row blocks in forward, reduce-scatter (sum) of the
  gradient in backward, since every rank's column shard contributes part of
  the gradient of every row.
- :func:`reduce_scatter_to_sp` (replaces ``g``, after a row-parallel layer or a
  vocabulary-parallel embedding): reduce-scatter (sum) of the partial outputs
  in forward, all-gather of the gradient blocks in backward.
- :func:`scatter_to_sp`: this rank's row block of a replicated ``(N, C)``
  (a copy) in forward, all-gather of the gradient blocks in backward; it
  enters the sequence-parallel region from values every rank already has.

The row blocks are rank-major blocks of the flattened array, which is how
:meth:`Communicator.all_gather` and :meth:`Communicator.reduce_scatter` lay
out their buffers. Every op returns its input unchanged when ``tp`` has one
rank. Inputs need not be C-contiguous (they are copied where MPI needs it);
outputs and gradients keep their input's dtype. bfloat16 is summed in float32
(MPI has no bfloat16 arithmetic) and cast back; float16 is summed as it is.
Row counts that do not divide by ``tp.size`` raise ``ValueError`` before any
communication, so every rank raises the same error. All ranks must pass
blocks of equal shape (a communicator built with ``debug=True`` checks that
collectively).
"""
from __future__ import annotations

from mpishard.autodiff.graph import as_tensor, make_result, register_op
from mpishard.autodiff.recompute import kept_product
from mpishard.autodiff.rows import cast, check_last_dim
from mpishard.kernels.rows import col_sum
from mpishard.autodiff.tensor import Tensor, grad_buffer
from mpishard.core.backend import xp_of
from mpishard.core.dtypes import matmul_dtype

__all__ = ["sp_rows", "gather_from_sp", "reduce_scatter_to_sp", "scatter_to_sp",
           "gathered_linear"]


def _check_rows(n_rows: int, size: int, where: str) -> None:
    """Raise ``ValueError``, naming the values and the fix, unless ``size`` divides ``n_rows``."""
    if n_rows % size:
        raise ValueError(
            f"{where}: sequence parallel splits the B*T = {n_rows} rows of each "
            f"micro-batch over tp = {size} ranks; use a batch x sequence length "
            f"divisible by {size} or turn off --sequence-parallel")


def _rows_of(array, where: str) -> int:
    """The number of rows (first dimension) of ``array``; ``ValueError`` for a 0-d array."""
    if array.ndim == 0:
        raise ValueError(f"{where}: needs rows (an array of shape (N, C) or (N, ...)), "
                         f"got a 0-d array; reshape it to (1, -1) or pass the activations")
    return array.shape[0]


def sp_rows(n_rows: int, tp) -> tuple[int, int]:
    """``(start, stop)``: the rows of ``n_rows`` that rank ``tp.rank`` of ``tp`` holds.

    Args:
        n_rows: the rows of one micro-batch, ``N = B*T``.
        tp: the tensor-parallel Communicator (anything with ``rank`` and ``size``).

    Raises:
        ValueError: ``n_rows`` is not a multiple of ``tp.size``.
    """
    n_rows = int(n_rows)
    _check_rows(n_rows, tp.size, "sp_rows")
    block = n_rows // tp.size
    return tp.rank * block, (tp.rank + 1) * block


def _c_order(array):
    """``array`` itself when C-contiguous, else a C-ordered copy."""
    if array.flags.c_contiguous:
        return array
    return xp_of(array).ascontiguousarray(array)


def _gathered(array, tp):
    """Every rank's ``array`` concatenated along rows (rank-major), same dtype."""
    return tp.all_gather(_c_order(array))


def _scattered_sum(array, tp):
    """Rank ``tp.rank``'s row block of ``array`` summed over ``tp`` (bfloat16 via float32)."""
    if array.dtype.name == "bfloat16":
        wide = xp_of(array).array(array, dtype="float32", order="C")
        return tp.reduce_scatter(wide, op="sum").astype(array.dtype)
    return tp.reduce_scatter(_c_order(array), op="sum")


@register_op
def gather_from_sp(x, tp) -> Tensor:
    """All-gather row blocks ``(N/tp, C) -> (N, C)``; backward reduce-scatters (sums) the gradient.

    Args:
        x: this rank's rows ``sp_rows(N, tp)``; every rank's block has the same shape.
        tp: the tensor-parallel Communicator.
    """
    x = as_tensor(x)
    _rows_of(x.data, "gather_from_sp")
    if tp.size == 1:
        return x

    return make_result(_gathered(x.data, tp), (x,), lambda g: (_scattered_sum(g, tp),),
                       "gather_from_sp")


@register_op
def reduce_scatter_to_sp(x, tp) -> Tensor:
    """Sum partial ``(N, C)`` over ``tp``, keep this rank's ``(N/tp, C)``; backward all-gathers.

    Args:
        x: this rank's partial sum of the full rows (a row-parallel layer's output).
        tp: the tensor-parallel Communicator.

    Raises:
        ValueError: ``N`` is not a multiple of ``tp.size``.
    """
    x = as_tensor(x)
    _check_rows(_rows_of(x.data, "reduce_scatter_to_sp"), tp.size, "reduce_scatter_to_sp")
    if tp.size == 1:
        return x
    return make_result(_scattered_sum(x.data, tp), (x,), lambda g: (_gathered(g, tp),),
                       "reduce_scatter_to_sp")


@register_op
def scatter_to_sp(x, tp) -> Tensor:
    """This rank's row block ``(N/tp, C)`` of a replicated ``(N, C)``; backward all-gathers.

    The backward leaves the full gradient of the replicated input on every
    rank (each rank's block of it came from that rank), as for any other
    replicated value.

    Args:
        x: the same ``(N, C)`` on every rank.
        tp: the tensor-parallel Communicator.

    Raises:
        ValueError: ``N`` is not a multiple of ``tp.size``.
    """
    x = as_tensor(x)
    n_rows = _rows_of(x.data, "scatter_to_sp")
    _check_rows(n_rows, tp.size, "scatter_to_sp")
    if tp.size == 1:
        return x
    start, stop = sp_rows(n_rows, tp)
    block = x.data[start:stop].copy()
    return make_result(block, (x,), lambda g: (_gathered(g, tp),), "scatter_to_sp")


@register_op
def gathered_linear(x, weight, bias, tp) -> Tensor:
    """``gather_from_sp(x) @ weight.T + bias`` keeping only ``x``'s own rows for backward.

    A column-parallel layer under sequence parallelism: the all-gathered
    ``(N, in)`` input is needed twice, for the product and for the weight's
    gradient. Instead of keeping it between forward and backward (``tp`` times
    this rank's rows), backward gathers it again (Megatron-LM does the same),
    then reduce-scatters the input gradient. Same math and dtypes as
    :func:`~mpishard.autodiff.nn_ops.linear`.
    """
    x, weight = as_tensor(x), as_tensor(weight)
    n_out, n_in = weight.shape
    check_last_dim("gathered_linear", x, n_in, f"weight {tuple(weight.shape)} in_features")
    _rows_of(x.data, "gathered_linear")
    dtype, cd = x.dtype, matmul_dtype(x.data)
    if bias is not None:
        bias = as_tensor(bias)

    def product():       # or kept, the gather skipped (see [Note: kept products])
        full = _gathered(x.data, tp) if tp.size > 1 else x.data
        y = cast(full.reshape(-1, n_in), cd) @ cast(weight.data, cd).T
        del full
        if bias is not None:
            y += bias.data
        return cast(y, dtype)
    y = kept_product(product, (tuple(weight.shape), tuple(x.shape)))

    def backward(g):
        full = _gathered(x.data, tp) if tp.size > 1 else x.data
        g2 = cast(g.reshape(-1, n_out), cd)
        gx = None
        if x.requires_grad:
            gx = cast(g2 @ cast(weight.data, cd), dtype)
            gx = _scattered_sum(gx, tp) if tp.size > 1 else gx
        gw = gb = None                                    # as in linear: into the
        if weight.requires_grad:                          # gradient buffers, if any
            gw = xp_of(g2).matmul(g2.T, cast(full.reshape(-1, n_in), cd),
                                  out=grad_buffer(weight, cd))
        if bias is not None and bias.requires_grad:
            gb = col_sum(g2, out=grad_buffer(bias, cd))
        return gx, gw, gb
    return make_result(y, (x, weight, bias), backward, "gathered_linear")

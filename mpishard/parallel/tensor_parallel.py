"""Tensor parallelism, Megatron-LM style (Shoeybi et al., 2019, arXiv:1909.08053).

    mpiexec -n 4 python -m mpi4py -m mpishard train --tp 2 --dp 2

A linear layer's weight is split across the ranks of ``mesh.tp``:

- :class:`ColumnParallelLinear` splits the output features (``weight`` rows):
  ``y_local = f(x) @ W_local.T + b_local``, the output stays split.
- :class:`RowParallelLinear` splits the input features (``weight`` columns):
  ``y = g(x_local @ W_local.T) + b``, the output is whole again.
- :class:`VocabParallelEmbedding` splits the vocabulary; each rank looks up the
  tokens it holds and ``g`` sums the rows.
- :func:`vocab_parallel_cross_entropy` computes the loss from vocabulary-split
  logits with three all-reduces of one number per row; full logits never exist.

``f``/``g`` are :func:`mpishard.comm.copy_to_tp` / :func:`mpishard.comm.reduce_from_tp`.
:func:`parallelize_gpt` swaps a GPT's layers for these: attention split by
heads (each rank gets whole heads; uneven counts work, e.g. 5 heads on 2 ranks
as 3 + 2), the MLP's hidden width split, the vocabulary split. Every split
parameter records its blocks in ``spec.tp_dim``/``spec.tp_blocks`` and is
initialised by cutting its blocks from the same (seed, name) tensor the
unsharded model draws, so a tensor-parallel model starts equal to the plain one.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..autodiff import nn_ops
from ..autodiff.ops import as_tensor, make_result, mul
from ..autodiff.tensor import Tensor
from ..backend import xp_of
from .tp_ops import copy_to_tp, reduce_from_tp
from ..dtypes import is_low_precision
from ..nn import Constant, Linear, Module, Normal, Parameter

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "parallelize_gpt", "split_range"]


def split_range(n: int, parts: int, index: int) -> tuple:
    """``(start, stop)`` of part ``index`` when ``n`` items go to ``parts`` ranks
    (the first ``n % parts`` ranks get one more)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def _split_param(global_shape, blocks, dim, init, decay, dtype) -> Parameter:
    local = list(global_shape)
    local[dim] = sum(b - a for a, b in blocks)
    p = Parameter(tuple(local), init, decay, dtype)
    p.spec = dataclasses.replace(p.spec, global_shape=tuple(global_shape), tp_dim=dim,
                                 tp_blocks=tuple(blocks))
    return p


class ColumnParallelLinear(Module):
    """Output features split over ``tp``: ``y_local = f(x) @ W_local.T + b_local``.

    Args:
        in_features, out_features: the global sizes.
        tp: the tensor-parallel Communicator.
        blocks: output-feature ranges this rank holds, concatenated in order
            (default: an even split).
    """

    def __init__(self, in_features: int, out_features: int, tp, bias: bool = True,
                 init_std: float = 0.02, dtype: str = "float32", blocks=None):
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        blocks = blocks or [split_range(out_features, tp.size, tp.rank)]
        self.weight = _split_param((out_features, in_features), blocks, 0, Normal(init_std),
                                   True, dtype)
        self.bias = _split_param((out_features,), blocks, 0, Constant(0.0), False, dtype) \
            if bias else None

    def forward(self, x):
        return nn_ops.linear(copy_to_tp(x, self.tp), self.weight, self.bias)


class RowParallelLinear(Module):
    """Input features split over ``tp``: ``y = g(x_local @ W_local.T) + b``.

    ``x_local`` is the split output of a column-parallel layer; the bias is
    replicated and added once, after the all-reduce.
    """

    def __init__(self, in_features: int, out_features: int, tp, bias: bool = True,
                 init_std: float = 0.02, dtype: str = "float32", blocks=None):
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        blocks = blocks or [split_range(in_features, tp.size, tp.rank)]
        self.weight = _split_param((out_features, in_features), blocks, 1, Normal(init_std),
                                   True, dtype)
        self.bias = Parameter((out_features,), Constant(0.0), False, dtype) if bias else None

    def forward(self, x_local):
        y = reduce_from_tp(nn_ops.linear(x_local, self.weight), self.tp)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(Module):
    """Token table split by vocabulary rows; out-of-range tokens look up zeros."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp, init_std: float = 0.02,
                 dtype: str = "float32"):
        super().__init__()
        self.tp = tp
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start, self.vocab_stop = split_range(num_embeddings, tp.size, tp.rank)
        self.weight = _split_param((num_embeddings, embedding_dim),
                                   [(self.vocab_start, self.vocab_stop)], 0, Normal(init_std),
                                   True, dtype)

    def forward(self, indices):
        idx = indices.data if isinstance(indices, Tensor) else indices
        if self.tp.size == 1:
            return nn_ops.embedding(idx, self.weight)
        xp = xp_of(self.weight.data)
        mine = (idx >= self.vocab_start) & (idx < self.vocab_stop)
        local = xp.where(mine, idx - self.vocab_start, 0)
        rows = nn_ops.embedding(local, self.weight)                 # (..., C)
        rows = mul(rows, mine[..., None].astype(self.weight.data.dtype))
        return reduce_from_tp(rows, self.tp)


def vocab_parallel_cross_entropy(logits, targets, tp, vocab_start: int,
                                 ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy from logits split by vocabulary, without gathering them.

    Args:
        logits: ``(N, V_local)``, this rank's vocabulary columns
            ``[vocab_start, vocab_start + V_local)``.
        targets: ``(N,)`` global token ids (``ignore_index`` left out).
        tp: the tensor-parallel Communicator.

    Megatron-LM's recipe: all-reduce the row maxima (max), the sums of
    exponentials (sum) and the target logits (sum, from the rank that holds
    each target); the gradient ``softmax - onehot`` needs no communication.
    """
    logits = as_tensor(logits)
    t = targets.data if isinstance(targets, Tensor) else targets
    x = logits.data.reshape(-1, logits.shape[-1])                   # (N, V_local)
    if is_low_precision(x.dtype):  # 16-bit logits: the softmax runs in float32
        x = x.astype(np.float32)
    xp = xp_of(x)
    n_local = x.shape[1]
    t = t.reshape(-1)
    rows = xp.arange(x.shape[0])
    valid = t != ignore_index
    mine = (t >= vocab_start) & (t < vocab_start + n_local) & valid
    local_t = xp.where(mine, t - vocab_start, 0)
    row_max = x.max(axis=1)
    tp.all_reduce(row_max, op="max")
    e = x - row_max[:, None]
    picked = xp.where(mine, e[rows, local_t], 0.0).astype(x.dtype)
    xp.exp(e, out=e)
    sums = e.sum(axis=1)
    tp.all_reduce(sums, op="sum")
    tp.all_reduce(picked, op="sum")
    per_row = xp.log(sums) - picked
    n_valid = int(valid.sum())
    loss = (per_row * valid).sum() / n_valid if n_valid else per_row.sum() * float("nan")

    def backward(g):
        p = e * (1.0 / sums)[:, None]                               # local softmax columns
        p[rows, local_t] -= mine.astype(p.dtype)
        p *= valid[:, None]
        p *= g / max(n_valid, 1)
        return (p.astype(logits.data.dtype, copy=False).reshape(logits.shape),)
    return make_result(xp.asarray(loss, dtype=x.dtype), (logits,), backward,
                       "vocab_parallel_cross_entropy")


def _like(linear: Linear, cls, tp, blocks):
    return cls(linear.in_features, linear.out_features, tp, bias=linear.bias is not None,
               init_std=linear.weight.init.std, dtype=linear.weight.spec.dtype, blocks=blocks)


def parallelize_gpt(model, tp) -> Module:
    """Swap a (not yet materialised) GPT's layers for tensor-parallel ones over ``tp``.

    Raises:
        ValueError: ``tp`` larger than the number of heads or the vocabulary, or
            a model whose parameters already hold values.
    """
    if tp.size == 1:
        return model
    cfg = model.config
    if any(p.data is not None for p in model.parameters()):
        raise ValueError("parallelize_gpt needs a model built with materialize_now=False")
    if tp.size > cfg.n_head:
        raise ValueError(f"tp={tp.size} is larger than n_head={cfg.n_head}: every "
                         f"tensor-parallel rank needs at least one head; use tp <= {cfg.n_head}")
    if tp.size > cfg.vocab_size:
        raise ValueError(f"tp={tp.size} is larger than the vocabulary ({cfg.vocab_size})")
    C, hs = cfg.n_embd, cfg.n_embd // cfg.n_head
    h0, h1 = split_range(cfg.n_head, tp.size, tp.rank)
    heads = (h0 * hs, h1 * hs)
    hidden = [split_range(4 * C, tp.size, tp.rank)]
    for block in model.transformer.h.values():
        attn, mlp = block.attn, block.mlp
        qkv = [(heads[0] + k * C, heads[1] + k * C) for k in range(3)]   # q, k, v columns
        attn.c_attn = _like(attn.c_attn, ColumnParallelLinear, tp, qkv)
        attn.c_proj = _like(attn.c_proj, RowParallelLinear, tp, [heads])
        attn.n_head = h1 - h0
        mlp.c_fc = _like(mlp.c_fc, ColumnParallelLinear, tp, hidden)
        mlp.c_proj = _like(mlp.c_proj, RowParallelLinear, tp, hidden)
    if "wte" in model.transformer:
        old = model.transformer.wte
        model.transformer.wte = VocabParallelEmbedding(
            old.num_embeddings, old.embedding_dim, tp, old.weight.init.std, old.weight.spec.dtype)
    if model.last_stage:
        wte = model.transformer.wte
        head = ColumnParallelLinear(C, cfg.vocab_size, tp, bias=False,
                                    blocks=[(wte.vocab_start, wte.vocab_stop)],
                                    dtype=wte.weight.spec.dtype)
        head.weight = wte.weight                                    # still tied
        model.lm_head = head
        start = wte.vocab_start
        model.loss_fn = lambda logits, targets: vocab_parallel_cross_entropy(
            logits, targets, tp, start)
    return model

"""Tensor parallelism, Megatron-LM style (Shoeybi et al., 2019, arXiv:1909.08053).

    mpiexec -n 4 python -m mpi4py -m mpishard train --tp 2 --dp 2

A linear layer's weight is split across the ranks of ``mesh.tp``:

- :class:`ColumnParallelLinear` splits the output features (``weight`` rows):
  ``y_local = f(x) @ W_local.T + b_local``, the output stays split.
- :class:`RowParallelLinear` splits the input features (``weight`` columns):
  ``y = g(x_local @ W_local.T) + b``, the output is whole again.
- :class:`VocabParallelEmbedding` splits the vocabulary; each rank looks up the
  tokens it holds and ``g`` sums the rows.
- :class:`VocabParallelCrossEntropy` computes the loss from vocabulary-split
  logits with three all-reduces of one number per row; full logits never exist.

``f``/``g`` are :func:`~mpishard.parallel.tensor.ops.copy_to_tp` /
:func:`~mpishard.parallel.tensor.ops.reduce_from_tp`.

[Note: sequence parallel]
With ``sequence_parallel`` (Korthikanti et al., 2022, arXiv:2205.05198) the
rows between the tensor-parallel layers -- norms, residual adds, dropout --
are split over tp (rank r holds rows ``sp_rows``): the plan's
``sequence_entry`` module's output is cut to this rank's rows
(:func:`~mpishard.parallel.tensor.sequence.scatter_to_sp`; a dropout entry, the
GPT's, becomes a :class:`RowsDropout` that cuts its input and drops the cut rows,
those rows of one process's mask), a column-parallel layer
all-gathers its input (:func:`~mpishard.parallel.tensor.sequence.gather_from_sp`, a
reduce-scatter in backward; :func:`~mpishard.parallel.tensor.sequence.gathered_linear`
gathers again in backward rather than keep the gathered rows) instead of
``f``, and a row-parallel layer
reduce-scatters its output (:func:`~mpishard.parallel.tensor.sequence.reduce_scatter_to_sp`)
instead of ``g``. The parameters replicated over tp that such rows reach (norm
weights, row-parallel biases, a replicated key/value projection) then get only
this rank's rows' share of their gradient, so each use of them goes through
``f`` (identity forward, gradient summed over tp in backward): the sum is part
of every backward, so it composes with accumulation, ZeRO and pipelining. The
swap happens in the owning module's forward hooks, so a module must be called
(``module(...)``) for its parameters to be used this way, never read from outside.
Pipeline stages pass the split rows. Each column-parallel layer gathers for
itself (Llama's q, k and v gather the same rows three times). :func:`apply_tensor_plan`
swaps the layers a model's plan names for these (see [Note: parallel plans] in
mpishard/nn/sharding.py): a style says how a layer's features fall into groups
(an attention head is one group of ``head_size`` features), and each tp rank
takes a contiguous run of groups, the first ``n % tp`` ranks one more (5 heads
on 2 ranks: 3 + 2). Every split parameter records its blocks in
``spec.tp_dim``/``spec.tp_blocks`` and is initialised by cutting its blocks from
the same (seed, name) tensor the unsharded model draws, so a tensor-parallel
model starts equal to the plain one.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from mpishard.autodiff import nn_ops
from mpishard.autodiff.ops import mul
from mpishard.autodiff.rows import draw_uniform, release_values
from mpishard.autodiff.shape_ops import reshape
from mpishard.autodiff.tensor import Tensor, is_grad_enabled
from mpishard.core.backend import xp_of
from mpishard.nn import Constant, Dropout, Embedding, Linear, Module, Normal, Parameter
from mpishard.nn.sharding import ColumnParallel, RowParallel, VocabParallel, VocabParallelLoss, plan_of
from mpishard.parallel.plans import matching_modules, split_range
from mpishard.parallel.tensor.sequence import gather_from_sp, gathered_linear, reduce_scatter_to_sp, scatter_to_sp
from mpishard.parallel.tensor.ops import summed_copy, copy_to_tp, reduce_from_tp, vocab_parallel_cross_entropy

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "VocabParallelCrossEntropy", "RowsDropout", "apply_tensor_plan", "tie_parameters"]


def _split_param(global_shape, blocks, dim, init, decay, dtype) -> Parameter:
    local = list(global_shape)
    local[dim] = sum(b - a for a, b in blocks)
    p = Parameter(tuple(local), init, decay, dtype)
    p.spec = dataclasses.replace(p.spec, global_shape=tuple(global_shape), tp_dim=dim,
                                 tp_blocks=tuple(blocks))
    return p


class _SplitLinear(Module):
    """A linear layer (weight ``[out, in]``) whose weight is split over ``tp`` along
    ``split_dim``: this rank holds the feature ``blocks`` of that dimension. The bias
    follows the output features: split with them, or whole when the inputs are split."""

    #: 0: the output features are split (weight rows), 1: the input features (columns)
    split_dim: int

    def __init__(self, in_features: int, out_features: int, tp, bias: bool = True,
                 init_std: float = 0.02, dtype: str = "float32", blocks=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        split = (out_features, in_features)[self.split_dim]
        self.blocks = tuple(blocks or [split_range(split, tp.size, tp.rank)])
        self.weight = _split_param((out_features, in_features), self.blocks, self.split_dim,
                                   Normal(init_std), True, dtype)
        if not bias:
            self.bias = None
        elif self.split_dim == 0:
            self.bias = _split_param((out_features,), self.blocks, 0, Constant(0.0), False, dtype)
        else:
            self.bias = Parameter((out_features,), Constant(0.0), False, dtype)


class ColumnParallelLinear(_SplitLinear):
    """Output features split over ``tp``: ``y_local = f(x) @ W_local.T + b_local``.

    Args:
        in_features, out_features: the global sizes.
        tp: the tensor-parallel Communicator.
        blocks: output-feature ranges this rank holds, concatenated in order
            (default: an even split).
    """

    split_dim = 0

    def forward(self, x, bias=True):
        b = self.bias if bias else None
        if self.sequence_parallel:   # x holds this rank's rows: gathered (twice, see the op)
            return gathered_linear(x, self.weight, b, self.tp)
        return nn_ops.linear(copy_to_tp(x, self.tp), self.weight, b)

    def forward_unbiased(self, x):
        """The output without this rank's bias shard (see :func:`mpishard.nn.unbiased`)."""
        return self.forward(x, bias=False)


class RowParallelLinear(_SplitLinear):
    """Input features split over ``tp``: ``y = g(x_local @ W_local.T) + b``.

    ``x_local`` is the split output of a column-parallel layer; the bias is
    replicated and added once, after the all-reduce. Arguments as
    :class:`ColumnParallelLinear`'s (``blocks``: input-feature ranges).
    """

    split_dim = 1

    def forward(self, x_local):
        y = self.forward_unbiased(x_local)
        if self.bias is None:
            return y
        out = y + self.bias
        release_values(y)        # the add's backward reads no values: none kept for it
        return out

    def forward_unbiased(self, x_local):
        """The reduced output before the bias (see :func:`mpishard.nn.unbiased`); this
        rank's partial product, summed into it, is not kept for backward (neither
        collective's backward reads it)."""
        partial = nn_ops.linear(x_local, self.weight)
        y = reduce_scatter_to_sp(partial, self.tp) if self.sequence_parallel else \
            reduce_from_tp(partial, self.tp)
        if y is not partial:                          # (tp 1: the product itself)
            release_values(partial)
        return y


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
        masked = mul(rows, mine[..., None].astype(self.weight.data.dtype))
        summed = reduce_from_tp(masked, self.tp)
        release_values(rows)     # backward reads neither (the product's only the mask)
        release_values(masked)
        return summed


class VocabParallelCrossEntropy(Module):
    """The mean cross-entropy of logits whose vocabulary columns start at ``vocab_start``."""

    def __init__(self, tp, vocab_start: int):
        super().__init__()
        self.tp, self.vocab_start = tp, vocab_start

    def forward(self, logits, targets):
        return vocab_parallel_cross_entropy(logits, targets, self.tp, self.vocab_start)


# -- applying a plan -------------------------------------------------------------

def _groups(n: int, unit: int, parts: int, what: str, path: str, tp) -> tuple:
    """This rank's ``(first, stop)`` group of the ``n // (parts * unit)`` per segment."""
    if n % parts or (n // parts) % unit:
        raise ValueError(f"{path}: {n} features do not split into {parts} segment(s) of "
                         f"groups of {unit} ({what}); the plan does not fit the layer")
    groups = n // parts // unit
    if tp.size > groups:
        raise ValueError(f"tp={tp.size} is larger than {what}={groups} ({path}): every "
                         f"tensor-parallel rank needs at least one; use tp <= {groups}")
    return split_range(groups, tp.size, tp.rank)


def _swap(model, path: str, module, style, tp, sp: bool = False):
    """The tensor-parallel replacement of ``module`` for ``style``."""
    if isinstance(style, VocabParallelLoss):
        head = model.get_submodule(style.logits)
        return VocabParallelCrossEntropy(tp, head.blocks[0][0])
    if isinstance(style, VocabParallel):
        if not isinstance(module, Embedding):
            raise TypeError(f"{path}: VocabParallel applies to an Embedding, not "
                            f"{type(module).__name__}")
        _groups(module.num_embeddings, 1, 1, style.groups, path, tp)
        return VocabParallelEmbedding(module.num_embeddings, module.embedding_dim, tp,
                                      module.weight.init.std, module.weight.spec.dtype)
    if not isinstance(module, Linear):
        raise TypeError(f"{path}: {type(style).__name__} applies to a Linear, not "
                        f"{type(module).__name__}")
    kwargs = dict(bias=module.bias is not None, init_std=module.weight.init.std,
                  dtype=module.weight.spec.dtype)
    if isinstance(style, ColumnParallel):
        n = module.out_features
        if style.replicate_unless_divisible and (n // style.parts // style.unit) % tp.size:
            if sp:  # whole on every rank, from the gathered rows; see [Note: sequence parallel]
                module.register_forward_pre_hook(
                    lambda m, args: (gather_from_sp(args[0], tp), *args[1:]))
                return module
            # whole on every rank; the output's gradient summed over tp (Megatron's f)
            module.register_forward_hook(lambda m, args, out: copy_to_tp(out, tp))
            return module
        kwargs["sequence_parallel"] = sp
        g0, g1 = _groups(n, style.unit, style.parts, style.groups, path, tp)
        seg = n // style.parts
        blocks = [(k * seg + g0 * style.unit, k * seg + g1 * style.unit)
                  for k in range(style.parts)]
        return ColumnParallelLinear(module.in_features, n, tp, blocks=blocks, **kwargs)
    if isinstance(style, RowParallel):
        g0, g1 = _groups(module.in_features, style.unit, 1, style.groups, path, tp)
        return RowParallelLinear(module.in_features, module.out_features, tp,
                                 blocks=[(g0 * style.unit, g1 * style.unit)],
                                 sequence_parallel=sp, **kwargs)
    raise TypeError(f"{path}: unknown tensor-parallel style {style!r}")


def apply_tensor_plan(model, tp, plan=None, sequence_parallel: bool = False) -> Module:
    """Swap the layers ``plan`` (default: the model's own) names for tensor-parallel ones.

    The model must not be materialised yet (its split parameters are drawn in
    their slices later). Tied parameters (``plan.tied``) are tied again after
    the swap. Returns the model.

    Raises:
        ValueError: ``tp`` larger than a layer's groups (heads, vocabulary), a
            model without a tensor-parallel plan at ``tp > 1``, or parameters
            that already hold values.
    """
    if tp.size == 1:
        return model
    plan = plan or plan_of(model)
    if not plan.tensor:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan (its "
                         f"parallel_plan() lists no tensor styles); use tp=1")
    if any(p.data is not None for p in model.parameters()):
        raise ValueError("apply_tensor_plan needs a model built with materialize_now=False")
    if sequence_parallel and not plan.sequence_entry:
        raise ValueError(f"{type(model).__name__} has no sequence-parallel plan (its "
                         f"parallel_plan() has no sequence_entry); turn off sequence "
                         f"parallelism")
    for pattern, style in plan.tensor:
        for path, module in matching_modules(model, pattern):
            model.set_submodule(path, _swap(model, path, module, style, tp, sequence_parallel))
    tie_parameters(model, plan.tied)
    if sequence_parallel:
        _split_rows(model, tp, plan)
    return model


def _split_rows(model, tp, plan) -> None:
    """The rest of [Note: sequence parallel]: cut the rows after the plan's entry module
    and sum the gradients of the tp-replicated parameters those rows reach."""
    entry = plan.sequence_entry
    try:
        module = model.get_submodule(entry)
    except KeyError:
        module = None          # a pipeline stage without the embeddings
    if isinstance(module, Dropout):   # cut before it, as Megatron-LM: see RowsDropout
        model.set_submodule(entry, RowsDropout(module.p, tp))
    elif module is not None:
        module.register_forward_hook(lambda m, args, out: _cut_rows(out, tp))
    model.sequence_parallel_size = tp.size   # the rows a pipeline stage passes on
    first = tuple(plan.pipeline.first) if plan.pipeline is not None else ()
    for path, owner in model.named_modules():
        if any(path == f or path.startswith(f + ".") for f in first):
            continue           # embeddings see every row
        names = [n for n, p in owner._parameters.items()
                 if p is not None and p.spec.tp_dim is None]
        if names:
            owner.register_forward_pre_hook(lambda m, args, names=names: _use_summed(m, names, tp))
            owner.register_forward_hook(lambda m, args, out, names=names: _drop_uses(m, names))


def _cut_rows(out, tp):
    """This rank's rows of the entry module's output ``out``, which nothing reads after
    (the hook's result replaces it), nor does the cut's backward: let go of it."""
    rows = reshape(out, (-1, out.shape[-1]))
    mine = scatter_to_sp(rows, tp)
    if mine is not rows:
        for whole in (out, rows):
            release_values(whole)
    return mine


class RowsDropout(Dropout):
    """A dropout entering the sequence-parallel region: it cuts its input to this rank's
    rows, then drops them (Megatron-LM's order: a mask of ``N / tp`` rows kept, not
    ``N``), with those rows of the mask one process draws for the whole input.

    Its generator is the dropout's own (seeded from the same module name) and ends
    each forward as the whole draw leaves it, so every tp rank's and one process's
    stay equal, and the ranks' masks together are one process's: the output gathered
    over tp is bit-identical to the unsplit dropout's.
    """

    def __init__(self, p: float, tp):
        super().__init__(p)
        self.tp = tp

    def forward(self, x):
        mine = _cut_rows(x, self.tp)                        # (N/tp, C)
        if not self.training or self.p == 0.0:
            return mine
        n, width = mine.shape
        xp = xp_of(mine.data)
        draws = _draw_rows(self.rng, n * self.tp.rank, n * (self.tp.rank + 1),
                           n * self.tp.size, width, xp)
        out = nn_ops.dropout(mine, self.p, _Drawn(draws), True)
        release_values(mine)     # the cut's backward and the dropout's read no values
        return out


class _Drawn:
    """Uniforms already drawn, as the generator :func:`~mpishard.autodiff.nn_ops.dropout`
    reads its draws from (``random(shape, dtype)``)."""

    def __init__(self, draws):
        self.draws = draws

    def random(self, shape, dtype=None, out=None):
        if tuple(shape) != tuple(self.draws.shape):
            raise ValueError(f"draws of shape {tuple(self.draws.shape)} asked for as "
                             f"{tuple(shape)}")
        return self.draws


def _draw_rows(rng, start: int, stop: int, n_rows: int, width: int, xp):
    """Rows ``[start, stop)`` of the ``(n_rows, width)`` float32 uniforms ``rng`` would
    draw next (:func:`~mpishard.autodiff.rows.draw_uniform`), leaving ``rng`` as that
    whole draw would. A NumPy PCG64 generator skips the other rows (each float32 is
    one 32-bit half of a 64-bit step); any other draws them all."""
    if not (isinstance(rng, np.random.Generator) and
            type(rng.bit_generator) in (np.random.PCG64, np.random.PCG64DXSM)):
        return draw_uniform(rng, (n_rows, width), xp)[start:stop].copy()
    _skip_floats(rng, start * width)
    rows = draw_uniform(rng, (stop - start, width), xp)
    _skip_floats(rng, (n_rows - stop) * width)
    return rows


def _skip_floats(rng, k: int) -> None:
    """Advance a PCG64 ``rng`` past ``k`` float32 draws, its state (the buffered 32-bit
    half too) as drawing them would leave it."""
    if k and rng.bit_generator.state["has_uint32"]:
        rng.random(1, dtype=np.float32)        # the buffered half
        k -= 1
    if k == 0:
        return
    steps = (k - 1) // 2                       # whole 64-bit steps, then the last one or
    if steps:                                  # two halves drawn (advance() resets the
        rng.bit_generator.advance(steps)       # buffer; a draw sets it as it would be)
    rng.random(k - 2 * steps, dtype=np.float32)


class _SummedUse(Tensor):
    """``f(parameter)`` (identity forward, gradient summed over tp in backward) whose data
    is always the parameter's current array: ZeRO-3 can release a block's gathered unit
    after its forward without this use holding on to it until backward."""

    __slots__ = ("_param",)
    data = property(lambda self: self._param.data, lambda self, value: None)

    def __init__(self, param, tp):
        self._param = param
        super().__init__(param.data)
        if is_grad_enabled() and param.requires_grad:
            self.requires_grad, self._parents, self._op = True, (param,), "copy_to_tp"
            self._backward = lambda g: (summed_copy(g, tp),)


def _use_summed(module, names, tp) -> None:
    """For this forward, ``module.<name>`` is ``f(parameter)`` (gradient summed over tp)."""
    for name in names:
        module.__dict__[name] = _SummedUse(module._parameters[name], tp)


def _drop_uses(module, names) -> None:
    for name in names:
        module.__dict__.pop(name, None)


def tie_parameters(model, tied) -> None:
    """Make each ``(alias, source)`` pair one parameter where the model holds both."""
    names = dict(model.named_parameters(remove_duplicate=False))
    for alias, source in tied:
        if alias not in names or source not in names:
            continue
        owner, _, attr = alias.rpartition(".")
        if names[alias].shape != names[source].shape:
            raise ValueError(f"tied {alias} {names[alias].shape} and {source} "
                             f"{names[source].shape} differ after the tensor-parallel split")
        setattr(model.get_submodule(owner), attr, names[source])

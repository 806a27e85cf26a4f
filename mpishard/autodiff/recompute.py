"""Activation checkpointing: keep a function's inputs, recompute the rest in backward.

``recompute(fn, *args)`` runs ``fn`` without recording its graph, so none of
its intermediate activations outlive the call; only the inputs (and the states
of the random generators named in ``rngs``) are kept. When backward reaches the
result, ``fn`` runs again with the graph on, and the engine's backward runs
through that fresh graph. The cost is one extra forward of ``fn`` per backward
(Chen et al., 2016, "Training Deep Nets with Sublinear Memory Cost",
arXiv:1604.06174).

    >>> y = recompute(block_math, x, batch_size, rngs=[dropout.rng])

[Note: recompute]
- Same numbers: the recompute runs the same ops on the same input arrays, and
  every generator in ``rngs`` is set back to its state from just before the
  first run, so dropout draws the same masks. Afterwards each generator goes
  back to the state it had when backward began (other forwards, e.g. later
  pipeline micro-batches, may have drawn from it since). Gradients are
  bit-identical to running ``fn`` without checkpointing.
- Parameters that ``fn`` reads (and does not take as ``args``) are leaves of
  the inner graph only: the inner backward accumulates their ``grad`` and
  fires their grad-ready hooks (see [Note: grad-ready hooks] in engine.py).
  Such a parameter must not also be used outside ``fn`` (or in a second
  recomputed call) in the same backward, or its hooks would fire before its
  gradient is final.
- ``fn`` reads ``param.data`` when it runs, also the second time, so a strategy
  that gathers parameters before backward (ZeRO-3) has them in place when the
  recompute needs them; see [Note: parameter storage] in tensor.py.
- Collectives inside ``fn`` (tensor-parallel layers) run again in backward,
  in the same order on every rank, so they stay matched.
- The result joins the graph whenever grad mode is on, even if no input
  requires grad: ``fn`` may use parameters that do.
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence

import numpy as np

from mpishard.autodiff.tensor import Tensor, enable_grad, is_grad_enabled, no_grad

__all__ = ["recompute", "device_state_array", "kept_product", "every_second"]


# [Note: kept products]
# ``recompute(fn, ..., keep=every_second)`` recomputes ``fn`` as usual but for some of
# its matrix products: torchtitan's selective recomputation by op
# (``selective_ac_option = "op"``: the outputs of every second ``mm`` of a block kept,
# the rest of the block recomputed). The product ops (``linear``, ``gathered_linear``)
# hand their output computation to :func:`kept_product`. Inside a recomputed call with
# a ``keep`` policy, the first run numbers the products in the order they run and holds
# the outputs of those ``keep(i)`` selects; the recompute runs the same code, so the
# same products come in the same order, and each kept one takes its held output
# instead of multiplying again (the same bits), then the holds are let go. A product
# whose output is kept skips what the op did to make it, on every rank alike (under
# sequence parallelism the input's all-gather: backward gathers it again anyway).
# Calls nested inside (a recomputed call of their own) keep nothing and are not
# counted, in both runs alike. The kept outputs are plain arrays an op made and
# handed on; an op that writes into its input in place would change a kept one (none
# of the model's readers of a kept product do: tests/autodiff hold the gradients
# bit-identical).

def every_second(i: int) -> bool:
    """Keep products 0, 2, 4, ... of a block (torchtitan's "op" policy keeps every
    second matrix product's output, the first included)."""
    return i % 2 == 0


class _Products(threading.local):
    held = None     # the dict of the call being recorded or replayed, or None
    keep = None     # its policy
    replay = False
    count = 0


_products = _Products()


def kept_product(compute: Callable[[], object], signature=None):
    """A product op's output, ``compute()``, or inside a recomputed call with a ``keep``
    policy the held one (see [Note: kept products]). ``signature``: what identifies the
    product (its weight's and its input's or output's shapes); the recompute must meet
    the same ones in the same order, else it raises instead of handing one product's
    output to another."""
    p = _products
    if p.keep is None:
        return compute()
    i = p.count
    p.count += 1
    seen = p.held.setdefault("signatures", {})
    if not p.replay:
        seen[i] = signature
    elif seen.get(i, signature) != signature or i not in seen:
        raise RuntimeError(f"recompute: product {i} of the recompute is not the one the first "
                           f"run made ({signature} against {seen.get(i)}): the recomputed "
                           f"function must run the same products in the same order")
    if not p.keep(i):
        return compute()
    if p.replay:
        return p.held[i]
    out = compute()
    p.held[i] = out
    return out


class _counting:
    """Run a block of code as one recorded (or replayed) call: ``held`` its kept outputs."""

    def __init__(self, keep, held: dict, replay: bool):
        self.state = (keep, held, replay, 0)

    def __enter__(self):
        p = _products
        self.before = (p.keep, p.held, p.replay, p.count)
        p.keep, p.held, p.replay, p.count = self.state

    def __exit__(self, *exc):
        p = _products
        p.keep, p.held, p.replay, p.count = self.before


def recompute(fn: Callable[..., Tensor], *args, rngs: Sequence = (), keep=None) -> Tensor:
    """``fn(*args)``, keeping only ``args``; ``fn`` runs again when backward needs it.

    Args:
        fn: a function of ``args`` returning one Tensor. It must compute the
            same thing when called again (no state of its own that changes).
        *args: Tensors (kept for the recompute; gradients flow to those that
            require grad) and any other values (passed through as they are).
        rngs: random generators ``fn`` draws from (NumPy ``Generator`` or
            ``RandomState``, CuPy ``Generator``); their states are saved so
            the recompute draws the same numbers. See [Note: recompute].
        keep: ``None``, or a policy ``keep(i) -> bool`` over the matrix products ``fn``
            runs, numbered from 0: the outputs it selects are kept from the first run
            and not computed again (see [Note: kept products]; :func:`every_second`).

    Returns:
        A Tensor with ``fn``'s values whose backward recomputes ``fn``.

    Raises:
        TypeError: ``fn`` did not return a Tensor, or a generator of a kind
            whose state cannot be saved.
    """
    rngs = tuple(rngs)
    saved_states = [_get_state(rng) for rng in rngs]
    held: dict = {}
    with no_grad(), _counting(keep, held, False):
        out = fn(*args)
    if not isinstance(out, Tensor):
        raise TypeError(f"recompute: {getattr(fn, '__name__', fn)!r} returned "
                        f"{type(out).__name__}, expected one Tensor")
    # Each Tensor once, even if passed twice: its leaf collects both uses.
    tensor_args = tuple({id(a): a for a in args if isinstance(a, Tensor)}.values())

    def backward(g):
        states_now = [_get_state(rng) for rng in rngs]
        for rng, state in zip(rngs, saved_states):
            _set_state(rng, state)
        try:
            # Fresh leaves on the same arrays: the inner backward stops at them.
            leaves = {id(a): Tensor(a.data, requires_grad=a.requires_grad)
                      for a in tensor_args}
            with enable_grad(), _counting(keep, held, True):
                again = fn(*[leaves[id(a)] if isinstance(a, Tensor) else a for a in args])
        finally:
            for rng, state in zip(rngs, states_now):
                _set_state(rng, state)
            held.clear()      # the graph just built holds what backward reads
        if again.requires_grad:
            again.backward(g)
        return tuple(leaves[id(a)].grad if a.requires_grad else None for a in tensor_args)

    result = Tensor(out.data)
    if is_grad_enabled():
        result.requires_grad = True
        result._parents = tensor_args
        result._backward = backward
        result._op = "recompute"
    return result


# -- generator states --------------------------------------------------------------

def _get_state(rng):
    if isinstance(rng, np.random.Generator):
        return rng.bit_generator.state          # a fresh dict each call
    if isinstance(rng, np.random.RandomState):
        return rng.get_state()
    device_state = device_state_array(rng)
    if device_state is not None:
        return device_state.copy()
    raise TypeError(f"recompute: cannot save the state of a {type(rng).__module__}."
                    f"{type(rng).__name__}; pass NumPy Generator/RandomState or CuPy "
                    f"Generator objects in rngs")


def _set_state(rng, state) -> None:
    if isinstance(rng, np.random.Generator):
        rng.bit_generator.state = state
    elif isinstance(rng, np.random.RandomState):
        rng.set_state(state)
    else:
        device_state_array(rng)[...] = state


def device_state_array(rng):
    """The device array holding a device ``Generator``'s whole state, or ``None``.

    CuPy offers no public way to save a Generator's state; its cuRAND bit
    generators (XORWOW, MRG32k3a, Philox) keep it in one device array,
    ``bit_generator._state`` (int8 bytes), which is copied and written back
    here (the strict module's generators keep theirs the same way). That array
    is large on CuPy (one cuRAND state per thread: 32768 threads x 48 bytes for
    XORWOW, 1.5 MiB), and one copy per generator is kept per recomputed call
    until its backward. Checkpoints save it too (mpishard.checkpoint.state).
    """
    if isinstance(rng, (np.random.Generator, np.random.RandomState)):
        return None
    state = getattr(getattr(rng, "bit_generator", None), "_state", None)
    if state is None or isinstance(state, np.ndarray) or not hasattr(
            state, "__cuda_array_interface__"):
        return None
    return state

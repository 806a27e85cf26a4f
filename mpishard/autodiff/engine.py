"""The backward engine: the walk over the graph that :meth:`.Tensor.backward` starts.

[Note: backward order]
Backward visits the graph in reverse topological order computed by an
iterative depth-first search over parents in the order each op lists them. No
recursion (deep graphs are fine) and no set or hash order (two runs visit the
same nodes in the same order and give bit-identical gradients).

[Note: grad-ready hooks]
``register_grad_ready_hook(fn)`` calls ``fn(tensor)`` once the tensor's
gradient is final for this backward pass: for an interior tensor just before its
own backward closure runs; for a leaf (a parameter) as soon as the last op that
consumed it has contributed, which is how data parallelism launches a bucket's
all-reduce while backward carries on, and how ZeRO-3 gathers a unit's
parameters just before they are needed (a hook on the unit's output).

Gradients arrive in :func:`_accumulate` (see [Note: gradient buffers] in tensor.py for
the ops that write them in place).
"""
from __future__ import annotations

from mpishard.autodiff import profile as _profile

__all__ = ["run_backward"]


def _topological_order(root) -> list:
    """Iterative DFS post-order of the tensors that require grad. See [Note: backward order]."""
    order: list = []
    visited: set[int] = set()  # membership only; iteration order never depends on it
    stack: list[tuple] = [(root, 0)]
    visited.add(id(root))
    while stack:
        node, i = stack[-1]
        parents = node._parents
        while i < len(parents):
            parent = parents[i]
            i += 1
            if parent is not None and parent.requires_grad and id(parent) not in visited:
                visited.add(id(parent))
                stack[-1] = (node, i)
                stack.append((parent, 0))
                break
        else:
            stack.pop()
            order.append(node)
    return order


def run_backward(root, grad) -> None:
    """Backward from Tensor ``root`` with gradient ``grad`` (see the notes above)."""
    order = _topological_order(root)
    # How many graph edges still have to deliver a gradient to each leaf, so
    # its grad-ready hooks fire at the earliest correct moment.
    pending: dict[int, int] = {}
    for node in order:
        for parent in node._parents:
            if parent is not None and parent.requires_grad and parent._backward is None:
                pending[id(parent)] = pending.get(id(parent), 0) + 1

    if root._backward is None:  # backward on a leaf itself
        _accumulate(root, grad)
        root._fire_hooks()
        return
    root.grad = grad
    for node in reversed(order):
        backward_fn = node._backward
        if backward_fn is None:
            continue  # leaves: gradients arrive through their consumers
        g = node.grad
        parents = node._parents
        if g is not None:
            node._fire_hooks()
            recording = _profile.active                # see profile.py
            parent_grads = backward_fn(g) if recording is None else \
                recording.backward(node._op, backward_fn, g)
            seen: list = []
            for parent, pg in zip(parents, parent_grads):
                if parent is None or not parent.requires_grad:
                    continue
                if pg is not None:
                    # Two parents handed the very same array must not share it,
                    # or an in-place accumulation into one would change the other.
                    if any(pg is s for s in seen):
                        pg = pg.copy()
                    seen.append(pg)
                    _accumulate(parent, pg)
        # Free this node's gradient and the graph behind it as we go.
        node.grad = None
        node._backward = None
        node._parents = ()
        for parent in parents:
            if parent is not None and parent.requires_grad and parent._backward is None:
                left = pending[id(parent)] - 1
                pending[id(parent)] = left
                if left == 0:
                    parent._fire_hooks()


def _accumulate(tensor, g) -> None:
    if g is tensor.grad:                   # the op added into it (see grad_so_far)
        return
    if g.shape != tuple(tensor.shape):  # a Parameter's shape holds even while released
        raise RuntimeError(
            f"internal error: gradient of shape {g.shape} for tensor {tensor!r} "
            f"{tensor.name!r}; an op's backward returned the wrong shape")
    # A gradient is added in the dtype of the buffer already there (a strategy's
    # bucket view), else in the tensor's grad_dtype, else in its data's dtype.
    if tensor.grad is not None:
        dtype = tensor.grad.dtype
    else:
        dtype = tensor.grad_dtype or tensor.data.dtype
    if g.dtype != dtype:
        g = g.astype(dtype)
    if tensor.grad is None:
        tensor.grad = g
    else:
        tensor.grad += g

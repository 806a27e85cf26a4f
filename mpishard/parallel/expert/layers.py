"""Expert parallelism: each rank of ``mesh.ep`` holds ``E / ep`` of every MoE layer's experts.

    mesh = Mesh(world, ep=4)                       # ep is carved out of dp_shard x cp
    run = ParallelModel(Llama(LlamaConfig(..., moe_experts=8), materialize_now=False),
                        mesh, strategy="zero3")

[Note: expert dispatch]
The router runs on this rank's own tokens, as without expert parallelism, and
sorts the ``(token, expert)`` rows it keeps by expert (capacity is applied to
this rank's tokens, so the rows kept do not depend on ``ep``). Expert ``e``
lives on rank ``e // (E / ep)`` of the ep group; the sorted rows therefore
already come grouped by destination::

    rank r's rows, by expert:    [e0 e0 e1 | e2 | e3 e3 e3]      (E = 4, ep = 2)
                                  to rank 0 | to rank 1
    1. counts: an all-to-all of the rows per expert (E integers per rank)
    2. dispatch: an all-to-all-v of the rows   -> rank 0 holds, from each source s,
       s's rows for e0 then e1 (source-major)
    3. a permutation to expert-major order (e0 rows of every source, then e1),
       one batched product per local expert (``expert_swiglu`` / ``expert_gelu``)
    4. the inverse permutation, and combine: the all-to-all-v back (counts swapped)
    5. each row weighted by its routing weight and added into its token, as before

Backward runs the same exchanges the other way (every op here is linear in
the rows), so each rank's expert weights receive the gradient of every token
routed to them from the whole ep group. Summed over the ranks that hold the
same experts (``mesh.edp``) that is every token of ``dp x cp``: the strategies
average expert gradients over ``edp`` and divide by ``ep`` (``dp_cp = edp x ep``
ranks contributed; :meth:`Strategy.replica_group` names the group).

Experts are replicated over tp: without sequence parallelism the tp ranks of a
group route and compute the same rows; with it, each routes its own rows and
the experts' gradients are summed over tp like any tp-replicated parameter.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from mpishard.autodiff.graph import as_tensor, make_result, register_op
from mpishard.autodiff.moe_ops import permute_rows
from mpishard.autodiff.tensor import Tensor
from mpishard.core.backend import xp_of
from mpishard.nn import Parameter
from mpishard.parallel.plans import split_range

__all__ = ["ExpertShard", "apply_expert_plan", "all_to_all_v", "check_experts_divide"]


@register_op
def all_to_all_v(x, comm, send_counts, recv_counts) -> Tensor:
    """Rows of ``x`` to the ranks of ``comm`` (``send_counts[j]`` rows to rank ``j``, in
    order); backward sends the gradients back the same way (counts swapped)."""
    x = as_tensor(x)
    xp = xp_of(x.data)
    send = xp.ascontiguousarray(x.data)
    out = comm.all_to_all_v(send, send_counts, recv_counts)

    def backward(g):
        return (comm.all_to_all_v(xp.ascontiguousarray(g), recv_counts, send_counts),)
    return make_result(out, (x,), backward, "all_to_all_v")


def _expert_major(recv: np.ndarray) -> np.ndarray:
    """Row permutation from source-major ``(source, expert)`` blocks of ``recv[s, e]``
    rows to expert-major order (stable within each expert)."""
    sizes = recv.reshape(-1)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).reshape(recv.shape)
    parts = [np.arange(starts[s, e], starts[s, e] + recv[s, e])
             for e in range(recv.shape[1]) for s in range(recv.shape[0])]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


class ExpertShard:
    """One MoE layer's share of expert parallelism: which experts, and the exchanges.

    Args:
        ep: the expert-parallel Communicator.
        n_experts: the layer's experts ``E`` (``E % ep.size == 0``).
    """

    def __init__(self, ep, n_experts: int):
        self.ep, self.n_experts = ep, n_experts
        self.local = n_experts // ep.size
        #: ``(rows sent to each rank, rows received from each)`` of the last forward
        self.last_counts: tuple | None = None

    def __call__(self, experts, x_sorted, kept):
        """The local experts over the ep group's rows for them, each row sent back to
        where it came from (see [Note: expert dispatch]).

        Args:
            experts: the module of the local experts (``forward(rows, offsets)``).
            x_sorted: ``(M, C)`` this rank's rows sorted by (global) expert.
            kept: rows per global expert (host integers, ``M`` in all).
        """
        n, El = self.ep.size, self.local
        per_expert = np.asarray(kept, dtype=np.int64).reshape(n, El)
        recv = self.ep.all_to_all(np.ascontiguousarray(per_expert)).reshape(n, El)
        send_counts = per_expert.sum(axis=1).tolist()
        recv_counts = recv.sum(axis=1).tolist()
        self.last_counts = (send_counts, recv_counts)
        rows = all_to_all_v(x_sorted, self.ep, send_counts, recv_counts)
        xp = xp_of(rows.data)
        perm = _expert_major(recv)
        offsets = [0, *np.cumsum(recv.sum(axis=0)).tolist()]
        y = experts(permute_rows(rows, xp.asarray(perm)), offsets)
        back = permute_rows(y, xp.asarray(np.argsort(perm, kind="stable")))
        return all_to_all_v(back, self.ep, recv_counts, send_counts)


def _is_moe(module) -> bool:
    """A mixture-of-experts layer: ``n_experts``, an ``experts`` module whose parameters
    stack the experts along dimension 0, and a ``dispatch`` slot (models/moe.py's MoE)."""
    return hasattr(module, "n_experts") and "dispatch" in vars(module) and \
        "experts" in module._modules


def check_experts_divide(model, ep: int) -> None:
    """ValueError naming the fix when ``ep`` does not divide a MoE layer's experts."""
    for name, m in model.named_modules():
        if _is_moe(m) and m.n_experts % ep:
            raise ValueError(f"expert parallelism ep={ep} does not divide the "
                             f"{m.n_experts} experts of {name}; use an ep that divides "
                             f"{m.n_experts} (or moe_experts a multiple of {ep})")


def apply_expert_plan(model, ep) -> None:
    """Keep this rank's ``E / ep`` experts of every MoE layer of ``model`` and route
    through :class:`ExpertShard` (the model is unmaterialised or whole)."""
    check_experts_divide(model, ep.size)
    if ep.size == 1:
        return
    for _, moe in model.named_modules():
        if not _is_moe(moe):
            continue
        shard = ExpertShard(ep, moe.n_experts)
        lo, hi = split_range(moe.n_experts, ep.size, ep.rank)
        experts = moe.experts
        for name, p in list(experts._parameters.items()):
            if p is None:
                continue
            local = Parameter((hi - lo, *p.shape[1:]), p.init, p.decay, p.spec.dtype)
            local.spec = dataclasses.replace(p.spec, ep_range=(lo, hi))
            if p.data is not None:
                local.data = xp_of(p.data).ascontiguousarray(p.data[lo:hi])
            setattr(experts, name, local)      # keeps its place among the parameters
        moe.dispatch = shard

"""A mixture-of-experts MLP: a top-k router over E SwiGLU experts, Mixtral's layout.

    moe = MoE(n_embd=64, intermediate_size=96, n_experts=8, top_k=2)
    y = moe(x)                 # (N, C) -> (N, C); moe.route: what the router did
    aux = load_balancing_loss([moe.route, ...], n_experts=8)

The router is a bias-free linear layer (``gate``) to E logits, a softmax, the
``top_k`` largest probabilities renormalised to sum to one (Mixtral, Jiang et
al., 2024, arXiv:2401.04088). Each (token, expert) pair is one row; the rows are
sorted by expert and every expert computes its run in one product
(:func:`~mpishard.autodiff.moe_ops.expert_swiglu`), then the weighted rows are
added back into their tokens. Parameter names and shapes are ``transformers``'
Mixtral ones (``gate.weight`` ``(E, C)``, ``experts.gate_up_proj`` ``(E, 2F, C)``,
``experts.down_proj`` ``(E, C, F)``).

A capacity factor ``c`` keeps at most ``ceil(c * N * k / E)`` rows per expert,
the earliest tokens first; the dropped pairs add nothing (the residual carries
the token on). ``capacity=None`` drops nothing (dropless).

[Note: load-balancing loss]
``transformers``' ``load_balancing_loss_func`` (Switch Transformer, Fedus et al.,
2021, eqs. 4-6, over all MoE layers at once): with ``R`` rows per layer over
``L`` layers, ``f_e`` the top-k picks of expert ``e`` summed over the layers
divided by ``L R``, and ``P_e`` its router probability summed over rows and
layers divided by ``L R``, the loss is ``E * sum_e f_e P_e`` (``f`` counts, so
it carries no gradient; ``P`` does). The router z-loss (ST-MoE, Zoph et al.,
2022) is the mean over rows of ``logsumexp(logits)^2``.
"""
from __future__ import annotations

import math
from itertools import accumulate

from mpishard.autodiff.moe_ops import expert_gelu, expert_swiglu, scatter_rows
from mpishard.autodiff.nn_ops import embedding
from mpishard.autodiff.ops import mul, sum, tanh  # noqa: A004 (the op)
from mpishard.autodiff.shape_ops import getitem, reshape
from mpishard.autodiff.softmax_ops import log_softmax, softmax
from mpishard.core.backend import to_numpy, xp_of
from mpishard.models.spec import AxisSizes, ModelKey
from mpishard.nn import Constant, Linear, Module, Normal, Parameter

__all__ = ["MoE", "MoEExperts", "GELUExperts", "Route", "load_balancing_loss",
           "router_z_loss", "with_router_losses", "MOE_KEYS", "moe_fields", "check_moe_split"]

#: the ``[model]`` keys of a mixture of experts, which the GPT and the Llama family read
#: (their configs' ``moe_*`` fields; Mixtral's names in models/llama/model.py)
MOE_KEYS = (
    ModelKey("moe_experts", 0, "experts per mixture-of-experts MLP (0: dense)", low=0,
             estimate=True, shapes=True),
    ModelKey("moe_top_k", 2, "experts each token is routed to", low=1, estimate=True),
    ModelKey("moe_every", 1, "every n-th block has experts (1: all)", low=1, estimate=True,
             shapes=True),
    ModelKey("moe_capacity", 0.0, "expert capacity factor (0: dropless)", low=0.0,
             estimate=True),
    ModelKey("moe_aux_coef", 0.001, "weight of the load-balancing loss", low=0.0),
    ModelKey("moe_z_coef", 0.0, "weight of the router z-loss", low=0.0),
    ModelKey("moe_router", "softmax", "router scores (sigmoid: DeepSeek-V3's)",
             choices=("softmax", "sigmoid"), estimate=True),
    ModelKey("moe_shared_expert", False, "one more MLP every token goes through",
             estimate=True, shapes=True))


def moe_fields(keys: dict) -> dict:
    """The ``moe_*`` config fields among ``[model]`` keys (those given)."""
    return {k.name: keys[k.name] for k in MOE_KEYS if k.name in keys}


class Route:
    """What one MoE layer's router did in its last forward (for the losses and metrics).

    Attributes:
        counts: top-k picks per expert (host int array, before capacity).
        kept: rows each expert computed (after capacity).
        prob_sum: ``(E,)`` router probabilities summed over rows (a graph Tensor).
        logits: ``(N, E)`` router logits (a graph Tensor, for the z-loss).
        rows: ``N``.
    """

    __slots__ = ("counts", "kept", "prob_sum", "logits", "rows")

    def __init__(self, counts, kept, prob_sum, logits, rows: int):
        self.counts, self.kept, self.prob_sum = counts, kept, prob_sum
        self.logits, self.rows = logits, rows

    @property
    def dropped_fraction(self) -> float:
        total = int(self.counts.sum())
        return 1.0 - int(self.kept.sum()) / total if total else 0.0


class MoEExperts(Module):
    """E SwiGLU experts' weights, stored as ``transformers``' Mixtral stores them."""

    def __init__(self, n_experts: int, n_embd: int, intermediate_size: int,
                 init_std: float = 0.02, dtype: str = "float32"):
        super().__init__()
        E, C, F = n_experts, n_embd, intermediate_size
        self.gate_up_proj = Parameter((E, 2 * F, C), Normal(init_std), True, dtype)
        self.down_proj = Parameter((E, C, F), Normal(init_std), True, dtype)

    def forward(self, x_sorted, offsets):
        """Every expert on its run of the expert-sorted rows (see ``expert_swiglu``)."""
        return expert_swiglu(x_sorted, offsets, self.gate_up_proj, self.down_proj)


class GELUExperts(Module):
    """E GPT MLPs (``c_fc``, GELU, ``c_proj``, with biases unless ``bias=False``)."""

    def __init__(self, n_experts: int, n_embd: int, hidden: int, bias: bool = True,
                 init_std: float = 0.02, proj_std: float = 0.02, dtype: str = "float32"):
        super().__init__()
        E, C, H = n_experts, n_embd, hidden
        self.c_fc_weight = Parameter((E, H, C), Normal(init_std), True, dtype)
        self.c_fc_bias = Parameter((E, H), Constant(0.0), False, dtype) if bias else None
        self.c_proj_weight = Parameter((E, C, H), Normal(proj_std), True, dtype)
        self.c_proj_bias = Parameter((E, C), Constant(0.0), False, dtype) if bias else None
        self.dtype = dtype

    def forward(self, x_sorted, offsets):
        xp = xp_of(self.c_fc_weight.data)
        E, H, C = self.c_fc_weight.data.shape     # E: the experts this rank holds
        zeros = {n: xp.zeros(shape, dtype=self.c_fc_weight.data.dtype)
                 for n, shape in (("fc", (E, H)), ("proj", (E, C)))}
        return expert_gelu(x_sorted, offsets, self.c_fc_weight,
                           self.c_fc_bias if self.c_fc_bias is not None else zeros["fc"],
                           self.c_proj_weight,
                           self.c_proj_bias if self.c_proj_bias is not None else zeros["proj"])


class MoE(Module):
    """Top-``top_k`` routing over ``n_experts`` SwiGLU experts; see the module docstring.

    Args:
        capacity: capacity factor (rows per expert at most ``ceil(capacity * N *
            top_k / E)``), or ``None``: dropless.
        experts: the experts module (default :class:`MoEExperts`, SwiGLU of width
            ``intermediate_size``); GPT passes :class:`GELUExperts`.
        router: ``"softmax"`` scores (Mixtral) or ``"sigmoid"`` scores
            (DeepSeek-V3: each expert's own gate; the top-k renormalised the same
            way, and the load-balancing loss reads each row's scores normalised to
            sum to one).
        shared: a module every token also goes through, added to the experts'
            output (a shared expert, as in DeepSeekMoE and Qwen-MoE), or ``None``.
    """

    def __init__(self, n_embd: int, intermediate_size: int, n_experts: int, top_k: int = 2,
                 capacity: float | None = None, init_std: float = 0.02,
                 dtype: str = "float32", experts: Module | None = None,
                 router: str = "softmax", shared: Module | None = None):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"MoE top_k={top_k} must be between 1 and n_experts={n_experts}")
        if capacity is not None and not capacity > 0:
            raise ValueError(f"MoE capacity factor {capacity!r} must be > 0 (or None: dropless)")
        if router not in ("softmax", "sigmoid"):
            raise ValueError(f"MoE router {router!r} is not 'softmax' or 'sigmoid'")
        self.n_experts, self.top_k, self.capacity, self.router = n_experts, top_k, capacity, router
        self.gate = Linear(n_embd, n_experts, False, init_std, dtype)
        self.experts = experts if experts is not None else \
            MoEExperts(n_experts, n_embd, intermediate_size, init_std, dtype)
        if shared is not None:
            self.shared_expert = shared
        self.route: Route | None = None
        #: this rank's share of the experts (an ExpertShard under expert parallelism)
        self.dispatch = None

    def forward(self, x):
        N, E, k = x.shape[0], self.n_experts, self.top_k
        logits = self.gate(x)                                         # (N, E)
        if self.router == "softmax":
            probs = balance = softmax(logits, axis=-1)
        else:                                # sigmoid(z) = (1 + tanh(z / 2)) / 2
            probs = (tanh(logits * 0.5) + 1.0) * 0.5
            balance = probs / sum(probs, axis=1, keepdims=True)
        xp = xp_of(probs.data)
        picks = xp.argsort(-probs.data, axis=1, kind="stable")[:, :k]  # (N, k), largest first
        rows = xp.arange(N)
        top = getitem(probs, (rows[:, None], picks))
        weights = top / sum(top, axis=1, keepdims=True)               # renormalised
        expert = picks.reshape(-1)                                    # token-major pairs
        order = xp.argsort(expert, kind="stable")                     # by expert, then token
        counts = to_numpy(xp.bincount(expert, minlength=E))
        kept = counts
        if self.capacity is not None:
            cap = math.ceil(self.capacity * N * k / E)
            starts = xp.asarray([0, *accumulate(int(c) for c in counts[:-1])])
            place = xp.arange(order.size) - xp.repeat(starts, xp.asarray(counts))
            order = order[place < cap]                                # earliest tokens first
            kept = counts.clip(max=cap)
        offsets = [0, *accumulate(int(c) for c in kept)]
        token, slot = order // k, order % k
        rows = embedding(token, x)
        y = self.dispatch(self.experts, rows, kept) if self.dispatch is not None else \
            self.experts(rows, offsets)
        y = mul(y, reshape(getitem(weights, (token, slot)), (-1, 1)))
        self.route = Route(counts, kept, sum(balance, axis=0), logits, N)
        out = scatter_rows(y, token, N)
        shared = self._modules.get("shared_expert")
        return out + shared(x) if shared is not None else out


def load_balancing_loss(routes, n_experts: int):
    """``transformers``' Mixtral auxiliary loss over ``routes`` (see [Note: load-balancing
    loss]); ``None`` without routes."""
    if not routes:
        return None
    total_rows = math.fsum(r.rows for r in routes)
    counts = routes[0].counts.astype("float64").copy()
    prob = routes[0].prob_sum
    for r in routes[1:]:
        counts += r.counts
        prob = prob + r.prob_sum
    xp = xp_of(prob.data)
    f = xp.asarray(counts / total_rows, dtype=prob.data.dtype)
    return sum(mul(prob, f)) * (n_experts / total_rows)


def with_router_losses(loss, mlps, config):
    """``loss`` plus ``config.moe_aux_coef`` times :func:`load_balancing_loss` and
    ``config.moe_z_coef`` times :func:`router_z_loss` of the :class:`MoE` modules among
    ``mlps`` (their last forward), each cast to the loss's dtype before its coefficient
    (the router's terms are in the activations' 16 bits under mixed precision, the loss
    in float32; scaled after the cast, their gradient reaches 16 bits as ``coef x`` the
    loss scale, not the whole scale, which float16 cannot hold: 2^16 > 65504)."""
    routes = [m.route for m in mlps if isinstance(m, MoE) and m.route is not None]
    if not routes:
        return loss
    if config.moe_aux_coef:
        aux = load_balancing_loss(routes, routes[0].counts.size).astype(loss.dtype)
        loss = loss + aux * config.moe_aux_coef
    if config.moe_z_coef:
        loss = loss + router_z_loss(routes).astype(loss.dtype) * config.moe_z_coef
    return loss


def is_moe_block(config, i: int) -> bool:
    """Whether block ``i`` of a model with ``config`` (its ``moe_*`` fields) has experts."""
    return config.moe_experts > 0 and (i + 1) % config.moe_every == 0


def check_moe_fields(config) -> None:
    """ValueError naming the field and the fix for ``moe_*`` values that cannot work."""
    name = type(config).__name__
    if config.moe_experts and not 1 <= config.moe_top_k <= config.moe_experts:
        raise ValueError(f"{name}: moe_top_k={config.moe_top_k} must be between 1 and "
                         f"moe_experts={config.moe_experts}")
    if config.moe_every < 1 or config.moe_capacity < 0:
        raise ValueError(f"{name}: moe_every={config.moe_every} must be >= 1 and "
                         f"moe_capacity={config.moe_capacity} >= 0 (0: dropless)")
    if config.moe_experts and config.moe_every > config.n_layer:
        raise ValueError(f"{name}: moe_every={config.moe_every} is above n_layer="
                         f"{config.n_layer}, so no block would have experts; use moe_every "
                         f"<= {config.n_layer}, or moe_experts=0 for a dense model")
    if config.moe_router not in ("softmax", "sigmoid"):
        raise ValueError(f"{name}: moe_router={config.moe_router!r} is not 'softmax' or "
                         f"'sigmoid'")


def check_moe_layout(config, whole: bool) -> None:
    """Refuse the auxiliary losses on a model that is one pipeline stage of several."""
    if config.moe_experts and (config.moe_aux_coef or config.moe_z_coef) and not whole:
        raise ValueError("the mixture-of-experts auxiliary losses span every block; "
                         "pipeline stages cannot compute them yet: use pp=1, or set "
                         "moe_aux_coef and moe_z_coef to 0")


def check_moe_split(config, sizes: AxisSizes) -> list:
    """ValueError naming the fix for a split a model's ``moe_*`` fields cannot take:
    expert parallelism of a dense model or of experts it does not divide, the auxiliary
    losses over pipeline stages or with activation checkpointing; else no notes."""
    if sizes.ep > 1 and not config.moe_experts:
        raise ValueError(f"ep = {sizes.ep}: expert parallelism splits the experts of a "
                         f"mixture of experts, and this model is dense (moe_experts = 0); "
                         f"use ep = 1, or give --moe-experts")
    if config.moe_experts % sizes.ep:
        raise ValueError(f"expert parallelism ep={sizes.ep} does not divide moe_experts = "
                         f"{config.moe_experts}; use an ep that divides {config.moe_experts}")
    check_moe_layout(config, sizes.pp == 1)
    check_moe_checkpointing(config, sizes.activation_checkpointing)
    return []


def check_moe_checkpointing(config, enabled: bool) -> None:
    if enabled and config.moe_experts and (config.moe_aux_coef or config.moe_z_coef):
        raise ValueError("activation checkpointing would recompute the routers outside "
                         "the graph of the mixture-of-experts auxiliary losses; set "
                         "moe_aux_coef and moe_z_coef to 0 to checkpoint")


def router_z_loss(routes):
    """Mean over every routed row of ``logsumexp(logits)^2`` (ST-MoE); ``None`` without routes."""
    if not routes:
        return None
    terms, rows = None, 0
    for r in routes:
        lse = getitem(r.logits - log_softmax(r.logits, axis=-1), (slice(None), 0))
        part = sum(lse * lse)
        terms = part if terms is None else terms + part
        rows += r.rows
    return terms * (1.0 / rows)

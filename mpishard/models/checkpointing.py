"""Activation checkpointing modes: none, a whole block (``full``), attention's core
(``selective``), or a whole block keeping every second matrix product's output
(``op``), as the models' ``set_activation_checkpointing`` takes them.

[Note: selective recomputation]
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", arXiv:2205.05198, section 5) recompute only attention's core: the
scores ``q k^T``, their softmax, its dropout and the product with ``v``. Those are
the activations that grow with ``T x T`` per head (``5 a s^2 b`` bytes of the
paper's ``s b h (34 + 5 a s / h)`` per layer, in 16 bits), and the cheapest to
recompute (no weight matrix products). With ``selective``, each attention
module runs its core through :func:`~mpishard.autodiff.recompute`: forward keeps
the core's input (the packed q/k/v rows; the projection's bias, which the core
adds, is read inside, so its gradient lands in its own buffer as without
recomputation, in float32 for 16-bit rows), not its
``T x T`` weights, and backward runs the core again (the same ops on the same
arrays, the dropout generator set back, so the gradients are bit-identical).
The core has no parameters of its own, so ZeRO-3's gathers and tensor
parallelism's collectives around it are untouched; under context parallelism
the core's exchange of keys and values runs again in backward, in the same order
on every rank. A GPU's fused attention (``MPISHARD_ATTENTION=fused``) keeps no
``T x T`` weights: there ``selective`` recomputes nothing (a Llama's attention too,
which then takes its per-projection path). Llama's one-op path elsewhere (one op from
the block's input through the q/k/v products, rotary embeddings and grouped-query
attention) is recomputed whole, its three weights read inside (their gradients land
in their buffers, their grad-ready hooks fire once): three more products per layer
than the core alone, the same memory saved.

[Note: recomputation by op]
``op`` is torchtitan's selective recomputation by op (its ``selective_ac_option =
"op"``): each block is recomputed as under ``full``, except that the outputs of its
1st, 3rd, 5th, ... matrix products (``linear``, in the order they run: a GPT's
q/k/v product and first MLP product; a Llama's q, v, gate and down projections) are
kept from forward and not multiplied again (see [Note: kept products] in
mpishard/autodiff/recompute.py). A block then keeps its input and those outputs;
backward repeats its norms, activations, attention and the other half of its
products. Gradients are bit-identical. A Llama's attention takes its per-projection
path (its q/k/v products are then ``linear``s of their own). Mixtures of experts with
auxiliary losses refuse it as they refuse ``full``.
"""
from __future__ import annotations

from mpishard.autodiff import recompute
from mpishard.autodiff.tensor import is_grad_enabled
from mpishard.core.backend import xp_of
from mpishard.kernels import fused_attention

__all__ = ["MODES", "checkpointing_mode", "check_op_mode", "attend_core"]

#: what ``set_activation_checkpointing`` (and ``--activation-checkpointing``) takes
MODES = ("none", "full", "selective", "op")


def checkpointing_mode(enabled) -> str:
    """``"none"``, ``"full"``, ``"selective"`` or ``"op"`` from a mode or a bool (True:
    full)."""
    if enabled is True:
        return "full"
    if enabled is False or enabled is None:
        return "none"
    if enabled in MODES:
        return enabled
    raise ValueError(f"activation checkpointing {enabled!r} is not one of "
                     f"{', '.join(MODES)} (or True / False)")


def check_op_mode(config, mode: str) -> None:
    """Refuse ``"op"`` for a mixture of experts: its expert products are not ``linear``s
    (only dense blocks' products are numbered, see [Note: recomputation by op])."""
    if mode == "op" and getattr(config, "moe_experts", 0):
        raise ValueError(f"activation checkpointing 'op' keeps the products of dense blocks; "
                         f"this model has moe_experts = {config.moe_experts}: use 'full' "
                         f"or 'selective'")


def attend_core(attend, qkv, n_head: int, batch_size: int, dropout_p: float = 0.0, rng=None,
                training: bool = True, *, bias=None, selective: bool = False):
    """``attend(qkv, n_head, batch_size, dropout_p, rng, training[, bias=bias])``; with
    ``selective`` (and grad mode on) recomputed in backward instead of keeping its
    ``T x T`` intermediates (see [Note: selective recomputation])."""
    draws = training and dropout_p > 0.0
    extra = {"bias": bias} if bias is not None else {}

    def core(rows):     # the bias is read inside: its gradient goes straight to its buffer
        return attend(rows, n_head, batch_size, dropout_p, rng, training, **extra)
    if not (selective and is_grad_enabled()) or _keeps_no_scores(qkv, n_head, draws):
        return core(qkv)
    return recompute(core, qkv, rngs=[rng] if draws else [])


def _keeps_no_scores(qkv, n_head: int, draws: bool) -> bool:
    """Whether attention on ``qkv`` runs fused (a GPU, no dropout): nothing to recompute."""
    data = getattr(qkv, "data", qkv)
    return fused_attention(xp_of(data), qkv.shape[-1] // (3 * n_head), draws)

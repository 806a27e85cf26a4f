"""Sampling from a causal language model (GPT, Llama): one token at a time.

    out = model.generate(idx, 100, temperature=0.8, top_k=40, rng=np.random.default_rng(0))

Sampling runs on the host with a NumPy generator: each new token reads the last
position's logits back (one ``(B, vocab)`` copy per token, not the whole
``(B, T, vocab)``), so ``idx`` may be a host or a device array; the result is
a host array.
"""
from __future__ import annotations

import numpy as np

from mpishard.autodiff.tensor import no_grad
from mpishard.core.backend import to_numpy

__all__ = ["generate"]


@no_grad()
def generate(model, idx, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, rng=None):
    """Extend ``idx`` ``(B, T)`` by sampling ``max_new_tokens`` tokens (whole models only):
    from the softmax of the logits over ``temperature`` (0: the most likely token each
    time, greedy), among the ``top_k`` most likely (``None`` or 0: all)."""
    if not (model.first_stage and model.last_stage):
        raise ValueError("generate() needs the whole model, not a pipeline stage")
    if not temperature >= 0:
        raise ValueError(f"temperature {temperature} must be >= 0 (0: greedy)")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k {top_k} must be >= 0 (0: all tokens)")
    rng = rng or np.random.default_rng(0)
    was_training = model.training
    model.eval()
    idx = np.asarray(to_numpy(idx))
    for _ in range(max_new_tokens):
        context = idx[:, -model.config.block_size:]
        logits, _ = model(model.backend.asarray(context))
        last = to_numpy(logits.data[:, -1, :]).astype(np.float64)
        if temperature == 0:
            idx = np.concatenate([idx, last.argmax(axis=-1)[:, None]], axis=1)
            continue
        last = last / temperature
        if top_k:
            kth = np.sort(last, axis=-1)[:, -min(top_k, last.shape[-1])][:, None]
            last = np.where(last < kth, -np.inf, last)
        probs = np.exp(last - last.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        nxt = np.array([rng.choice(len(p), p=p) for p in probs])[:, None]
        idx = np.concatenate([idx, nxt], axis=1)
    model.train(was_training)
    return idx

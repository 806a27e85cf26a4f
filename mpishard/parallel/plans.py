"""Reading a model's parallel plan on any axis: the modules a pattern names, a rank's share.

A plan names modules by dotted patterns (``transformer.h.*.attn``, see [Note:
parallel plans] in mpishard/nn/sharding.py); tensor, context and expert
parallelism, and the planner, find them with :func:`matching_modules`. Whatever
an axis splits into contiguous runs (heads, vocabulary rows, experts) it splits
with :func:`split_range`.
"""
from __future__ import annotations

__all__ = ["matching_modules", "split_range"]


def split_range(n: int, parts: int, index: int) -> tuple:
    """``(start, stop)`` of part ``index`` when ``n`` items go to ``parts`` ranks
    (the first ``n % parts`` ranks get one more)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def matching_modules(model, pattern: str) -> list:
    """``(path, module)`` of every module whose dotted path matches ``pattern``
    (``*`` matches one path component)."""
    cache = model.structure_cache("matching")
    if pattern not in cache:
        want = pattern.split(".")
        cache[pattern] = [(path, m) for path, m in model.named_modules()
                          if path and len(path.split(".")) == len(want)
                          and all(w in ("*", p) for w, p in zip(want, path.split(".")))]
    return cache[pattern]

"""The order in which a pipeline rank runs its forwards and backwards: GPipe, 1F1B, interleaved.

    order = schedule_order("interleaved", stages=2, stage=0, micro_batches=4, chunks=2)
    # [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1), ("F", 0, 2), ("B", 1, 0), ...]

Each entry is ``(kind, chunk, micro_batch)``: ``"F"`` a forward, ``"B"`` a
backward of that micro-batch through this rank's model chunk ``chunk`` (always
0 without interleaving). :class:`~mpishard.parallel.pipeline.schedule.Pipeline`
runs the list as it stands and the planner replays it to count the activations
alive at once (:func:`peak_in_flight`), so the two cannot disagree.

[Note: interleaved order]
Interleaved 1F1B (Narayanan et al. 2021, arXiv:2104.04473, Section 2.2; the
order of Megatron-Core's ``forward_backward_pipelining_with_interleaving``):
with ``p`` ranks and ``V`` chunks per rank the model is cut into ``p V``
stages and rank ``r`` holds stages ``r, r + p, ..., r + (V - 1) p`` (chunk
``c`` is stage ``r + c p``). Each rank runs ``V m`` virtual micro-batches;
virtual forward ``k`` is chunk ``(k mod p V) // p`` of micro-batch
``(k // p V) p + k mod p``: groups of ``p`` micro-batches go through chunk 0,
then the same ``p`` through chunk 1, and so on, which is why ``m`` must be a
multiple of ``p``. Virtual backward ``k`` takes the chunks in reverse
(``V - 1 - (k mod p V) // p``). Rank ``r`` first runs ``2 (p - r - 1) +
(V - 1) p`` warm-up forwards (at most ``V m``), then alternates one forward and
one backward, then drains the remaining backwards. Every message a rank waits
for is sent earlier in its neighbour's order (sends never wait), so the
schedule cannot deadlock; the bubble falls from ``(p - 1) / m`` of the busy
time to ``(p - 1) / (V m)``, at the price of ``V`` times the point-to-point
messages and more micro-batches in flight during warm-up.
"""
from __future__ import annotations

__all__ = ["SCHEDULES", "schedule_order", "warmup_forwards", "peak_in_flight", "message_tag"]

#: the pipeline schedules :func:`schedule_order` knows
SCHEDULES = ("1f1b", "gpipe", "interleaved")


def warmup_forwards(schedule: str, stages: int, stage: int, micro_batches: int,
                    chunks: int = 1) -> int:
    """Forwards rank ``stage`` runs before its first backward (its warm-up).

    GPipe: all ``m``; 1F1B: ``p - s - 1``; interleaved: ``2 (p - s - 1) + (V - 1) p``
    (see [Note: interleaved order]); never more than the ``V m`` it has.
    """
    total = micro_batches * chunks
    if schedule == "gpipe":
        return total
    if schedule == "1f1b":
        return min(stages - stage - 1, total)
    return min(2 * (stages - stage - 1) + (chunks - 1) * stages, total)


def _interleaved(kind: str, k: int, stages: int, chunks: int) -> tuple:
    """Virtual micro-batch ``k`` of the interleaved order as ``(kind, chunk, micro_batch)``."""
    group, within = divmod(k, stages * chunks)
    chunk = within // stages
    if kind == "B":
        chunk = chunks - 1 - chunk
    return kind, chunk, group * stages + within % stages


def schedule_order(schedule: str, stages: int, stage: int, micro_batches: int,
                   chunks: int = 1) -> list:
    """Rank ``stage``'s forwards and backwards, in order, as ``(kind, chunk, micro_batch)``.

    Args:
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``.
        stages: pipeline ranks ``p``.
        stage: this rank's place ``s`` among them.
        micro_batches: ``m`` (a multiple of ``p`` for ``"interleaved"``).
        chunks: model chunks per rank ``V`` (only ``"interleaved"`` takes more than 1).

    Raises:
        ValueError: an unknown schedule, chunks without interleaving, or an
            interleaved ``m`` that is not a multiple of ``p``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; use one of "
                         f"{', '.join(SCHEDULES)}")
    if chunks != 1 and schedule != "interleaved":
        raise ValueError(f"{chunks} model chunks per rank need the 'interleaved' schedule, "
                         f"not {schedule!r}")
    m = micro_batches
    if schedule == "interleaved" and m % stages:
        raise ValueError(f"the interleaved schedule sends micro-batches round the pipeline "
                         f"in groups of pp = {stages}; micro_batches = {m} is not a multiple "
                         f"of {stages}")
    warmup = warmup_forwards(schedule, stages, stage, m, chunks)
    total = m * chunks
    if schedule == "interleaved":
        forward = [_interleaved("F", k, stages, chunks) for k in range(total)]
        backward = [_interleaved("B", k, stages, chunks) for k in range(total)]
    else:
        forward = [("F", 0, i) for i in range(m)]
        backward = [("B", 0, i) for i in range(m)]
    order = forward[:warmup]
    for k in range(total - warmup):     # the steady state: one forward, one backward
        order += [forward[warmup + k], backward[k]]
    return order + backward[total - warmup:]


def peak_in_flight(order, chunk_bytes) -> int:
    """The most activation bytes ``order`` keeps at once: a forward of chunk ``c`` keeps
    ``chunk_bytes[c]`` until its backward starts (as the pipeline measures them)."""
    alive = peak = 0
    for kind, chunk, _ in order:
        alive += chunk_bytes[chunk] if kind == "F" else -chunk_bytes[chunk]
        peak = max(peak, alive)
    return peak


def message_tag(stage: int, chunk: int, micro_batch: int, micro_batches: int, gradient: bool,
                before: bool) -> int:
    """The tag of micro-batch ``i``'s activations (or, ``gradient``, their gradients) across
    the boundary before (``before``) or after chunk ``c`` of rank ``stage``.

    ``2 (k m + i) + gradient`` with ``k`` the chunk, on its rank, of the stage in
    front of the boundary (chunk ``c - 1`` of the last rank for the boundary before
    chunk ``c`` of rank 0): unique per (boundary, micro-batch, direction) between two
    ranks, also when ``pp = 2`` sends both ways between the same two. Without
    interleaving it is ``2 i`` and ``2 i + 1``.
    """
    lower = chunk - 1 if before and stage == 0 else chunk
    return 2 * (lower * micro_batches + micro_batch) + int(gradient)

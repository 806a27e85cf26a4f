"""Agreeing over ranks without pickle: JSON bytes through the buffer all-gather.

[Note: checkpoint agreement]
Every step of a save or load that can fail on some ranks only (a full disk, a
missing file, a damaged shard) ends in :func:`agree`: each rank contributes
``None`` or its error, every rank receives the whole failure map, and if it is
not empty every rank raises the same :class:`CheckpointError` -- nobody is
left waiting in a collective (see STYLE.md, anti-pattern 4). The messages
travel as UTF-8 JSON in uint8 buffers through ``Communicator.all_gather``
(mpi4py's buffer API), so nothing on a checkpoint path is ever unpickled.
"""
from __future__ import annotations

import json

import numpy as np

from .errors import CheckpointError

__all__ = ["exchange_json", "agree", "error_record"]


def exchange_json(comm, value) -> list:
    """Every rank's JSON-able ``value``, as a list indexed by rank, on every rank."""
    data = np.frombuffer(json.dumps(value).encode("utf-8"), dtype=np.uint8)
    if comm.size == 1:
        return [value]
    lengths = np.empty(comm.size, dtype=np.int64)
    comm.all_gather(np.array([data.size], dtype=np.int64), lengths)
    width = int(lengths.max())
    send = np.zeros(width, dtype=np.uint8)
    send[:data.size] = data
    recv = np.empty(width * comm.size, dtype=np.uint8)
    comm.all_gather(send, recv)
    return [json.loads(recv[r * width:r * width + int(n)].tobytes().decode("utf-8"))
            for r, n in enumerate(lengths)]


def _ranks(ranks: list) -> str:
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2, 5"``."""
    spans: list = []
    for rank in ranks:
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)
    return ("ranks " if len(ranks) > 1 else "rank ") + text


def error_record(err: BaseException | None):
    """A JSON description of a local failure (``None`` for success)."""
    if err is None:
        return None
    if isinstance(err, CheckpointError):
        return {"path": err.path, "rule": err.rule, "detail": err.detail}
    return {"path": "", "rule": type(err).__name__, "detail": str(err)}


def agree(comm, err: BaseException | None, what: str, payload=None) -> list:
    """Share every rank's outcome; raise the same CheckpointError everywhere if any failed.

    Args:
        comm: the communicator of every rank taking part.
        err: this rank's exception, or ``None``.
        what: what was being done, for the message (``"writing step-40"``).
        payload: JSON-able data to share on success.

    Returns:
        Every rank's ``payload``, indexed by rank.

    Raises:
        CheckpointError: with ``failures`` ``{rank: "path: rule: detail"}``; its
            ``path`` and ``rule`` are those of the lowest failing rank.
    """
    outcomes = exchange_json(comm, {"error": error_record(err), "payload": payload})
    failed = {rank: o["error"] for rank, o in enumerate(outcomes) if o["error"] is not None}
    if not failed:
        return [o["payload"] for o in outcomes]
    texts = {rank: (f"{e['path']}: " if e["path"] else "") + f"{e['rule']}: {e['detail']}"
             for rank, e in failed.items()}
    first = failed[min(failed)]
    by_text: dict = {}
    for rank, text in sorted(texts.items()):
        by_text.setdefault(text, []).append(rank)
    listing = "; ".join(f"{_ranks(ranks)}: {text}" for text, ranks in by_text.items())
    summary = (f"{what} failed on {len(failed)} of {comm.size} ranks: {listing}"
               if comm.size > 1 else f"{what} failed: {listing}")
    error = CheckpointError(first["path"], first["rule"], summary, texts)
    error.args = (summary,)
    if err is not None:
        raise error from err
    raise error

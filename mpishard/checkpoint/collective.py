"""Checkpoint failures agreed over ranks, as one :class:`CheckpointError` everywhere.

[Note: checkpoint agreement]
Every step of a save or load that can fail on some ranks only (a full disk, a
missing file, a damaged shard) ends in :func:`agree`, the checkpoint form of
:func:`mpishard.comm.agree` (see [Note: agreed errors] there): every rank
receives the whole failure map, and if it is not empty every rank raises the
same :class:`CheckpointError`, naming each failing rank, so nobody is left
waiting in a collective. Nothing on a checkpoint path is ever unpickled.
"""
from __future__ import annotations

from mpishard.core.agree import agree as agree_over, exchange_json
from mpishard.checkpoint.errors import CheckpointError

__all__ = ["exchange_json", "agree", "error_record"]


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
    def rebuild(failed: dict, size: int) -> CheckpointError:
        texts = {rank: (f"{e['path']}: " if e["path"] else "") + f"{e['rule']}: {e['detail']}"
                 for rank, e in failed.items()}
        first = failed[min(failed)]
        by_text: dict = {}
        for rank, text in sorted(texts.items()):
            by_text.setdefault(text, []).append(rank)
        listing = "; ".join(f"{_ranks(ranks)}: {text}" for text, ranks in by_text.items())
        summary = (f"{what} failed on {len(failed)} of {size} ranks: {listing}"
                   if size > 1 else f"{what} failed: {listing}")
        error = CheckpointError(first["path"], first["rule"], summary, texts)
        error.args = (summary,)
        return error
    return agree_over(comm, err, payload, describe=error_record, rebuild=rebuild)

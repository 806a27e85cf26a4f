"""One error on every rank: local work first, then one exchange of outcomes.

It takes any :class:`~mpishard.comm.Communicator` and imports no MPI itself, so
the checkpoint tools can use it without initialising MPI on import.

[Note: agreed errors]
Work that can fail on some ranks only (reading a data file, validating a
layout, writing a checkpoint shard) must not leave the other ranks waiting in
their next collective. So such work runs locally, without communicating, and
ends in :func:`agree`: each rank contributes ``None`` or a description of its
failure, every rank receives all of them, and if any rank failed every rank
raises the same exception (built by ``rebuild`` from the failure map). The
outcomes travel as UTF-8 JSON in uint8 buffers through
``Communicator.all_gather`` (mpi4py's buffer API), so nothing is unpickled:
checkpoints and ``mpishard train`` use this.
"""
from __future__ import annotations

import json
from typing import Callable

import numpy as np

__all__ = ["agree", "exchange_json", "describe_error", "rebuild_same_type"]


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


def describe_error(err: BaseException) -> dict:
    """The default JSON description of a failure: its type name and message."""
    return {"type": type(err).__name__, "message": str(err)}


def rebuild_same_type(*types: type, name_the_rank: bool = True
                      ) -> Callable[[dict, int], BaseException]:
    """A ``rebuild`` that raises the lowest failing rank's error again, as its own
    type when it is one of ``types`` (else ``RuntimeError``), naming that rank
    when not every rank failed (unless ``name_the_rank`` is false: work only one
    rank does)."""
    by_name = {t.__name__: t for t in types}

    def rebuild(failures: dict, size: int) -> BaseException:
        rank = min(failures)
        record = failures[rank]
        text = record["message"]
        if len(failures) < size and name_the_rank:
            text = f"on rank {rank}: {text}"
        return by_name.get(record["type"], RuntimeError)(text)
    return rebuild


def agree(comm, error: BaseException | None, payload=None, *,
          describe: Callable[[BaseException], dict] = describe_error,
          rebuild: Callable[[dict, int], BaseException] | None = None) -> list:
    """Share every rank's outcome; raise the same error on every rank if any failed.

    Collective over ``comm``. See [Note: agreed errors].

    Args:
        comm: the communicator of every rank taking part.
        error: this rank's exception, or ``None``.
        payload: JSON-able data to share on success.
        describe: turns this rank's exception into a JSON-able dict.
        rebuild: ``(failures {rank: description}, comm size) -> exception``
            (default: the lowest failing rank's message as a ``RuntimeError``).

    Returns:
        Every rank's ``payload``, indexed by rank.
    """
    outcomes = exchange_json(comm, {"error": None if error is None else describe(error),
                                    "payload": payload})
    failures = {rank: o["error"] for rank, o in enumerate(outcomes) if o["error"] is not None}
    if not failures:
        return [o["payload"] for o in outcomes]
    exc = (rebuild or rebuild_same_type())(failures, comm.size)
    if error is not None:
        raise exc from error
    raise exc

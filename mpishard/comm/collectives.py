"""The array collectives, each one its argument checks plus one :class:`Collective`.

A builder checks its arguments (:mod:`~mpishard.comm.checks`: local and cheap,
so misuse that is the same on every rank raises on every rank before any
message) and describes the call; :class:`~mpishard.comm.runner.Runner` runs
it on the communicator's backend ([Note: one collective runner]). A new
collective is one builder here, one method in every backend
(:class:`~mpishard.comm.backends.base.CollectiveBackend`) and its public
method on :class:`~mpishard.comm.Communicator`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from mpishard.comm import checks

__all__ = ["Collective", "all_reduce", "reduce_scatter", "all_gather", "broadcast",
           "all_to_all", "all_to_all_v"]


@dataclass(slots=True)
class Collective:
    """One checked array collective.

    Attributes:
        kind: its name in the statistics (``"all_reduce"``; ``"i" + kind``
            names the non-blocking form).
        nbytes: the message size for the statistics (see [Note: bus bytes]).
        result: what the call (or ``Handle.wait``) returns.
        arrays: the arrays it reads and writes, kept alive until it completes;
            the backend checks the first one's dtype.
        issue: ``(backend, blocking) -> Pending``: the call on a backend.
        shape, dtype, detail: what the call history and debug fingerprints show.
    """

    kind: str
    nbytes: int
    result: object
    arrays: tuple
    issue: Callable
    shape: tuple | None = None
    dtype: object = None
    detail: str = ""


def all_reduce(buf, op: str, where: str) -> Collective:
    checks.check_array(buf, where, "buf", output=True)
    checks.check_reduction(buf, op, where)
    return Collective("all_reduce", buf.nbytes, buf, (buf,),
                      lambda backend, blocking: backend.all_reduce(buf, op, blocking=blocking),
                      buf.shape, buf.dtype, f"op={op}")


def reduce_scatter(send, recv, op: str, size: int, where: str) -> Collective:
    checks.check_array(send, where, "send")
    checks.check_reduction(send, op, where)
    recv = checks.reduce_scatter_recv(send, recv, size, where)
    return Collective("reduce_scatter", send.nbytes, recv, (send, recv),
                      lambda backend, blocking: backend.reduce_scatter(send, recv, op,
                                                                       blocking=blocking),
                      send.shape, send.dtype, f"op={op}")


def all_gather(send, recv, size: int, rank: int, where: str) -> Collective:
    checks.check_array(send, where, "send")
    recv, in_place = checks.all_gather_recv(send, recv, size, rank, where)
    return Collective("all_gather", recv.nbytes, recv, (recv, send),
                      lambda backend, blocking: backend.all_gather(send, recv, in_place=in_place,
                                                                   blocking=blocking),
                      send.shape, send.dtype)


def broadcast(buf, root: int, size: int, where: str) -> Collective:
    checks.check_array(buf, where, "buf", output=True)
    root = checks.check_root(root, size, where)
    return Collective("broadcast", buf.nbytes, buf, (buf,),
                      lambda backend, blocking: backend.broadcast(buf, root, blocking=blocking),
                      buf.shape, buf.dtype, f"root={root}")


def all_to_all(send, recv, size: int, where: str) -> Collective:
    checks.check_array(send, where, "send")
    recv = checks.all_to_all_recv(send, recv, size, where)
    return Collective("all_to_all", send.nbytes, recv, (send, recv),
                      lambda backend, blocking: backend.all_to_all(send, recv, blocking=blocking),
                      send.shape, send.dtype)


def all_to_all_v(send, send_counts, recv_counts, recv, size: int, rank: int,
                 where: str) -> Collective:
    checks.check_array(send, where, "send")
    send_counts, recv_counts, recv = checks.all_to_all_v_counts(send, send_counts, recv,
                                                                recv_counts, size, where)
    # the rows that leave this rank (see [Note: bus bytes]); the row count differs
    # between ranks, so the call history compares the trailing shape only
    row_bytes = int(np.prod(send.shape[1:], dtype=np.int64)) * send.itemsize
    leaving = (sum(send_counts) - send_counts[rank]) * row_bytes
    return Collective("all_to_all_v", leaving, recv, (send, recv),
                      lambda backend, blocking: backend.all_to_all_v(
                          send, send_counts, recv, recv_counts, blocking=blocking),
                      tuple(send.shape[1:]), send.dtype)

"""What every communicator of one rank runs on: nothing leaves the rank.

Not a choice in the registry: a group of one rank (``COMM_SELF``, a mesh axis
of size 1) takes its collectives here whatever ``comm_backend`` says, so they
cost no MPI or NCCL call and return completed. The dtype check is the chosen
backend's, so one rank refuses what a larger group would.
"""
from __future__ import annotations

from mpishard.comm.backends.base import DONE, CollectiveBackend, Pending

__all__ = ["OneRank"]


class OneRank(CollectiveBackend):
    """The collectives of a group of one rank, as local copies.

    Args:
        backend: the backend the communicator chose (its dtype check, and a
            receive from ``MPI.ANY_SOURCE``).
    """

    name = "one rank"
    how = "a group of one rank: nothing leaves it"

    def __init__(self, backend: CollectiveBackend):
        self.backend = backend

    @property
    def takes_device_arrays(self) -> tuple[bool, str]:
        return True, "device arrays are copied where they are"

    def check_dtype(self, a, where: str) -> None:
        self.backend.check_dtype(a, where)

    def all_reduce(self, buf, op: str, *, blocking: bool) -> Pending:
        return DONE  # the sum, average and maximum of one array are the array

    def reduce_scatter(self, send, recv, op: str, *, blocking: bool) -> Pending:
        recv.reshape(-1)[...] = send.reshape(-1)
        return DONE

    def all_gather(self, send, recv, *, in_place: bool, blocking: bool) -> Pending:
        if not in_place:
            recv.reshape(-1)[...] = send.reshape(-1)
        return DONE

    def broadcast(self, buf, root: int, *, blocking: bool) -> Pending:
        return DONE

    def all_to_all(self, send, recv, *, blocking: bool) -> Pending:
        recv.reshape(-1)[...] = send.reshape(-1)
        return DONE

    def all_to_all_v(self, send, send_rows: list, recv, recv_rows: list, *,
                     blocking: bool) -> Pending:
        recv[...] = send
        return DONE

    # a peer must be another rank, so only a receive from MPI.ANY_SOURCE gets here
    def isend(self, buf, dest: int, tag: int) -> Pending:
        return self.backend.isend(buf, dest, tag)

    def irecv(self, buf, source: int, tag: int) -> Pending:
        return self.backend.irecv(buf, source, tag)

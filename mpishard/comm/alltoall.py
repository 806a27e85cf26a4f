"""All-to-all collectives: equal blocks (context parallelism) and row counts (experts).

Mixed into :class:`~mpishard.comm.Communicator`; each is its checks plus one
:class:`~mpishard.comm.runner.Call` (see [Note: one collective runner] in
communicator.py).
"""
from __future__ import annotations

import numpy as np

from mpishard.comm import checks
from mpishard.comm.handles import Handle
from mpishard.comm.runner import Call

__all__ = ["AllToAll"]


class AllToAll:
    """The all-to-all family of :class:`~mpishard.comm.Communicator` (uses its
    ``_run``, ``_checked``, ``size`` and ``rank``)."""

    def all_to_all(self, send, recv=None):
        """Rank ``r`` sends block ``j`` of ``send`` to rank ``j``, receiving into block ``r``.

        Both buffers hold ``size`` equal blocks along the flattened array;
        afterwards block ``j`` of ``recv`` on rank ``r`` is block ``r`` of rank
        ``j``'s ``send`` (MPI_Alltoall). This is how context and expert
        parallelism exchange a sequence or the tokens routed to each expert. It
        runs through MPI (CUDA-aware or staged) also with ``comm_backend="nccl"``.

        Args:
            send: a C-contiguous array whose size is a multiple of ``size``.
            recv: an array of the same size and dtype, not overlapping
                ``send``, or ``None`` to allocate one shaped like ``send``.

        Returns:
            ``recv``.
        """
        return self._run(self._all_to_all(send, recv, "all_to_all"), blocking=True)

    def iall_to_all(self, send, recv=None) -> Handle:
        """Non-blocking :meth:`all_to_all`; ``handle.wait()`` returns ``recv``."""
        return self._run(self._all_to_all(send, recv, "iall_to_all"), blocking=False)

    def _all_to_all(self, send, recv, where) -> Call:
        def check():
            checks.check_array(send, where, "send")
            return checks.all_to_all_recv(send, recv, self.size, where)
        recv = self._checked(where, check)

        def local():
            recv.reshape(-1)[...] = send.reshape(-1)
        return Call("all_to_all", "all_to_all", send.nbytes, recv,
                    ((send, True, False), (recv, False, True)), ("Alltoall", "Ialltoall"),
                    lambda v, _: (v[0], v[1]), send.shape, send.dtype, local=local)

    def all_to_all_v(self, send, send_counts, recv_counts=None, recv=None):
        """Rank ``r`` sends ``send_counts[j]`` rows of ``send`` to rank ``j`` (MPI_Alltoallv).

        ``send``'s rows are grouped by destination (those for rank 0 first);
        afterwards ``recv`` holds the rows from rank 0, then from rank 1, ...
        Counts may be zero (nothing to some rank, or everything to one). This is
        how expert parallelism sends each token to the ranks holding its experts
        and back. It runs through MPI (CUDA-aware or staged) also with
        ``comm_backend="nccl"``.

        Args:
            send: a C-contiguous array of ``sum(send_counts)`` rows.
            send_counts: rows for each rank (``size`` integers).
            recv_counts: rows from each rank, or ``None`` to exchange the counts
                first (one small :meth:`all_to_all` of integers).
            recv: ``sum(recv_counts)`` rows shaped like ``send``'s, or ``None``.

        Returns:
            ``recv``.
        """
        if recv_counts is None:
            recv_counts = self.exchange_counts(send_counts)
        return self._run(self._all_to_all_v(send, send_counts, recv_counts, recv,
                                            "all_to_all_v"), blocking=True)

    def exchange_counts(self, send_counts) -> list:
        """What each rank will send this one: an all-to-all of one integer per rank."""
        counts = np.asarray([int(c) for c in send_counts], dtype=np.int64)
        if counts.size != self.size:
            raise ValueError(f"exchange_counts: {counts.size} counts for {self.size} ranks; "
                             f"pass one per rank")
        return self.all_to_all(counts).tolist()

    def _all_to_all_v(self, send, send_counts, recv_counts, recv, where) -> Call:
        def check():
            checks.check_array(send, where, "send")
            return checks.all_to_all_v_counts(send, send_counts, recv, recv_counts,
                                              self.size, where)
        send_counts, recv_counts, recv = self._checked(where, check)
        row = int(np.prod(send.shape[1:], dtype=np.int64))

        def spec(counts):
            n = [c * row for c in counts]
            return n, [sum(n[:j]) for j in range(len(n))]
        (sc, sd), (rc, rd) = spec(send_counts), spec(recv_counts)

        def local():
            recv[...] = send
        # the rows that leave this rank (see [Note: bus bytes]); the row count differs
        # between ranks, so the call history compares the trailing shape only
        leaving = (sum(sc) - sc[self.rank]) * send.itemsize
        return Call("all_to_all_v", "all_to_all_v", leaving, recv,
                    ((send, True, False), (recv, False, True)), ("Alltoallv", "Ialltoallv"),
                    lambda v, _: ([v[0], (sc, sd)], [v[1], (rc, rd)]), tuple(send.shape[1:]),
                    send.dtype, local=local)

"""Point-to-point messages and small pickled objects: the Communicator methods
that do not go through the array runner (see [Note: one collective runner]).

Point-to-point calls are not fingerprinted (the two sides legitimately
differ) and always use MPI, also with ``comm_backend="nccl"`` (float16 and
bfloat16 as uint16, see [Note: 16-bit floats on MPI]). The ``*_obj``
forms pickle small Python values (metadata, never arrays on a hot path).
"""
from __future__ import annotations

from mpishard.comm import checks
from mpishard.comm.handles import Handle

__all__ = ["Messages"]


class Messages:
    """Mixed into :class:`~mpishard.comm.Communicator` (uses its ``mpi``,
    ``size``, ``rank``, ``_calls``, ``_for_mpi`` and ``_finish``)."""

    # -- point to point ----------------------------------------------------
    def send(self, buf, dest: int, tag: int = 0) -> None:
        """Send ``buf`` to rank ``dest`` (blocking)."""
        self.isend(buf, dest, tag).wait()

    def recv(self, buf, source: int, tag: int = 0):
        """Receive into ``buf`` from rank ``source`` (blocking); returns ``buf``."""
        return self.irecv(buf, source, tag).wait()

    def isend(self, buf, dest: int, tag: int = 0) -> Handle:
        """Non-blocking :meth:`send`; ``handle.wait()`` returns ``buf``."""
        checks.check_array(buf, "send", "buf")
        checks.check_wire_dtype(buf, "send")
        dest = checks.check_peer(dest, self.size, self.rank, "send")
        entry = self._calls.begin(f"send->{dest}", buf.shape, buf.dtype, f"tag={tag}",
                                  p2p=True, nonblocking=True)
        view, _ = self._for_mpi(buf, copy_in=True, copy_out=False)
        request = self.mpi.Isend(view, dest, tag)
        return self._finish(entry, "send", buf.nbytes, buf, request, keep=(view,),
                            blocking=False)

    def irecv(self, buf, source: int, tag: int = 0) -> Handle:
        """Non-blocking :meth:`recv`; ``handle.wait()`` returns ``buf``."""
        checks.check_array(buf, "recv", "buf", output=True)
        checks.check_wire_dtype(buf, "recv")
        source = checks.check_peer(source, self.size, self.rank, "recv", any_ok=True)
        entry = self._calls.begin(f"recv<-{source}", buf.shape, buf.dtype, f"tag={tag}",
                                  p2p=True, nonblocking=True)
        view, copy_back = self._for_mpi(buf, copy_in=False, copy_out=True)
        request = self.mpi.Irecv(view, source, tag)
        return self._finish(entry, "recv", buf.nbytes, buf, request, after=(copy_back,),
                            keep=(view,), blocking=False)

    # -- small Python objects (pickled) -------------------------------------
    def _obj(self, op: str, detail: str, run, local):
        entry = self._calls.begin(op, None, None, detail)
        try:
            return local() if self.size == 1 else run()
        finally:
            self._calls.end(entry, op, 0)

    def all_reduce_obj(self, obj, op: str = "sum"):
        """Reduce a small Python value over all ranks (``sum``, ``prod``,
        ``max``, ``min``, ``and``, ``or``); every rank gets the result."""
        if op not in checks.OBJ_OPS:
            self._calls.reject("all_reduce_obj", ValueError(
                f"all_reduce_obj: unknown op {op!r}; use one of {sorted(checks.OBJ_OPS)}"))
        return self._obj("all_reduce_obj", f"op={op}",
                         lambda: self.mpi.allreduce(obj, checks.OBJ_OPS[op]), lambda: obj)

    def all_gather_obj(self, obj) -> list:
        """Every rank's ``obj``, as a list indexed by rank, on every rank."""
        return self._obj("all_gather_obj", "", lambda: self.mpi.allgather(obj),
                         lambda: [obj])

    def broadcast_obj(self, obj, root: int = 0):
        """``root``'s ``obj`` on every rank."""
        try:
            root = checks.check_root(root, self.size, "broadcast_obj")
        except ValueError as exc:
            self._calls.reject("broadcast_obj", exc)
        return self._obj("broadcast_obj", f"root={root}",
                         lambda: self.mpi.bcast(obj, root), lambda: obj)

    def gather_obj(self, obj, root: int = 0):
        """Every rank's ``obj`` as a list on ``root``; ``None`` elsewhere."""
        try:
            root = checks.check_root(root, self.size, "gather_obj")
        except ValueError as exc:
            self._calls.reject("gather_obj", exc)
        return self._obj("gather_obj", f"root={root}",
                         lambda: self.mpi.gather(obj, root), lambda: [obj])

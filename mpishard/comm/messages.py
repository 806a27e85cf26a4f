"""Point-to-point messages and small pickled objects, as functions over a
communicator's parts (its :class:`~mpishard.comm.runner.Runner`, or its call log
and mpi4py communicator).

Point-to-point calls are not fingerprinted (the two sides legitimately
differ) and always use MPI, also with ``comm_backend="nccl"`` (float16 and
bfloat16 as uint16, see [Note: 16-bit floats on MPI]). The ``*_obj`` forms
pickle small Python values (metadata, never arrays on a hot path) through
mpi4py's lower-case API, never a backend.
"""
from __future__ import annotations

from mpishard.comm import checks
from mpishard.comm.debug import CallLog
from mpishard.comm.handles import Handle
from mpishard.comm.runner import Runner

__all__ = ["isend", "irecv", "all_reduce_obj", "all_gather_obj", "broadcast_obj",
           "gather_obj"]


# -- point to point ------------------------------------------------------------
def isend(runner: Runner, buf, dest: int, tag: int) -> Handle:
    checks.check_array(buf, "send", "buf")
    runner.backend.check_dtype(buf, "send")
    dest = checks.check_peer(dest, runner.size, runner.rank, "send")
    return runner.message(f"send->{dest}", "send", buf, f"tag={tag}",
                          lambda backend: backend.isend(buf, dest, tag))


def irecv(runner: Runner, buf, source: int, tag: int) -> Handle:
    checks.check_array(buf, "recv", "buf", output=True)
    runner.backend.check_dtype(buf, "recv")
    source = checks.check_peer(source, runner.size, runner.rank, "recv", any_ok=True)
    return runner.message(f"recv<-{source}", "recv", buf, f"tag={tag}",
                          lambda backend: backend.irecv(buf, source, tag))


# -- small Python objects (pickled) ----------------------------------------------
def _obj(calls: CallLog, op: str, detail: str, run, local):
    entry = calls.begin(op, None, None, detail)
    try:
        return local() if calls.size == 1 else run()
    finally:
        calls.end(entry, op, 0)


def all_reduce_obj(calls: CallLog, mpi_comm, obj, op: str):
    if op not in checks.OBJ_OPS:
        calls.reject("all_reduce_obj", ValueError(
            f"all_reduce_obj: unknown op {op!r}; use one of {sorted(checks.OBJ_OPS)}"))
    return _obj(calls, "all_reduce_obj", f"op={op}",
                lambda: mpi_comm.allreduce(obj, checks.OBJ_OPS[op]), lambda: obj)


def all_gather_obj(calls: CallLog, mpi_comm, obj) -> list:
    return _obj(calls, "all_gather_obj", "", lambda: mpi_comm.allgather(obj), lambda: [obj])


def broadcast_obj(calls: CallLog, mpi_comm, obj, root: int):
    root = _checked_root(calls, root, "broadcast_obj")
    return _obj(calls, "broadcast_obj", f"root={root}", lambda: mpi_comm.bcast(obj, root),
                lambda: obj)


def gather_obj(calls: CallLog, mpi_comm, obj, root: int):
    root = _checked_root(calls, root, "gather_obj")
    return _obj(calls, "gather_obj", f"root={root}", lambda: mpi_comm.gather(obj, root),
                lambda: [obj])


def _checked_root(calls: CallLog, root, where: str) -> int:
    try:
        return checks.check_root(root, calls.size, where)
    except ValueError as exc:
        calls.reject(where, exc)

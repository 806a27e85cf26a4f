"""Argument checks for the array collectives, run before any MPI call.

Every check here is local and cheap (flags, sizes, dtypes; no communication).
Misuse that is the same on every rank (a wrong op, a size that does not divide)
therefore raises on every rank before anything could hang. Misuse that differs
between ranks is caught collectively in debug mode: see
[Note: collective order] in :mod:`mpishard.comm.debug`.

[Note: contiguous buffers]
Array collectives take C-contiguous NumPy or CuPy arrays and reject anything
else with a ValueError that says how to fix it. They never copy behind the
caller's back: a hidden copy of an output buffer would have to be copied back
(surprising, and two extra passes over memory), and a hidden copy of an input
is the kind of cost that disappears from profiles. ``xp.ascontiguousarray(a)``
is the fix the error names.

[Note: 16-bit floats on MPI]
Many MPI builds have no float16 datatype (mpi4py's ``'e'`` typecode maps to
``MPIX_C_FLOAT16`` only where the library defines it; Open MPI does not), and
none has bfloat16. So on the MPI path gathers, broadcasts, all-to-all and
point-to-point move both as uint16 (the same bytes, :func:`wire_view`), and
reductions of either run in float32 (:func:`widened`: a float32 copy goes to
MPI and the result is rounded back once, so sums are the correctly rounded
16-bit value of the float32 sum). Whether MPI has a datatype is asked only on
the MPI path (:func:`check_wire_dtype`), so NCCL, which has float16 and
bfloat16, never depends on it.
"""
from __future__ import annotations

import functools

import numpy as np
from mpi4py import MPI

from mpishard.core.backend import xp_of

__all__ = [
    "REDUCE_OPS",
    "OBJ_OPS",
    "mpi_reduce_op",
    "check_array",
    "check_wire_dtype",
    "check_reduction",
    "check_pair",
    "check_root",
    "check_peer",
    "reduce_scatter_recv",
    "all_gather_recv",
    "all_to_all_recv",
    "data_pointer",
    "is_float16",
    "is_bfloat16",
    "reduces_in_float32",
    "wire_view",
    "widened",
]

#: Array reductions: op name -> the MPI op that runs on the wire. ``avg`` is a
#: sum followed by one division by the communicator size after completion.
REDUCE_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX}

#: Reductions on small Python objects (``all_reduce_obj``).
OBJ_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN,
           "and": MPI.LAND, "or": MPI.LOR}


def mpi_reduce_op(op: str, where: str):
    """Return the MPI op for an array reduction name, or raise ValueError."""
    try:
        return REDUCE_OPS[op]
    except (KeyError, TypeError):
        raise ValueError(
            f"{where}: unknown op {op!r}; use one of {sorted(REDUCE_OPS)}") from None


@functools.lru_cache(maxsize=None)
def _mpi_has_datatype(char: str) -> bool:
    """Whether this MPI library has a datatype for the NumPy typecode ``char``."""
    try:
        return MPI.Datatype.fromcode(char) != MPI.DATATYPE_NULL
    except (KeyError, ValueError, MPI.Exception):
        return False


def check_array(a, where: str, role: str, *, output: bool = False) -> None:
    """Check that ``a`` is an array MPI can use as a buffer.

    Args:
        a: the array.
        where: the operation, for the message (``"all_reduce"``).
        role: the argument name, for the message (``"buf"``).
        output: ``a`` will be written (it must be writeable).

    Raises:
        TypeError: ``a`` is not a NumPy or CuPy array.
        ValueError: not C-contiguous (see [Note: contiguous buffers]) or a
            read-only output. (Whether MPI has a datatype for the dtype is asked
            on the MPI path only: :func:`check_wire_dtype`.)
    """
    flags = getattr(a, "flags", None)
    if flags is None or not hasattr(a, "dtype"):
        raise TypeError(
            f"{where}: {role} must be a NumPy or CuPy array, got "
            f"{type(a).__name__}; wrap it with np.asarray(...)")
    if not flags.c_contiguous:
        raise ValueError(
            f"{where}: {role} with shape {tuple(a.shape)} and strides "
            f"{tuple(a.strides)} is not C-contiguous; mpishard does not copy "
            f"buffers behind your back: pass xp.ascontiguousarray({role}) "
            f"(and copy the result back if it is an output)")
    if output and isinstance(a, np.ndarray) and not flags.writeable:
        raise ValueError(
            f"{where}: {role} is read-only but receives data; pass a writeable "
            f"array (e.g. {role}.copy())")


def check_wire_dtype(a, where: str, role: str = "buf") -> None:
    """Check that MPI can describe ``a`` as it goes on the wire (:func:`wire_view`).

    Run on the MPI path only (see [Note: 16-bit floats on MPI]).

    Raises:
        ValueError: this MPI library has no datatype for the dtype.
    """
    char = wire_view(a).dtype.char
    if not _mpi_has_datatype(char):
        raise ValueError(
            f"{where}: {role} has dtype {a.dtype}, for which this MPI library "
            f"({MPI.get_vendor()[0]}) has no datatype; use float32 or float64")


def check_reduction(a, op: str, where: str):
    """Check an op against a dtype; return the MPI op.

    ``max`` needs an ordered dtype, ``avg`` a floating or complex one (an
    integer average would silently truncate).
    """
    mpi_op = mpi_reduce_op(op, where)
    kind = "f" if is_bfloat16(a) else a.dtype.kind     # ml_dtypes' kind is "V"
    if kind not in "fiuc" or (kind == "c" and op == "max"):
        raise ValueError(
            f"{where}: op {op!r} is not defined for dtype {a.dtype}; reduce a "
            f"numeric array (float, int or, for sum/avg, complex)")
    if op == "avg" and kind not in "fc":
        raise ValueError(
            f"{where}: op 'avg' on integer dtype {a.dtype} would truncate; cast "
            f"to a floating dtype or use op='sum' and divide yourself")
    return mpi_op


def is_bfloat16(a) -> bool:
    """Whether ``a`` holds bfloat16 (``ml_dtypes``; see [Note: 16-bit floats on MPI])."""
    return a.dtype.name == "bfloat16"


def is_float16(a) -> bool:
    """Whether ``a`` holds float16 (see [Note: 16-bit floats on MPI])."""
    return a.dtype.name == "float16"


def reduces_in_float32(a) -> bool:
    """Whether an MPI reduction of ``a`` runs on float32 stand-ins (:func:`widened`):
    float16 and bfloat16 (see [Note: 16-bit floats on MPI])."""
    return a.dtype.name in ("float16", "bfloat16")


def wire_view(a):
    """``a`` as MPI can describe it: bfloat16 and float16 viewed as uint16 (the
    same bytes), anything else as is. For data movement only, never reductions."""
    return a.view(np.uint16) if a.dtype.name in ("bfloat16", "float16") else a


def widened(buffers, divide=None):
    """float32 stand-ins for the 16-bit (float16 or bfloat16) buffers of an MPI reduction.

    Args:
        buffers: ``(array, mpi_reads, mpi_writes)`` per buffer (see ``Call``).
        divide: the buffer an ``avg`` divides afterwards, or ``None``.

    Returns:
        ``(wide_buffers, wide_divide, narrow)``: the buffers with each array
        replaced by a float32 one (a copy where MPI reads it), the stand-in of
        ``divide``, and a step that rounds the results back into the 16-bit
        arrays MPI would have written (run it after the division).
    """
    wide, back, wide_divide = [], [], None
    for array, reads, writes in buffers:
        stand_in = (array.astype(np.float32) if reads
                    else xp_of(array).empty(array.shape, dtype=np.float32))
        wide.append((stand_in, reads, writes))
        if writes:
            back.append((array, stand_in))
        if array is divide:
            wide_divide = stand_in

    def narrow():
        for array, stand_in in back:
            array[...] = stand_in  # one rounding, float32 -> 16 bits
    return tuple(wide), wide_divide, narrow


def data_pointer(a) -> int:
    """Address of the first element (NumPy or CuPy)."""
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0]
    return int(a.data.ptr)


def _module_name(a) -> str:
    return "numpy" if isinstance(a, np.ndarray) else type(a).__module__.split(".")[0]


def check_pair(send, recv, where: str) -> None:
    """Check that send and receive buffers agree on dtype and array module."""
    if _module_name(send) != _module_name(recv):
        raise ValueError(
            f"{where}: send is a {_module_name(send)} array but recv is a "
            f"{_module_name(recv)} array; put both on the same device")
    if send.dtype != recv.dtype:
        raise ValueError(
            f"{where}: recv dtype {recv.dtype} does not match send dtype "
            f"{send.dtype}; allocate recv with dtype {send.dtype} (or pass "
            f"recv=None)")


def _overlap(a, b) -> bool:
    if isinstance(a, np.ndarray):
        # Exact for contiguous buffers (their bounds are their memory), and
        # ten times cheaper than reading the two data pointers.
        return np.may_share_memory(a, b)
    a0, b0 = data_pointer(a), data_pointer(b)
    return a.nbytes > 0 and b.nbytes > 0 and a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


def reduce_scatter_recv(send, recv, size: int, where: str = "reduce_scatter"):
    """Check (or allocate) the receive buffer of a reduce-scatter.

    ``send`` holds ``size`` equal blocks; rank ``r`` receives the reduction of
    block ``r``. A new ``recv`` has shape ``(send.shape[0] // size, *rest)``
    when the first dimension divides, else it is flat.
    """
    if send.size % size:
        padded = -(-send.size // size) * size
        raise ValueError(
            f"{where}: send has {send.size} elements, not a multiple of the "
            f"communicator size {size}; pad it to {padded} "
            f"(mpishard.parallel.padded_size({send.size}, {size}))")
    block = send.size // size
    if recv is None:
        xp = xp_of(send)
        if send.ndim >= 1 and send.shape[0] % size == 0:
            shape = (send.shape[0] // size,) + tuple(send.shape[1:])
        else:
            shape = (block,)
        return xp.empty(shape, dtype=send.dtype)
    check_array(recv, where, "recv", output=True)
    check_pair(send, recv, where)
    if recv.size != block:
        raise ValueError(
            f"{where}: recv has {recv.size} elements but send has {send.size} "
            f"elements over {size} ranks, so recv needs {block}; pass recv with "
            f"{block} elements (or recv=None)")
    if _overlap(send, recv):
        raise ValueError(
            f"{where}: recv overlaps send; pass a separate recv buffer (or "
            f"recv=None)")
    return recv


def all_gather_recv(send, recv, size: int, rank: int, where: str = "all_gather"):
    """Check (or allocate) the receive buffer of an all-gather.

    Returns ``(recv, in_place)``. A new ``recv`` concatenates the ranks' sends
    along the first dimension (rank-major), shape ``(size * send.shape[0],
    *rest)``, or ``(size,)`` for a 0-d send. ``in_place`` is true when ``send``
    is exactly this rank's block of ``recv`` (ZeRO keeps its shard that way);
    any other overlap is an error.
    """
    full = send.size * size
    if recv is None:
        shape = (size,) if send.ndim == 0 else (size * send.shape[0],) + tuple(send.shape[1:])
        return xp_of(send).empty(shape, dtype=send.dtype), False
    check_array(recv, where, "recv", output=True)
    check_pair(send, recv, where)
    if recv.size != full:
        raise ValueError(
            f"{where}: recv has {recv.size} elements but {size} ranks each send "
            f"{send.size}, so recv needs {full}; pass recv with {full} elements "
            f"(or recv=None)")
    if not _overlap(send, recv):
        return recv, False
    if data_pointer(send) == data_pointer(recv) + rank * send.nbytes:
        return recv, True
    raise ValueError(
        f"{where}: send overlaps recv but is not this rank's block of it "
        f"(elements [{rank * send.size}:{(rank + 1) * send.size}]); pass a "
        f"separate send buffer or exactly that block")


def all_to_all_recv(send, recv, size: int, where: str = "all_to_all"):
    """Check (or allocate, shaped like ``send``) the receive buffer of an all-to-all.

    Both hold ``size`` equal blocks of the flattened array; they must not overlap.
    """
    if send.size % size:
        raise ValueError(
            f"{where}: send has {send.size} elements, which do not split into "
            f"{size} equal blocks (one per rank); send a multiple of {size} elements")
    if recv is None:
        return xp_of(send).empty(send.shape, dtype=send.dtype)
    check_array(recv, where, "recv", output=True)
    check_pair(send, recv, where)
    if recv.size != send.size:
        raise ValueError(
            f"{where}: recv has {recv.size} elements but send has {send.size}; an "
            f"all-to-all receives as many as it sends, pass recv with {send.size} "
            f"elements (or recv=None)")
    if _overlap(send, recv):
        raise ValueError(f"{where}: recv overlaps send; pass a separate recv buffer "
                         f"(or recv=None)")
    return recv


def check_root(root, size: int, where: str) -> int:
    """Check a root rank index."""
    if not isinstance(root, (int, np.integer)) or not 0 <= root < size:
        raise ValueError(
            f"{where}: root {root!r} is not a rank of this communicator; use "
            f"0 <= root < {size}")
    return int(root)


def check_peer(peer, size: int, rank: int, where: str, *, any_ok: bool = False) -> int:
    """Check a point-to-point peer (``any_ok`` admits ``MPI.ANY_SOURCE``)."""
    if any_ok and peer == MPI.ANY_SOURCE:
        return int(peer)
    if not isinstance(peer, (int, np.integer)) or not 0 <= peer < size or peer == rank:
        raise ValueError(
            f"{where}: peer {peer!r} is not another rank of this communicator "
            f"(this is rank {rank} of {size}); use a rank in 0..{size - 1} "
            f"other than {rank}")
    return int(peer)


def all_to_all_v_counts(send, send_counts, recv, recv_counts, size: int,
                        where: str = "all_to_all_v"):
    """Check an all-to-all-v's row counts and receive buffer (allocated when ``None``).

    ``send`` holds ``sum(send_counts)`` rows (its first dimension), the rows for rank
    ``j`` after those for ranks ``< j``; ``recv`` gets ``sum(recv_counts)`` rows of
    the same trailing shape. Returns ``(send_counts, recv_counts, recv)`` as lists.
    """
    out = []
    for role, counts in (("send_counts", send_counts), ("recv_counts", recv_counts)):
        counts = [int(c) for c in counts]
        if len(counts) != size or any(c < 0 for c in counts):
            raise ValueError(f"{where}: {role} {counts} must be {size} non-negative row "
                             f"counts, one per rank")
        out.append(counts)
    send_counts, recv_counts = out
    if send.ndim < 1 or send.shape[0] != sum(send_counts):
        raise ValueError(f"{where}: send has {send.shape[0] if send.ndim else 0} rows but "
                         f"send_counts add up to {sum(send_counts)}; pass one count per "
                         f"rank that add up to send.shape[0]")
    shape = (sum(recv_counts), *send.shape[1:])
    if recv is None:
        recv = xp_of(send).empty(shape, dtype=send.dtype)
    else:
        check_array(recv, where, "recv", output=True)
        check_pair(send, recv, where)
        if tuple(recv.shape) != shape:
            raise ValueError(f"{where}: recv has shape {tuple(recv.shape)}; recv_counts "
                             f"need {shape} (or recv=None)")
        if recv.size and send.size and _overlap(send, recv):
            raise ValueError(f"{where}: recv overlaps send; pass a separate recv buffer "
                             f"(or recv=None)")
    return send_counts, recv_counts, recv

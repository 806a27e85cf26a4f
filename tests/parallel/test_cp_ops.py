"""Context-parallel attention (mpishard.parallel.context.attention) against attention on the whole sequence.

Every rank builds the same global batch from a fixed seed, keeps its zigzag
rows, and runs ``ring_attention`` or ``ulysses_attention`` over group sizes
1-4; output and input gradient must equal the matching rows of
``causal_self_attention`` over the whole sequence (float64: 1e-12). Also: the
16-bit and float32 paths, the all-to-alls as each other's adjoint and inverse,
equal work per rank with zigzag (and unequal without), the bytes the ring
sends, and the errors for shapes that do not split.
"""
import importlib.util

import numpy as np
import pytest
from mpi4py import MPI

from mpishard.autodiff import Tensor, causal_self_attention
from mpishard.core.dtypes import resolve_dtype
from mpishard.parallel.context.attention import (heads_to_seq, ring_attention, ring_kv_bytes, seq_to_heads,
                                      ulysses_attention, zigzag_positions, zigzag_slice)
from parity import sub_world

SIZES = [1, 2, 3, 4]
B, HS = 2, 3
HAS_BF16 = importlib.util.find_spec("ml_dtypes") is not None
OPS = {"ring": ring_attention, "ulysses": ulysses_attention}


def _group(size):
    if size > MPI.COMM_WORLD.size:
        pytest.skip(f"needs {size} ranks")
    return sub_world(size)


def _problem(T, n_head, seed=0):
    """The global ``(B, T, 3C)`` input and ``(B, T, C)`` upstream gradient, same on every rank."""
    r = np.random.default_rng(seed)
    C = n_head * HS
    return r.standard_normal((B, T, 3 * C)), r.standard_normal((B, T, C))


def _rows(a, comm, layout="zigzag"):
    """This rank's rows of a ``(B, T, w)`` array, packed as ``(B * T_local, w)``."""
    return zigzag_slice(a, comm.size, comm.rank, layout=layout).reshape(-1, a.shape[-1])


def _forward_backward(op, x, g, *args, **kwargs):
    t = Tensor(np.ascontiguousarray(x), requires_grad=True)
    y = op(t, *args, **kwargs)
    y.backward(np.ascontiguousarray(g).astype(y.dtype))
    return y.data, t.grad


def _reference(x, g, n_head):
    """Full attention over the whole sequence, in float64: ``(y, dx)`` shaped like ``x``, ``g``."""
    rows = B * x.shape[1]
    y, dx = _forward_backward(causal_self_attention, x.reshape(rows, -1).astype(np.float64),
                              g.reshape(rows, -1).astype(np.float64), n_head, B)
    return y.reshape(g.shape), dx.reshape(x.shape)


def _all_ranks(comm, ok: bool) -> bool:
    return all(comm.all_gather_obj(bool(ok)))


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("chunk", [2, 3])
@pytest.mark.parametrize("mode,n_head", [("ring", 4), ("ulysses", 4), ("ulysses", 6)])
@pytest.mark.parametrize("size", SIZES)
def test_matches_attention_over_the_whole_sequence(size, mode, n_head, chunk):
    if mode == "ulysses" and n_head % size:
        pytest.skip(f"ulysses needs n_head {n_head} to divide by cp {size}")
    with _group(size) as comm:
        if comm is None:
            return
        x, g = _problem(2 * size * chunk, n_head, seed=chunk)
        want_y, want_dx = _reference(x, g, n_head)
        y, dx = _forward_backward(OPS[mode], _rows(x, comm), _rows(g, comm), n_head, B, comm)
        assert y.shape == (B * 2 * chunk, n_head * HS)
        np.testing.assert_allclose(y, _rows(want_y, comm), rtol=0, atol=1e-12)
        np.testing.assert_allclose(dx, _rows(want_dx, comm), rtol=0, atol=1e-12)


LOW = [("float32", 1e-5), ("float16", 2e-3)] + ([("bfloat16", 1e-2)] if HAS_BF16 else [])


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("dtype,tol", LOW)
@pytest.mark.parametrize("size", SIZES)
def test_float32_and_16_bit(size, dtype, tol, mode):
    """Output and gradient in the input dtype, close to float64 attention on the
    rounded inputs (relative to the largest entry)."""
    n_head = 4 if size != 3 else 6
    dtype = resolve_dtype(dtype)
    with _group(size) as comm:
        if comm is None:
            return
        x, g = _problem(4 * size, n_head, seed=5)
        x, g = x.astype(dtype), g.astype(dtype)
        want_y, want_dx = _reference(x, g, n_head)
        y, dx = _forward_backward(OPS[mode], _rows(x, comm), _rows(g, comm), n_head, B, comm)
        assert y.dtype == dtype and dx.dtype == dtype
        for got, want in ((y, _rows(want_y, comm)), (dx, _rows(want_dx, comm))):
            err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
            assert err <= tol, f"{dtype} {mode}: relative error {err:.2e} > {tol}"


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("size", SIZES)
def test_all_to_alls_are_adjoint_and_inverse(size, parts):
    """<A x, y> = <x, A^T y> over the group, for A = seq_to_heads and heads_to_seq
    (A^T from backward); each undoes the other; seq_to_heads picks this rank's
    heads of the whole sequence in natural order."""
    with _group(size) as comm:
        if comm is None:
            return
        n_head, T = 2 * size, 4 * size
        local = n_head // size
        whole = np.random.default_rng(3).standard_normal((B, T, parts, n_head, HS))
        x = _rows(whole.reshape(B, T, -1), comm)
        r = np.random.default_rng(10 + comm.rank)
        y = r.standard_normal((B * T, parts * local * HS))
        x_other = r.standard_normal(x.shape)

        def dot(a, b):
            return comm.all_reduce_obj(float(np.vdot(a, b)))
        for op, inp, out in ((seq_to_heads, x, y), (heads_to_seq, y, x_other)):
            forward, adjoint = _forward_backward(op, inp, out, n_head, B, comm, parts=parts)
            lhs, rhs = dot(forward, out), dot(inp, adjoint)
            assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), (op.__name__, lhs, rhs)
        heads = seq_to_heads(x, n_head, B, comm, parts=parts).data
        mine = whole[:, :, :, comm.rank * local:(comm.rank + 1) * local]
        np.testing.assert_array_equal(heads, mine.reshape(B * T, -1))
        np.testing.assert_array_equal(heads_to_seq(heads, n_head, B, comm, parts=parts).data, x)
        back = seq_to_heads(heads_to_seq(y, n_head, B, comm, parts=parts), n_head, B, comm,
                            parts=parts)
        np.testing.assert_array_equal(back.data, y)


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("size", SIZES)
def test_work_per_rank(size, layout):
    """Zigzag: every rank computes the same number of scores; contiguous: rank r
    computes r + 1 times the first rank's (the last one cp times), still correctly."""
    n_head, n_local = 4, 4
    with _group(size) as comm:
        if comm is None:
            return
        x, g = _problem(n_local * size, n_head, seed=7)
        want_y, want_dx = _reference(x, g, n_head)
        stats = {}
        y, dx = _forward_backward(ring_attention, _rows(x, comm, layout), _rows(g, comm, layout),
                                  n_head, B, comm, layout=layout, stats=stats)
        np.testing.assert_allclose(y, _rows(want_y, comm, layout), rtol=0, atol=1e-12)
        np.testing.assert_allclose(dx, _rows(want_dx, comm, layout), rtol=0, atol=1e-12)
        counts = comm.all_gather_obj(stats["score_elements"])
        square = B * n_head * n_local * n_local
        if layout == "zigzag":
            assert counts == [square * (size + 1) // 2] * size
        else:
            assert counts == [square * (r + 1) for r in range(size)]
            if size == 4:
                assert max(counts) / min(counts) > 1.5


BYTES_DTYPES = ["float64", "float32"] + (["bfloat16"] if HAS_BF16 else [])


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", BYTES_DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_ring_sends_what_ring_kv_bytes_says(size, dtype):
    """Forward plus backward: cp - 1 K/V blocks twice and cp dK/dV blocks, nothing else."""
    n_head, T = 2, 4 * size
    dtype = resolve_dtype(dtype)
    with _group(size) as comm:
        if comm is None:
            return
        x, g = _problem(T, n_head, seed=2)
        comm.stats.reset()
        _forward_backward(ring_attention, _rows(x, comm).astype(dtype), _rows(g, comm), n_head,
                          B, comm)
        want = ring_kv_bytes(B, T, n_head, HS, size, dtype.itemsize)
        assert comm.stats["send"].bytes == comm.stats["recv"].bytes == want
        assert comm.stats["send"].calls == (3 * size - 2 if size > 1 else 0)
        assert sorted(comm.stats.kinds()) == (["recv", "send"] if size > 1 else [])
    assert ring_kv_bytes(2, 16, 4, 8, 4, 8) == 2 * 4 * 2 * 32 * (2 * 3 * 8 + 4 * 8)


def test_zigzag_layout():
    """Each position on exactly one rank; zigzag ranks hold chunks r and 2cp-1-r."""
    for cp in SIZES:
        for layout in ("zigzag", "contiguous"):
            held = [zigzag_positions(8 * cp, cp, r, layout=layout) for r in range(cp)]
            assert all(h.dtype == np.int64 and len(h) == 8 for h in held)
            np.testing.assert_array_equal(np.sort(np.concatenate(held)), np.arange(8 * cp))
    np.testing.assert_array_equal(zigzag_positions(16, 4, 1), [2, 3, 12, 13])
    np.testing.assert_array_equal(zigzag_positions(16, 4, 1, layout="contiguous"), [4, 5, 6, 7])
    a = np.arange(2 * 16 * 3).reshape(2, 16, 3)
    part = zigzag_slice(a, 4, 3)
    assert part.flags.c_contiguous and not np.shares_memory(part, a)
    np.testing.assert_array_equal(part, a[:, [6, 7, 8, 9]])
    np.testing.assert_array_equal(zigzag_slice(a.swapaxes(0, 1), 4, 0, axis=0),
                                  a.swapaxes(0, 1)[[0, 1, 14, 15]])
    np.testing.assert_array_equal(zigzag_positions(5, 1, 0), np.arange(5))


def test_lengths_that_do_not_split():
    with pytest.raises(ValueError, match=r"sequence length 30 does not divide by 2 x cp = 8 "
                                         r".*use a sequence length that is a multiple of 8"):
        zigzag_positions(30, 4, 0)
    with pytest.raises(ValueError, match="sequence length 30 does not divide by cp = 4"):
        zigzag_slice(np.zeros((1, 30)), 4, 0, layout="contiguous")
    with pytest.raises(ValueError, match="unknown sequence layout 'striped'"):
        zigzag_positions(16, 2, 0, layout="striped")
    with pytest.raises(ValueError, match="rank 2 is not in a context-parallel group of 2"):
        zigzag_positions(16, 2, 2)


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_errors_on_every_rank(size):
    """An odd local length (T = 3 cp does not divide by 2 cp), and for Ulysses a head
    count that does not divide by cp: every rank raises, naming the fix."""
    with _group(size) as comm:
        if comm is None:
            return
        odd = np.zeros((B * 3, 3 * 12 * HS))
        for op in (ring_attention, ulysses_attention, seq_to_heads):
            with pytest.raises(ValueError, match=rf"sequence length {3 * size} does not "
                                                 rf"divide by 2 x cp = {2 * size}.*multiple"):
                op(odd, 12, B, comm)
        bad_heads = {2: 3, 3: 4, 4: 6}[size]
        qkv = np.zeros((B * 4, 3 * bad_heads * HS))
        for op in (ulysses_attention, seq_to_heads, heads_to_seq):
            with pytest.raises(ValueError, match=rf"{op.__name__}: n_head {bad_heads} does not "
                                                 rf"divide by cp = {size}.*use a cp that divides"):
                op(qkv, bad_heads, B, comm)
        with pytest.raises(ValueError, match="unknown sequence layout"):
            ring_attention(np.zeros((B * 4, 3 * 4 * HS)), 4, B, comm, layout="striped")
        assert _all_ranks(comm, True)       # every rank got here, none is stuck in a collective

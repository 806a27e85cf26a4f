"""The sequence-parallel collectives (mpishard.parallel.tensor.sequence) at group sizes 1-4.

Forward values by hand, adjoints (<A x, y> = <x, A^T y> with A^T run as the
op's backward), round trips, dtypes, non-contiguous inputs and the error for
row counts that do not divide. The finite-difference checks of the same ops
are tests/sp_cases.py, run by tests/parallel/test_parallel_tp_ops.py.
"""
import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from mpishard.autodiff import Tensor
from mpishard.core.dtypes import resolve_dtype
from mpishard.parallel.tensor.sequence import gather_from_sp, reduce_scatter_to_sp, scatter_to_sp, sp_rows
from parity import sub_world

SIZES = [1, 2, 3, 4]
ROWS, COLS = 2, 3      # rows per rank, columns


@contextlib.contextmanager
def group(size):
    """``sub_world(size)``, skipped when the world is smaller."""
    if size > MPI.COMM_WORLD.size:
        pytest.skip(f"needs {size} ranks")
    with sub_world(size) as comm:
        yield comm


def ints(seed, shape, dtype=np.float64):
    """Small integers as floats: every sum of a few of them is exact in every dtype."""
    return np.random.default_rng(seed).integers(-4, 5, shape).astype(dtype)


def normal(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape)


def run(op, x, comm, grad):
    """``(forward value, gradient of x)`` of ``op`` with ``grad`` as the output's gradient."""
    t = Tensor(x, requires_grad=True)
    out = op(t, comm)
    value = out.data.copy()
    out.backward(grad)
    return value, t.grad


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES)
def test_forward_and_backward_values(size):
    with group(size) as comm:
        if comm is None:
            return
        p, r = comm.size, comm.rank
        lo, hi = r * ROWS, (r + 1) * ROWS
        small, big = (ROWS, COLS), (ROWS * p, COLS)
        eq = np.testing.assert_array_equal
        # gather: concatenation of every rank's block; backward: my block of the summed gradient
        value, grad = run(gather_from_sp, ints(r, small), comm, ints(100 + r, big))
        eq(value, np.concatenate([ints(s, small) for s in range(p)]))
        eq(grad, sum(ints(100 + s, big) for s in range(p))[lo:hi])
        # reduce-scatter: my block of the sum; backward: concatenation of every rank's gradient
        value, grad = run(reduce_scatter_to_sp, ints(r, big), comm, ints(100 + r, small))
        eq(value, sum(ints(s, big) for s in range(p))[lo:hi])
        eq(grad, np.concatenate([ints(100 + s, small) for s in range(p)]))
        # scatter: my block of the replicated input, a copy; backward: concatenation as well
        full = ints(7, big)
        value, grad = run(scatter_to_sp, full, comm, ints(100 + r, small))
        eq(value, full[lo:hi])
        eq(grad, np.concatenate([ints(100 + s, small) for s in range(p)]))
        if p > 1:
            assert not np.shares_memory(scatter_to_sp(full, comm).data, full)


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES)
def test_one_rank_is_the_identity(size):
    with group(size) as comm:
        if comm is None or comm.size != 1:
            return
        for op in (gather_from_sp, reduce_scatter_to_sp, scatter_to_sp):
            x = Tensor(normal(0, (3, 2)), requires_grad=True)
            assert op(x, comm) is x


# op -> (input shape, output shape, input replicated?) for a group of p ranks
ADJOINT = {
    "gather_from_sp": (gather_from_sp, lambda p: (ROWS, COLS), lambda p: (ROWS * p, COLS), False),
    "reduce_scatter_to_sp": (reduce_scatter_to_sp, lambda p: (ROWS * p, COLS),
                             lambda p: (ROWS, COLS), False),
    "scatter_to_sp": (scatter_to_sp, lambda p: (ROWS * p, COLS), lambda p: (ROWS, COLS), True),
}


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", sorted(ADJOINT))
def test_adjoint(name, size):
    """sum_r <A x, y>_r == sum_r <x, A^T y>_r, A^T being the op's backward.

    A split input is one variable per rank, so both sides sum over ranks. A
    replicated input is one variable the ranks share: A^T y (the full
    gradient) is the same on every rank and its inner product counts once.
    """
    op, in_shape, out_shape, replicated = ADJOINT[name]
    with group(size) as comm:
        if comm is None:
            return
        p, r = comm.size, comm.rank
        x = normal(1 if replicated else [1, r], in_shape(p))
        y = normal([2, r], out_shape(p))
        ax, aty = run(op, x, comm, y)
        lhs = comm.all_reduce_obj(float(np.vdot(ax, y)), op="sum")
        mine = float(np.vdot(x, aty))
        if replicated:
            everyone = comm.all_gather_obj(mine)
            assert max(everyone) - min(everyone) <= 1e-12 * max(1.0, abs(mine))
            rhs = mine
        else:
            rhs = comm.all_reduce_obj(mine, op="sum")
        assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), (lhs, rhs)


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES)
def test_round_trips(size):
    with group(size) as comm:
        if comm is None:
            return
        p, r = comm.size, comm.rank
        x = normal(3, (ROWS * p, COLS))                       # replicated
        np.testing.assert_array_equal(gather_from_sp(scatter_to_sp(x, comm), comm).data, x)
        block = normal([4, r], (ROWS, COLS))                  # split
        np.testing.assert_array_equal(scatter_to_sp(gather_from_sp(block, comm), comm).data, block)
        lo, hi = sp_rows(ROWS * p, comm)
        np.testing.assert_allclose(reduce_scatter_to_sp(x, comm).data, p * x[lo:hi],
                                   rtol=1e-14, atol=0)


def _dtype(name):
    try:
        return resolve_dtype(name)
    except ValueError as exc:              # bfloat16 without ml_dtypes
        pytest.skip(f"{name} unavailable: {exc}")


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dtypes_are_kept(dtype, size):
    """Values and gradients keep the input's dtype (and, for small integers, are exact)."""
    dt = _dtype(dtype)
    with group(size) as comm:
        if comm is None:
            return
        p, r = comm.size, comm.rank
        lo, hi = r * ROWS, (r + 1) * ROWS
        small, big = (ROWS, COLS), (ROWS * p, COLS)
        for op, x, g, want, want_grad in [
            (gather_from_sp, ints(r, small, dt), ints(9 + r, big, dt),
             np.concatenate([ints(s, small) for s in range(p)]),
             sum(ints(9 + s, big) for s in range(p))[lo:hi]),
            (reduce_scatter_to_sp, ints(r, big, dt), ints(9 + r, small, dt),
             sum(ints(s, big) for s in range(p))[lo:hi],
             np.concatenate([ints(9 + s, small) for s in range(p)])),
            (scatter_to_sp, ints(5, big, dt), ints(9 + r, small, dt), ints(5, big)[lo:hi],
             np.concatenate([ints(9 + s, small) for s in range(p)])),
        ]:
            value, grad = run(op, x, comm, g)
            assert value.dtype == dt and grad.dtype == dt, (op.__name__, value.dtype, grad.dtype)
            np.testing.assert_array_equal(value.astype(np.float64), want)
            np.testing.assert_array_equal(grad.astype(np.float64), want_grad)


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_non_contiguous_inputs_and_gradients(dtype, size):
    """Transposed views in and transposed gradients back: the values of their C-order copies."""
    dt = _dtype(dtype)
    with group(size) as comm:
        if comm is None:
            return
        p, r = comm.size, comm.rank
        for op, rows_in, rows_out, seed in [(gather_from_sp, ROWS, ROWS * p, [6, r]),
                                            (reduce_scatter_to_sp, ROWS * p, ROWS, [6, r]),
                                            (scatter_to_sp, ROWS * p, ROWS, 6)]:
            x = ints(seed, (COLS, rows_in), dt).T                # (rows_in, COLS), F order
            g = ints([8, r], (COLS, rows_out), dt).T
            assert not x.flags.c_contiguous and not g.flags.c_contiguous
            before = x.copy()
            value, grad = run(op, x, comm, g)
            want, want_grad = run(op, np.ascontiguousarray(x), comm, np.ascontiguousarray(g))
            np.testing.assert_array_equal(x, before)
            np.testing.assert_array_equal(value, want)
            np.testing.assert_array_equal(grad, want_grad)
            assert value.dtype == dt and grad.dtype == dt


def test_sp_rows_partition():
    for n, p in [(8, 1), (8, 2), (12, 3), (32, 4)]:
        blocks = [sp_rows(n, SimpleNamespace(rank=r, size=p)) for r in range(p)]
        assert blocks[0][0] == 0 and blocks[-1][1] == n
        assert all(a[1] == b[0] and a[1] - a[0] == n // p for a, b in zip(blocks, blocks[1:]))
    with pytest.raises(ValueError) as err:
        sp_rows(30, SimpleNamespace(rank=1, size=4))
    assert ("sequence parallel splits the B*T = 30 rows of each micro-batch over tp = 4 "
            "ranks; use a batch x sequence length divisible by 4 or turn off "
            "--sequence-parallel") in str(err.value)


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_rows_that_do_not_divide_raise_on_every_rank(size):
    with group(size) as comm:
        if comm is None:
            return
        p, r = comm.size, comm.rank
        n = ROWS * p + 1
        fix = (f"B*T = {n} rows of each micro-batch over tp = {p} ranks; use a batch x "
               f"sequence length divisible by {p} or turn off --sequence-parallel")
        raised = []
        for name, call in [("sp_rows", lambda: sp_rows(n, comm)),
                           ("reduce_scatter_to_sp", lambda: reduce_scatter_to_sp(
                               Tensor(normal([0, r], (n, COLS)), requires_grad=True), comm)),
                           ("scatter_to_sp", lambda: scatter_to_sp(
                               Tensor(normal(0, (n, COLS)), requires_grad=True), comm))]:
            with pytest.raises(ValueError) as err:
                call()
            assert str(err.value).startswith(name) and fix in str(err.value), str(err.value)
            raised.append(name)
        with pytest.raises(ValueError, match="0-d"):
            gather_from_sp(np.float64(1.0), comm)
        assert comm.all_gather_obj(raised) == [raised] * p
        # Nothing was sent: the next collective pairs up as usual.
        out = gather_from_sp(np.full((1, 2), float(r)), comm).data
        np.testing.assert_array_equal(out[:, 0], np.arange(p))


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_gathered_linear_is_linear_of_the_gathered_rows(size):
    """Forward and every gradient equal ``linear(gather_from_sp(x))``, bit for bit."""
    from mpishard.autodiff import Tensor
    from mpishard.autodiff.nn_ops import linear
    from mpishard.parallel.tensor.sequence import gather_from_sp, gathered_linear
    if size > MPI.COMM_WORLD.size:
        pytest.skip(f"needs {size} ranks")
    with sub_world(size) as comm:
        if comm is None:
            return
        r = np.random.default_rng(comm.rank)
        x, w, b = r.standard_normal((3, 5)), r.standard_normal((4, 5)), r.standard_normal(4)
        g = r.standard_normal((3 * size, 4))
        grads = []
        for fused in (True, False):
            t = [Tensor(a.copy(), requires_grad=True) for a in (x, w, b)]
            y = gathered_linear(*t, comm) if fused else linear(gather_from_sp(t[0], comm),
                                                               t[1], t[2])
            y.backward(g)
            grads.append([y.data] + [a.grad for a in t])
        for fused, plain in zip(*grads):
            assert np.array_equal(fused, plain)

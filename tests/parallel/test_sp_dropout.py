"""The embeddings' dropout under sequence parallelism (RowsDropout in
mpishard/parallel/tensor/layers.py) against one process's dropout, at tp sizes 1-4.

    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi tests/parallel/test_sp_dropout.py

It drops this rank's rows after the cut (Megatron-LM's order): each rank's output and
the input's gradient must be one process's, bit for bit, and the generator must end
where one process's does, whatever half-drawn state it starts in.
"""

import numpy as np
import pytest

from mpishard.autodiff import Tensor
from mpishard.nn import Dropout
from mpishard.nn.parameter import rng_for
from mpishard.parallel.tensor.layers import RowsDropout, _draw_rows
from mpishard.parallel.tensor.sequence import sp_rows
from test_sp_ops import group

SIZES = [1, 2, 3, 4]


def _same(a, b) -> bool:
    """Whether two generator states (dicts of numbers and arrays) are equal."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return np.array_equal(a, b)


def _generator(bits, drawn: int):
    """A seeded generator of ``bits`` after ``drawn`` float32 draws (odd: half a step)."""
    rng = np.random.Generator(bits(np.random.SeedSequence(11)))
    rng.random(drawn, dtype=np.float32)
    return rng


@pytest.mark.parametrize("bits", [np.random.PCG64, np.random.PCG64DXSM, np.random.Philox])
@pytest.mark.parametrize("drawn", [0, 1, 2])
@pytest.mark.parametrize("n_rows,width,start,stop", [
    (8, 3, 2, 4), (8, 3, 0, 2), (6, 5, 3, 6), (7, 1, 1, 6), (9, 3, 0, 9), (5, 1, 1, 2)])
def test_rows_of_a_draw_and_the_state_after(bits, drawn, n_rows, width, start, stop):
    whole, rows = _generator(bits, drawn), _generator(bits, drawn)
    want = whole.random((n_rows, width), dtype=np.float32)[start:stop]
    got = _draw_rows(rows, start, stop, n_rows, width, np)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert _same(rows.bit_generator.state, whole.bit_generator.state)
    assert np.array_equal(rows.random(7, dtype=np.float32), whole.random(7, dtype=np.float32))


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("drawn", [0, 1])
def test_rows_dropout_is_one_process_dropout(size, drawn):
    with group(size) as comm:
        if comm is None:
            return
        n_rows, width = 3 * comm.size, 5            # odd rows x width: half steps
        x = np.random.default_rng(3).standard_normal((n_rows, width))
        grad = np.random.default_rng(4).standard_normal((n_rows, width))
        one, split = Dropout(0.3), RowsDropout(0.3, comm)
        for layer in (one, split):
            layer.rng = rng_for(7, "dropout:transformer.drop")
            layer.rng.random(drawn, dtype=np.float32)
        whole_in, rows_in = Tensor(x, requires_grad=True), Tensor(x.copy(), requires_grad=True)
        whole, rows = one(whole_in), split(rows_in)
        lo, hi = sp_rows(n_rows, comm)
        assert np.array_equal(rows.data, whole.data[lo:hi])
        whole.backward(grad)
        rows.backward(grad[lo:hi].copy())
        assert np.array_equal(rows_in.grad, whole_in.grad)       # gathered over tp
        assert split.rng.bit_generator.state == one.rng.bit_generator.state
        split.eval()
        assert np.array_equal(split(Tensor(x)).data, x[lo:hi])

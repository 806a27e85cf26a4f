"""The communicating autodiff ops (tensor parallel), gradient-checked across ranks.

Every case of ``distributed_gradcheck.DISTRIBUTED_CASES`` at group sizes 1-4
(sizes that split the vocabulary unevenly included): backward of the group as
one function against central differences, relative error <= 1e-6.
"""
import zlib

import pytest
from mpi4py import MPI

import numpy as np

from distributed_gradcheck import DISTRIBUTED_CASES, distributed_gradcheck
from parity import sub_world

CASES = [(name, i) for name, cases in DISTRIBUTED_CASES.items() for i in range(len(cases))]


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("name,index", CASES)
def test_distributed_gradcheck(name, index, size):
    if size > MPI.COMM_WORLD.size:
        pytest.skip(f"needs {size} ranks")
    with sub_world(size) as comm:
        if comm is None:
            return
        rng = np.random.default_rng(zlib.crc32(name.encode()) + 1000 * index + comm.rank)
        fn, split, replicated = DISTRIBUTED_CASES[name][index](rng, comm)
        err = distributed_gradcheck(comm, fn, split, replicated)
        assert err <= 1e-6, f"{name} case {index} on {size} ranks: relative error {err:.3e}"


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2])
def test_a_wrong_backward_is_caught(size):
    """The check can fail: a doubled backward (any size), and f without its
    all-reduce (two ranks: each rank's gradient misses the other's share)."""
    from mpishard.autodiff.graph import as_tensor, make_result
    from mpishard.parallel import reduce_from_tp

    def doubled(x, comm):
        x = as_tensor(x)
        return make_result(x.data.copy(), (x,), lambda g: (2 * g,), "doubled")

    def forgetful_copy(x, comm):
        x = as_tensor(x)
        return make_result(x.data, (x,), lambda g: (g,), "forgetful_copy")

    if size > MPI.COMM_WORLD.size:
        pytest.skip(f"needs {size} ranks")
    with sub_world(size) as comm:
        if comm is None:
            return
        if size == 1:
            err = distributed_gradcheck(comm, lambda c, x: doubled(x, c).sum(), [np.ones((2, 2))])
        else:
            w = np.full((2, 2), 1.0 + comm.rank)
            err = distributed_gradcheck(
                comm, lambda c, w_, x: reduce_from_tp((forgetful_copy(x, c) * w_).sum(), c),
                [w], [np.ones((2, 2))])
        assert err > 0.3

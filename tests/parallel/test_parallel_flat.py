"""Flat buffers: layout, round trip, padding, and sharding with reduce_scatter."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpishard.parallel.flat import FlatIndex, padded_size
from mpishard.testing.fake_cupy import make_test_comm

pytestmark = pytest.mark.timeout(60)

shapes = st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple),
                  min_size=1, max_size=5)


@settings(max_examples=40, deadline=None)
@given(shapes=shapes, pad_to=st.integers(1, 5))
def test_flatten_round_trip(shapes, pad_to):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    layout = FlatIndex.of_arrays(arrays, pad_to=pad_to)
    flat = layout.flatten(arrays)
    assert flat.shape == (layout.padded_numel,) and layout.padded_numel % pad_to == 0
    assert layout.numel == sum(a.size for a in arrays)
    assert layout.numel <= layout.padded_numel < layout.numel + pad_to
    assert (flat[layout.numel:] == 0).all()
    for a, offset in zip(arrays, layout.offsets):
        np.testing.assert_array_equal(flat[offset:offset + a.size], a.ravel())
    views = layout.views(flat)
    assert all(np.shares_memory(v, flat) or v.size == 0 for v in views)
    targets = [np.empty_like(a) for a in arrays]
    layout.unflatten_into(flat * 2, targets)
    for a, t in zip(arrays, targets):
        np.testing.assert_array_equal(t, a * 2)


def test_padded_size_and_errors():
    assert [padded_size(n, 4) for n in (0, 1, 4, 5)] == [0, 4, 4, 8]
    with pytest.raises(ValueError, match="multiple=0 must be >= 1"):
        padded_size(3, 0)
    with pytest.raises(ValueError, match=r"dtypes \['float32', 'float64'\]"):
        FlatIndex.of_arrays([np.zeros(2, np.float32), np.zeros(2)])
    layout = FlatIndex.of([(2, 3)], "float32")
    with pytest.raises(ValueError, match=r"flat buffer has shape \(5,\); this layout needs \(6,\) elements"):
        layout.views(np.zeros(5, np.float32))
    with pytest.raises(ValueError, match=r"array of shape \(3, 2\) where the layout has \(2, 3\)"):
        layout.flatten([np.zeros((3, 2), np.float32)])
    out = np.full(6, 9, np.float32)
    assert layout.flatten([np.ones((2, 3), np.float32)], out=out) is out and (out == 1).all()


@pytest.mark.mpi
def test_flat_buffer_shards_with_reduce_scatter():
    """Pad to the group size, reduce-scatter, all-gather: back to the full average."""
    comm = make_test_comm("world")
    arrays = [np.full((3, 5), comm.rank, np.float64), np.full(7, 2 * comm.rank, np.float64)]
    layout = FlatIndex.of_arrays(arrays, pad_to=comm.size)
    flat = layout.flatten(arrays)
    shard = comm.reduce_scatter(flat, op="avg")
    assert shard.shape == (layout.padded_numel // comm.size,)
    full = comm.all_gather(shard)
    results = [np.empty_like(a) for a in arrays]
    layout.unflatten_into(full, results)
    mean_rank = (comm.size - 1) / 2
    np.testing.assert_allclose(results[0], np.full((3, 5), mean_rank))
    np.testing.assert_allclose(results[1], np.full(7, 2 * mean_rank))
    assert (full[layout.numel:] == 0).all()
    comm.free()

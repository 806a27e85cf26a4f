"""Corpus loading and the distributed sampler."""
import numpy as np
import pytest

from mpishard.data.corpus import BatchSampler, DataError, default_corpus_files, load_corpus


def test_default_corpus_is_deterministic():
    a, b = load_corpus(None, max_bytes=50_000), load_corpus(None, max_bytes=50_000)
    assert np.array_equal(a.train, b.train) and a.train.size + a.val.size == 50_000
    assert all(f.suffix == ".py" for f in default_corpus_files()[:20])


def test_sampler_disjoint_per_rank_and_resumable():
    data = np.arange(10_000, dtype=np.uint8)
    samplers = [BatchSampler(data, 16, 4, r, 3, seed=1) for r in range(3)]
    starts = []
    for s in samplers:
        x, y = s.next_batch()
        assert x.shape == (4, 16) and np.array_equal(x[:, 1:], y[:, :-1])
        starts.append({tuple(row) for row in x})
    assert not (starts[0] & starts[1]) and not (starts[1] & starts[2])
    peer = BatchSampler(data, 16, 4, 1, 3, seed=1)           # a tp peer of dp rank 1
    peer.next_batch()
    s = samplers[1]
    for _ in range(50):                                        # crosses epochs
        a, b = s.next_batch(), peer.next_batch()
        assert np.array_equal(a[0], b[0])
    state = s.state_dict()
    expected = [s.next_batch()[0] for _ in range(5)]
    resumed = BatchSampler(data, 16, 4, 1, 3, seed=1)
    resumed.load_state_dict(state)
    for e in expected:
        assert np.array_equal(resumed.next_batch()[0], e)


def test_too_little_data():
    with pytest.raises(DataError, match="fewer than one global batch"):
        BatchSampler(np.zeros(100, np.uint8), 16, 4, 0, 4)
    with pytest.raises(DataError, match="^100 bytes hold 6 windows"):
        BatchSampler(np.zeros(100, np.uint8), 16, 4, 0, 4)
    with pytest.raises(DataError, match="^100 tokens hold 6 windows"):   # token ids
        BatchSampler(np.zeros(100, np.uint16), 16, 4, 0, 4)

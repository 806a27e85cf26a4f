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


def _windows_per_step(data, dp, batch, micro, steps):
    """Each step's windows (their first bytes, sorted) over every dp rank and micro-batch."""
    samplers = [BatchSampler(data, 4, batch, r, dp, seed=3) for r in range(dp)]
    out = []
    for _ in range(steps):
        firsts = [int(x[0]) for _ in range(micro) for s in samplers for x in s.next_batch()[0]]
        out.append(sorted(firsts))
    return out


def test_every_split_of_a_global_batch_trains_on_the_same_windows_across_epochs():
    """Global batch 24 of 62 windows: 1 rank x 12 micro-batches of 2, 3 ranks x 4 of 2 and
    2 ranks x 2 of 6 draw the same windows each step, also in the steps that cross an
    epoch's end (a micro-batch of 6 used to drop the epoch's last windows where one of 2
    did not), and a sampler resumed mid-stream goes on alike."""
    data = np.arange(62 * 4 + 1, dtype=np.uint16)         # window w starts with 4 w
    one = _windows_per_step(data, 1, 2, 12, 9)              # 9 x 24 = 216: three epochs
    assert one == _windows_per_step(data, 3, 2, 4, 9) == _windows_per_step(data, 2, 6, 2, 9)
    assert all(len(step) == 24 for step in one)
    a = BatchSampler(data, 4, 5, 0, 1, seed=3)
    for _ in range(14):                                     # past the first epoch's end
        a.next_batch()
    b = BatchSampler(data, 4, 5, 0, 1, seed=3)
    b.load_state_dict(a.state_dict())
    assert a.state_dict() == {"epoch": 1, "index": 70 - 62}
    assert all(np.array_equal(a.next_batch()[0], b.next_batch()[0]) for _ in range(30))


def test_a_folder_of_text_skips_hidden_files_and_folders(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n" * 40)
    for hidden in (".git/objects/pack", ".venv/lib/x.py", "src/.cache/y.txt", ".hidden.txt"):
        (tmp_path / hidden).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / hidden).write_bytes(b"\xff" * 500)
    corpus = load_corpus(tmp_path)
    assert corpus.n_files == 1 and corpus.available == 240

"""What mpishard train reports: the thread warning (ranks x BLAS threads against cores)."""
from mpishard.run.report import thread_warning


def reports(n, host="node0"):
    return [{"host": host} for _ in range(n)]


def test_warns_when_ranks_times_threads_exceed_the_cores():
    # BLAS unset: every rank may start one thread per core.
    text = thread_warning(reports(2), environ={}, cores=8)
    assert text and "2 x 8 threads > 8 cores" in text[0] and "OMP_NUM_THREADS=4" in text[0]
    text = thread_warning(reports(4), environ={"OMP_NUM_THREADS": "4"}, cores=8)
    assert text and "4 x 4 threads > 8 cores" in text[0] and "OMP_NUM_THREADS=2" in text[0]


def test_quiet_when_the_threads_fit():
    assert thread_warning(reports(1), environ={}, cores=8) == []
    assert thread_warning(reports(4), environ={"OMP_NUM_THREADS": "2"}, cores=8) == []
    assert thread_warning(reports(2, "a") + reports(2, "b"), environ={"OMP_NUM_THREADS": "4"},
                          cores=8) == []
    # One thread per rank with more ranks than cores is a choice, not a setting to fix.
    assert thread_warning(reports(4), environ={"OMP_NUM_THREADS": "1"}, cores=2) == []


def test_a_resumed_metrics_file_continues_from_the_resumed_step(tmp_path):
    import json
    from types import SimpleNamespace

    from mpishard.run.report import MetricsFile

    path = tmp_path / "m.jsonl"
    earlier = [{"step": 0, "val_loss": 5.0}, {"step": 1, "loss": 4.0},
               {"step": 2, "loss": 3.5, "val_loss": 3.9}, {"step": 2, "val_loss": 3.8},
               {"step": 3, "loss": 3.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in earlier) + '{"step": 4, "lo')
    metrics = MetricsFile(str(path), SimpleNamespace(rank=0), resumed_at=2)
    metrics.write({"step": 2, "val_loss": 3.8})
    metrics.write({"step": 3, "loss": 3.1})
    metrics.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == \
        earlier[:3] + [{"step": 2, "val_loss": 3.8}, {"step": 3, "loss": 3.1}]
    MetricsFile(str(path), SimpleNamespace(rank=0)).close()         # a new run: afresh
    assert path.read_text() == ""
    MetricsFile(str(path), SimpleNamespace(rank=1), resumed_at=0).close()   # rank 0 writes
    assert path.read_text() == ""

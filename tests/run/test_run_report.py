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

"""The sync budget: a training step reads nothing back inside it, under every strategy.

On a GPU each host read (``float``, ``.item()``, ``int(mask.sum())``) waits for
all queued kernels. Counted on the strict module (benchmarks/syncs.py, which
prints the same figures), one GPT step as ``mpishard train`` runs it -- two
micro-batches, dropout, clipping -- under DDP and ZeRO-3 (float32 and float16),
ZeRO-1/2, tp2, pp2 and tp2 x pp2 (1F1B), at world sizes 1, 2 and 4, reads
``BUDGET`` = 0 values between its first launch and its last on every rank (the
norm, the clipping factor, the skip and the loss scale stay on the device), and the
loss once after the step, on the last pipeline stage.

    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi tests/testing/test_strict_syncs.py
"""
import importlib.util
from pathlib import Path

import pytest
from mpi4py import MPI

from parity import sub_world

_spec = importlib.util.spec_from_file_location(
    "bench_syncs", Path(__file__).resolve().parents[2] / "benchmarks" / "syncs.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(bench.LAYOUTS))
@pytest.mark.parametrize("size", bench.SIZES)
def test_a_step_reads_nothing_inside_and_the_loss_after(size, layout):
    if size > MPI.COMM_WORLD.size:
        pytest.skip(f"needs {size} ranks")
    if bench.LAYOUTS[layout][0](size) is None:
        pytest.skip(f"{layout} does not fit {size} ranks")
    with sub_world(size) as comm:
        if comm is None:
            return
        got = bench.measure(comm, layout, steps=2)
        assert max(got["syncs"]) <= bench.BUDGET, (layout, size, got["sites"])
        # the loss, read after the step: once, on the last stage (the counter works)
        assert max(got["after"]) <= 1
        assert comm.all_reduce_obj(max(got["after"]), op="max") == 1, (layout, size, got)
        if size > 1:   # gradients did go through the staging path, counted apart
            assert comm.all_reduce_obj(max(got["staged"]), op="max") > 0

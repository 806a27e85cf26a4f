"""Failure injection for tests: a rank that fails at start-up, the first N times.

A test puts this folder first on ``PYTHONPATH`` of a job and sets
``MPISHARD_TEST_FAIL_AT_START=RANK:N:COUNTER``: every Python process of the job
imports this module as it starts; the one of rank RANK starts MPI and exits with
status 1 (as a rank on a broken node, or one missing a library, fails before its
first step) while the counter file holds fewer than N marks, adding one each time.

It fails after MPI_Init, not before: under MPICH's launcher (Hydra) a rank that
exits before MPI_Init leaves the others waiting in MPI_Init, and the job never ends
(docs/checkpoints.md says what to do about such a hang).
"""
import os
import sys

_spec = os.environ.get("MPISHARD_TEST_FAIL_AT_START")
_rank = next((os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK") if v in os.environ),
             None)
if _spec and _rank is not None:
    _want, _times, _counter = _spec.split(":", 2)
    if _rank == _want:
        try:
            _done = len(open(_counter).read())
        except OSError:
            _done = 0
        if _done < int(_times):
            with open(_counter, "a") as _f:
                _f.write("x")
            sys.stderr.write(f"test: rank {_rank} fails at start-up ({_done + 1} of {_times})\n")
            sys.stderr.flush()
            from mpi4py import MPI      # noqa: F401  (MPI_Init)
            os._exit(1)                 # site would catch SystemExit and go on

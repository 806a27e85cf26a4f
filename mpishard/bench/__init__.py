"""Benchmarks that ship with mpishard (``mpishard bench <name>``).

Each benchmark module has a ``main(argv=None)`` that parses its own arguments, so
the CLI and the thin scripts in ``benchmarks/`` call the same code:

* :mod:`mpishard.bench.comm`: bus bandwidth of each collective through
  mpishard and through raw mpi4py, interleaved in one run.
* :mod:`mpishard.bench.calibrate`: a machine description for ``mpishard plan``.

:mod:`mpishard.bench.flags` holds their flag checks: a bad value or output path is
one line and exit status 2, before anything is measured.
"""

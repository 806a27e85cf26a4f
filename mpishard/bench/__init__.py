"""Benchmarks that ship with mpishard (``mpishard bench <name>``).

Each module has a ``main(argv=None) -> int`` that parses its own arguments, so
the CLI and the thin scripts in ``benchmarks/`` call the same code:

* :mod:`mpishard.bench.comm`: bus bandwidth of each collective through
  mpishard and through raw mpi4py, interleaved in one run.
"""

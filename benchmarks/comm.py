"""Collective bandwidth, mpishard against raw mpi4py (see mpishard/bench/comm.py).

    mpiexec -n 4 python benchmarks/comm.py
    mpiexec -n 4 python benchmarks/comm.py --sizes-mib 1 16 64 --iters 30 --json comm.json
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from mpishard.bench.comm import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env bash
# Download the wheels the GPU machine lacks into .whl/ (gitignored), for
# scripts/gpu_check.sh to install there without a network. See docs/gpu.md.
#
#   scripts/fetch_gpu_wheels.sh          # or: make gpu-wheels
#
# The GPU machine (python3 3.12, x86-64, CuPy, NumPy, pytest, mpi4py) has no
# MPI launcher: this fetches the MPICH wheel (mpiexec and libmpi), mpi4py
# built for Python 3.12 (its MPI ABI loader finds the wheel's libmpi through
# MPI4PY_LIBMPI, whatever mpi4py the machine has) and pytest-mpi (pure Python).
# Versions follow the project's .venv where it has them, so the GPU machine
# runs what the CPU test suite ran. Keeps one version of each (pip refuses two).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
DEST=${WHEELS:-.whl}

version() {  # version NAME FALLBACK: the version installed in $PY, else FALLBACK
    "$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || echo "$2"
}
PINS=("mpich==$(version mpich 5.0.2)" "mpi4py==$(version mpi4py 4.1.2)"
      "pytest-mpi==$(version pytest-mpi 0.6)")

staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$staging" "${PINS[@]}"

mkdir -p "$DEST"
rm -f "$DEST"/mpich-*.whl "$DEST"/mpi4py-*.whl "$DEST"/pytest_mpi-*.whl
mv "$staging"/*.whl "$DEST"/
ls -l "$DEST"
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "fetch_gpu_wheels: ${PINS[*]} in $DEST/, $((total / 1048576)) MiB" \
     "(copy them to the GPU node with the working tree: docs/gpu.md)"

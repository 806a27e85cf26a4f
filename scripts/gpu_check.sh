#!/usr/bin/env bash
# Exercise mpishard's CuPy communication paths on a GPU machine.
#
#   scripts/gpu_check.sh                   # uses .venv/bin/python, else python3
#   PYTHON=/path/to/python scripts/gpu_check.sh
#
# Needs CuPy (pip install 'mpishard[cuda12]') and at least one visible GPU.
# Runs, each with a time limit:
#   1. one process: pinned staging after the stream sync, the CUDA-aware and
#      Open MPI branches of DevicePath, all collectives on device arrays at
#      size 1, and an NCCL group of size 1 when NCCL loads;
#   2. two ranks, MPISHARD_CUDA_AWARE=0: every collective through pinned host
#      staging;
#   3. two ranks, detected CUDA-awareness: device buffers straight to MPI when
#      the library is CUDA-aware (the same as 2 otherwise; says which);
#   4. two ranks with comm_backend="nccl", only with >= 2 GPUs and NCCL
#      (NCCL refuses two ranks on one GPU);
#   5. the comm benchmark on device buffers, only with CUDA-aware MPI;
#   6. every autodiff op and a GPT training step on CuPy against NumPy
#      (scripts/gpu_train_check.py);
#   7. `mpishard train --backend cupy` with ZeRO-3 on two ranks.
# Exits non-zero on the first failure; prints "gpu_check: PASSED" at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
MPIEXEC=$(dirname "$PY")/mpiexec
[ -x "$MPIEXEC" ] || MPIEXEC=$(command -v mpiexec)
MPIFLAGS=()
if "$PY" -c 'from mpi4py import MPI; import sys; sys.exit(MPI.get_vendor()[0] != "Open MPI")'; then
    MPIFLAGS=(--oversubscribe --allow-run-as-root)
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1

GPUS=$("$PY" -c 'import cupy; print(cupy.cuda.runtime.getDeviceCount())' 2>/dev/null) || {
    echo "gpu_check: FAILED: CuPy does not import or sees no GPU (pip install 'mpishard[cuda12]')" >&2
    exit 2
}
[ "$GPUS" -ge 1 ] || { echo "gpu_check: FAILED: no GPU visible" >&2; exit 2; }
echo "gpu_check: $GPUS GPU(s), python $PY, mpiexec $MPIEXEC"

run() {  # run LIMIT_SECONDS COMMAND...
    local limit=$1; shift
    echo "== $*"
    timeout --kill-after=10 "$limit" "$@"
}

run 300 "$PY" scripts/gpu_check.py --part single
run 300 env MPISHARD_CUDA_AWARE=0 "$MPIEXEC" ${MPIFLAGS[@]+"${MPIFLAGS[@]}"} -n 2 "$PY" -m mpi4py scripts/gpu_check.py --part mpi
run 300 "$MPIEXEC" ${MPIFLAGS[@]+"${MPIFLAGS[@]}"} -n 2 "$PY" -m mpi4py scripts/gpu_check.py --part mpi

NCCL_OK=$("$PY" -c 'from mpishard.comm import nccl_available; print(int(nccl_available()[0]))')
if [ "$GPUS" -ge 2 ] && [ "$NCCL_OK" = 1 ]; then
    run 300 "$MPIEXEC" ${MPIFLAGS[@]+"${MPIFLAGS[@]}"} -n 2 "$PY" -m mpi4py scripts/gpu_check.py --part nccl
else
    echo "SKIP 2-rank NCCL: needs >= 2 GPUs and NCCL (GPUs: $GPUS, NCCL loads: $NCCL_OK)"
fi

AWARE=$("$PY" -c 'from mpishard.comm import detect_cuda_aware; print(int(detect_cuda_aware()[0]))')
if [ "$AWARE" = 1 ]; then
    run 300 "$MPIEXEC" ${MPIFLAGS[@]+"${MPIFLAGS[@]}"} -n 2 "$PY" benchmarks/comm.py --backend cupy --iters 10
else
    echo "SKIP device-buffer benchmark: MPI is not CUDA-aware"
fi
run 300 "$PY" scripts/gpu_train_check.py
run 300 "$MPIEXEC" ${MPIFLAGS[@]+"${MPIFLAGS[@]}"} -n 2 "$PY" -m mpi4py -m mpishard train \
    --backend cupy --strategy zero3 --steps 5 --n-layer 2 --n-embd 64 --n-head 4 \
    --block-size 64 --batch-size 4 --max-bytes 200000 --eval-batches 1 --progress false
echo "gpu_check: PASSED"

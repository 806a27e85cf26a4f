#!/usr/bin/env bash
# The GPU check: mpishard's GPU paths, most valuable first, one JSON report. See docs/gpu.md.
#
#   scripts/fetch_gpu_wheels.sh          # once, on a machine with the internet
#                                        # (make gpu-wheels): mpich, mpi4py, pytest-mpi into .whl/
#   scripts/gpu_check.sh                 # on the GPU machine (no internet needed)
#   scripts/gpu_check.sh --dry-run       # anywhere: the plan, each part's limit, the total
#   scripts/gpu_check.sh --rehearse      # without a GPU: the runner and parts on NumPy
#   scripts/gpu_check.sh --only env,collectives_1rank
#
# Installs from $WHEELS (default .whl/) what the python lacks, under
# /tmp/mpishard-gpu and without touching the network: pytest-mpi and mpi4py
# into site/ (first on PYTHONPATH), the MPICH wheel under mpich/ (its mpiexec,
# and the libmpi that mpi4py is pointed at with MPI4PY_LIBMPI, so launcher and
# library agree). Then scripts/gpu_check.py runs each part under its own hard
# limit (420 s for all together), every part with CUPY_CACHE_DIR set to one
# folder (cupy_kernel_cache beside the report unless CUPY_CACHE_DIR is set), and
# writes $OUT/gpu_check.json when OUT is set, else runs/gpu_check.json
# (GPU_CHECK_JSON overrides), with the full log beside it. Exit status: 0 all passed, 1 a part failed or timed out, 2 nothing
# could run (no CuPy, no GPU, a wheel that does not install); the JSON says why.
# --dry-run installs nothing and writes nothing.
#
# PYTHON picks the interpreter (default .venv/bin/python, else python3);
# WHEELS the wheel folder; INSTALL_WHEELS=yes|no overrides what is installed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=$(command -v python3); fi
fi
JSON=${GPU_CHECK_JSON:-${OUT:+$OUT/gpu_check.json}}
JSON=${JSON:-runs/gpu_check.json}
WHEELS=${WHEELS:-.whl}
PREFIX=/tmp/mpishard-gpu
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1

fail() {  # fail REASON: a report saying why (the Python runner never started), exit 2
    mkdir -p "$(dirname "$JSON")"
    printf '{"mode": "gpu", "status": "failed", "reason": "%s", "parts": []}\n' "$1" >"$JSON"
    echo "gpu_check: FAILED: $1 (report in $JSON)" >&2
    exit 2
}

if [ -z "$PY" ] || [ ! -x "$PY" ]; then fail "no python: set PYTHON or install python3"; fi
for arg in "$@"; do
    if [ "$arg" = --dry-run ]; then exec "$PY" scripts/gpu_check.py "$@"; fi
done

# Bring what this python lacks: pytest-mpi if it does not import; MPICH and a
# matching mpi4py if no mpiexec is at hand. INSTALL_WHEELS=yes|no overrides.
have_mpiexec=no
for m in "${MPIEXEC:-}" "$(dirname "$PY")/mpiexec" "$(command -v mpiexec || true)"; do
    if [ -n "$m" ] && [ -x "$m" ]; then have_mpiexec=yes; break; fi
done
shopt -s nullglob
wanted=()
case ${INSTALL_WHEELS:-auto} in
    yes) wanted=("$WHEELS"/*.whl) ;;
    no) ;;
    *)
        "$PY" -c "import pytest_mpi" 2>/dev/null || wanted+=("$WHEELS"/pytest_mpi-*.whl)
        [ $have_mpiexec = yes ] || wanted+=("$WHEELS"/mpich-*.whl "$WHEELS"/mpi4py-*.whl) ;;
esac
mpich=() others=()
for w in "${wanted[@]}"; do
    case $(basename "$w") in mpich-*) mpich+=("$w") ;; *) others+=("$w") ;; esac
done
PIP=(-m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
     --disable-pip-version-check)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ ${#others[@]} -gt 0 ]; then
    rm -rf "$PREFIX/site"
    "$PY" "${PIP[@]}" --target "$PREFIX/site" "${others[@]}" ||
        fail "pip could not install ${others[*]} into $PREFIX/site"
    export PYTHONPATH="$PREFIX/site:$PYTHONPATH"
fi
if [ ${#mpich[@]} -gt 0 ]; then
    # --prefix, not --target: pip --target drops a wheel's data files (lib/libmpi.so*).
    "$PY" "${PIP[@]}" --prefix "$PREFIX/mpich" "${mpich[@]}" ||
        fail "pip could not install ${mpich[*]} into $PREFIX/mpich"
    [ -e "$PREFIX/mpich/lib/libmpi.so.12" ] || fail "the mpich wheel has no lib/libmpi.so.12"
    export MPI4PY_LIBMPI="$PREFIX/mpich/lib/libmpi.so.12" MPIEXEC="$PREFIX/mpich/bin/mpiexec"
    export PATH="$PREFIX/mpich/bin:$PATH"
elif [ $have_mpiexec = no ]; then
    echo "gpu_check: no mpiexec and no mpich wheel in $WHEELS/: multi-rank parts will fail" \
         "(run scripts/fetch_gpu_wheels.sh where there is internet)" >&2
fi
export GPU_CHECK_INSTALLED="${wanted[*]:-none}"
echo "gpu_check: python $PY; wheels installed: $GPU_CHECK_INSTALLED; report $JSON"
rm -f "$JSON"
"$PY" scripts/gpu_check.py --json "$JSON" "$@"
rc=$?
[ -s "$JSON" ] || fail "scripts/gpu_check.py exited with status $rc and wrote no report"
exit $rc

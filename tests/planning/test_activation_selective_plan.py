"""The layout plan of selective recomputation (attention's core, and by op) against what
a run of it holds.

    OMP_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py -m pytest -q --with-mpi \
        tests/planning/test_activation_selective_plan.py

As tests/planning/test_layout_plan.py (its models, batch and tolerance: the
activations and the bus bytes per mesh group to 5%), for layouts that recompute
attention's core: GPT with dropout and Llama under tensor parallelism with sequence
parallelism, under context parallelism (ring and all-to-all), and in a pipeline with
data parallelism; and recomputation by op (whole blocks keeping every second
product's output) under tensor, sequence, context and pipeline parallelism. Measured
on a second step, as mpishard train does.
"""
import pytest

from mpishard.planning.layout import Layout, estimate_layout
from test_layout_plan import MODELS, B, T, _check, _close, _run, _world, spec_id

SELECTIVE = [  # model, Layout fields beyond dp x tp x pp's (dp, tp, pp default to 1)
    ("gpt-dropout", dict(dp=2, tp=2, sequence_parallel=True, strategy="zero1")),
    ("llama", dict(dp=2, tp=2, sequence_parallel=True, strategy="zero3", micro_batches=2)),
    ("gpt", dict(dp=2, cp=2, strategy="ddp")),
    ("llama", dict(dp=2, cp=2, cp_mode="all-to-all", strategy="zero2")),
    ("gpt-dropout", dict(dp=2, pp=2, strategy="zero1", micro_batches=2)),
]


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec", SELECTIVE, ids=spec_id)
def test_selective_layout_plan_matches_the_run(spec):
    world = _world()
    name, fields = spec
    cls, cfg = MODELS[name]
    layout = Layout(**{"batch_size": B, "seq_len": T, "selective": True, **fields})
    plan = estimate_layout(cls(cfg, materialize_now=False), layout)
    mesh, run, _opt, bus = _run(cls(cfg, materialize_now=False), layout, world)
    activations = run.measured_activations
    want = plan.stages[mesh.pp_rank]
    _close(activations, want.activation_bytes, f"rank {world.rank} activations")
    for axis, n in bus.items():   # the core's exchange of keys and values runs again
        _close(n, want.bus_bytes.get(axis, 0), f"rank {world.rank} {axis} bus bytes")


BY_OP = [  # recomputed by op: each block's input and its 1st, 3rd, ... products' outputs
    ("gpt-dropout", dict(dp=2, tp=2, sequence_parallel=True, strategy="zero1")),
    ("llama", dict(dp=2, tp=2, sequence_parallel=True, strategy="zero3", micro_batches=2)),
    ("llama", dict(dp=2, cp=2, strategy="ddp")),
    ("gpt-dropout", dict(dp=2, pp=2, strategy="zero1", micro_batches=2)),
]


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec", BY_OP, ids=spec_id)
def test_by_op_layout_plan_matches_the_run(spec):
    """Model state, transient peaks, activations and bus bytes per mesh group, as
    tests/planning/test_layout_plan.py checks every layout."""
    name, fields = spec
    _check(name, Layout(**{"batch_size": B, "seq_len": T, "activation_checkpointing": True,
                           "keep_products": True, **fields}), _world())

"""The memory plan with offload against the ledger, and what offload adds to a step's time.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py -m pytest --with-mpi -q \\
        tests/planning/test_offload_plan.py

After one step of DDP, ZeRO-1 and ZeRO-3 with optimizer offload and ZeRO-3 with
parameter offload, in float32 and bfloat16, on NumPy and on the CuPy-strict module
(device and host memory apart): the plan's device bytes per category are the
ledger's device bytes, its host bytes the ledger's host bytes (all but the
page-locked staging copy only CuPy allocates), and the transient peaks within 5%.
ZeRO-1 with bfloat16 gradients (``reduce_dtype``) and optimizer offload planned
through a :class:`Layout`, as ``mpishard plan --reduce-dtype bfloat16`` plans it:
4 bytes per padded parameter on the device.
"""
import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import Communicator, Mesh
from mpishard.core.backend import Backend
from mpishard.models import GPT, GPTConfig
from mpishard.optim import AdamW
from mpishard.parallel import DataParallel, Precision, ZeRO
from mpishard.planning import load_machine
from mpishard.planning.layout import Layout, estimate_layout
from mpishard.planning.memory import estimate_memory
from mpishard.planning.offload import HostTraffic, offload_seconds

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=3, n_head=4, n_embd=96)
RUNS = [("ddp", "optimizer"), ("zero1", "optimizer"), ("zero3", "optimizer"),
        ("zero3", "params")]


def _one_step(kind, offload, world, precision, backend):
    mesh = Mesh(world, dp=world.size)
    if kind == "ddp":
        strategy = DataParallel(GPT(CONFIG, seed=0, backend=backend), mesh,
                                precision=precision, offload=offload)
    else:
        stage = int(kind[-1])
        strategy = ZeRO(GPT(CONFIG, seed=0, backend=backend, materialize_now=stage != 3),
                        mesh, stage=stage, precision=precision, offload=offload)
    opt = AdamW(strategy.parameters(), lr=1e-3, ledger=strategy.ledger)
    opt.allocate_state()
    strategy.ledger.reset_peak()
    x = np.random.default_rng(world.rank).integers(0, 256, (1, 16))
    _, loss = strategy(x, x)
    strategy.scale_loss(loss).backward()
    strategy.step(opt)
    return strategy, opt   # the optimizer owns its state: keep it alive


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["numpy", "strict"])
@pytest.mark.parametrize("precision", [None, "bfloat16"])
@pytest.mark.parametrize("kind,offload", RUNS)
def test_plan_puts_every_category_where_the_ledger_finds_it(kind, offload, precision, backend):
    world = Communicator(MPI.COMM_WORLD)
    plan = estimate_memory(GPT(CONFIG, materialize_now=False), kind, world.size,
                           precision=precision, offload=offload)
    strategy, opt = _one_step(kind, offload, world, precision, Backend.resolve(backend))
    ledger = strategy.ledger
    device, host = ledger.bytes_by_category(), ledger.host_bytes_by_category()
    assert {c: device[c] for c in plan.steady} == plan.steady
    staging = plan.host["comm"]      # CuPy only: NumPy and the strict module cast in place
    targets = sum(t.data.size for t in opt.params)
    assert staging == (2 * targets if precision else 0)
    assert {c: host[c] for c in plan.host} == {**plan.host, "comm": 0}
    assert host["optim"] == 8 * targets and device["optim"] == 0
    peak = ledger.peak_by_category()
    for cat, predicted in plan.peak.items():
        assert abs(peak[cat] - predicted) <= 0.05 * max(predicted, 1), (cat, peak[cat], predicted)


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_bfloat16_gradients_plan_four_device_bytes_per_parameter_under_zero1_offload():
    """ZeRO-1, bfloat16 compute and gradients, optimizer offload, on the CuPy-strict
    module: the layout's plan is the ledger's, device and host, per category; on the
    device 2 + 2 bytes per padded parameter (docs/offload.md), half the gradient bytes of
    float32 reduction, and 2 bytes instead of 4 per element in the reduce-scatter."""
    world = Communicator(MPI.COMM_WORLD)
    layout = Layout(dp=world.size, strategy="zero1", precision="bfloat16", batch_size=1,
                    seq_len=16, offload="optimizer", reduce_dtype="bfloat16")
    assert layout.policy == Precision("bfloat16", reduce_dtype="bfloat16")
    plan = estimate_layout(GPT(CONFIG, materialize_now=False), layout).busiest.memory
    strategy, opt = _one_step("zero1", "optimizer", world, layout.policy,
                              Backend.resolve("strict"))
    device = strategy.ledger.bytes_by_category()
    host = strategy.ledger.host_bytes_by_category()
    assert {c: device[c] for c in plan.steady} == plan.steady
    assert {c: host[c] for c in plan.host} == {**plan.host, "comm": 0}   # no CuPy staging
    padded = sum(u.layout.padded for u in strategy.units)
    assert plan.model_state_bytes == 4 * padded and plan.steady["optim"] == 0
    fp32 = estimate_layout(GPT(CONFIG, materialize_now=False),
                           Layout(dp=world.size, strategy="zero1", precision="bfloat16",
                                  batch_size=1, seq_len=16, offload="optimizer"))
    assert 2 * plan.steady["grads"] == fp32.busiest.memory.steady["grads"]
    share = (world.size - 1) / world.size      # reduce-scatter 2 (or 4) + all-gather 2 bytes
    assert plan.bus_bytes_by_group["dp_shard_cp"] == round(share * padded * (2 + 2))
    assert fp32.busiest.memory.bus_bytes_by_group["dp_shard_cp"] == \
        round(share * padded * (4 + 2))


def test_a_reduce_dtype_needs_a_16_bit_precision():
    """A Layout refuses 16-bit gradients of float32 compute and bfloat16 ones reduced in
    float16, naming the value and the fix."""
    with pytest.raises(ValueError, match="reduce_dtype='bfloat16' needs a 16-bit precision"):
        Layout(precision="float32", reduce_dtype="bfloat16")
    with pytest.raises(ValueError, match="use reduce_dtype='float32' or set loss_scale"):
        Layout(precision="bfloat16", reduce_dtype="float16")
    assert Layout(precision="float16", reduce_dtype="float16").policy.loss_scale == "dynamic"


def test_estimate_memory_refuses_an_offload_the_strategy_would():
    """What DataParallel and ZeRO refuse, the plan refuses too (it planned DDP's
    parameters in host memory, and an unknown value as optimizer offload)."""
    model = GPT(CONFIG, materialize_now=False)
    with pytest.raises(ValueError, match="DataParallel cannot offload its parameters"):
        estimate_memory(model, "ddp", 2, offload="params")
    with pytest.raises(ValueError, match="offload='bogus' is not one of none, optimizer"):
        estimate_memory(model, "zero1", 2, offload="bogus")
    assert estimate_memory(model, "zero3", 2, offload="params").host["params"] > 0


def test_offload_moves_the_state_the_docs_table_says():
    """Per parameter on one rank, bfloat16 (docs/offload.md's table): DDP 18 -> 6 bytes
    on the device and 16 on the host; ZeRO-3 with ``params`` 0 on the device (the
    gradient shards land in host memory too) and 18 on the host, + CuPy's staging."""
    n = GPT(CONFIG, materialize_now=False).num_parameters()
    for kind, offload, device, host in (("ddp", "optimizer", 6, 16),
                                        ("zero3", "params", 0, 18)):
        plain = estimate_memory(GPT(CONFIG, materialize_now=False), kind, 1,
                                precision="bfloat16")
        moved = estimate_memory(GPT(CONFIG, materialize_now=False), kind, 1,
                                precision="bfloat16", offload=offload)
        assert plain.model_state_bytes == pytest.approx(18 * n, rel=0.01)
        assert moved.model_state_bytes == pytest.approx(device * n, rel=0.01, abs=1)
        assert sum(moved.host.values()) - moved.host["comm"] == pytest.approx(host * n, rel=0.01)


def test_plan_says_and_plans_the_gradients_dtype_asked_for():
    """``mpishard plan --reduce-dtype bfloat16`` on a GPU (bfloat16 compute unless asked):
    the header names the gradients' dtype, the JSON holds it, and ZeRO-1's ranks over
    dp = 2 hold fewer bytes than with float32 reduction (half the full gradients)."""
    import json

    from ckpt_scripts.common import run_mpishard as mpishard
    base = ("plan", "--preset", "gpt-tiny", "--ranks", "2", "--machine", "h100-sxm")
    out = mpishard(*base, "--reduce-dtype", "bfloat16")
    assert out.returncode == 0, out.stderr
    assert "on h100-sxm (bfloat16, gradients in bfloat16);" in out.stdout
    peaks = {}
    for reduce in ("float32", "bfloat16"):
        js = mpishard(*base, "--strategy", "zero1", "--top", "200", "--json",
                      "--reduce-dtype", reduce)
        assert js.returncode == 0, js.stderr
        doc = json.loads(js.stdout)
        assert (doc["precision"], doc["reduce_dtype"]) == ("bfloat16", reduce)
        peaks[reduce] = {tuple(v for k, v in lay.items() if k not in (
            "peak_bytes", "step_s", "tokens_per_s", "mfu", "exposed_comm_s", "breakdown",
            "bubble", "host_bytes")): lay["peak_bytes"] for lay in doc["layouts"]
            if lay["dp"] == 2}
    assert peaks["float32"] and peaks["float32"].keys() == peaks["bfloat16"].keys()
    assert all(peaks["bfloat16"][k] < peaks["float32"][k] for k in peaks["float32"])


def test_copies_and_host_update_are_timed_on_the_host_link():
    """1 GB each way over the H200's 52.8 GB/s PCIe link in 2 copies, and 28 bytes per
    element of AdamW for 1e9 elements at 614.4 GB/s shared by 8 ranks."""
    h200 = load_machine("h200")
    traffic = HostTraffic(to_host=10**9, to_device=10**9, copies=2, host_bytes=28 * 10**9)
    t = offload_seconds(traffic, h200, 8)
    assert t["offload copies"] == pytest.approx(2e9 / 52.8e9 + 2e-5)
    assert t["host optimizer"] == pytest.approx(28e9 * 8 / 614.4e9)
    assert offload_seconds(None, h200, 8) == {}
    bare = load_machine("h200").__class__(**{**h200.__dict__, "host_link": None})
    with pytest.raises(ValueError, match="host_link"):
        offload_seconds(traffic, bare, 8)


def test_plan_lists_offloaded_layouts_where_nothing_else_fits():
    """Llama 3.1 8B in bfloat16 keeps 145 GB of AdamW state: on one H200 every layout
    that fits offloads, and at 24 GiB only ZeRO-3's parameter offload fits; each row
    says what it offloads and what share of its step the copies take."""
    import json

    from ckpt_scripts.common import run_mpishard as mpishard
    out = mpishard("plan", "--preset", "llama3.1-8b", "--ranks", "1", "--machine", "h200",
                   "--top", "40")
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.strip()[:1].isdigit()
            and (" zero" in line or " ddp " in line)]
    assert rows and all("optimizer (" in row or "params (" in row for row in rows)
    assert "offload copies" in out.stdout and "host optimizer" in out.stdout
    js = mpishard("plan", "--preset", "llama3.1-8b", "--ranks", "1", "--machine", "h200",
                  "--memory-budget", "24GiB", "--json")
    assert js.returncode == 0, js.stderr
    layouts = json.loads(js.stdout)["layouts"]
    assert layouts and {lay["offload"] for lay in layouts} == {"params"}
    for lay in layouts:
        assert lay["peak_bytes"] <= 24 * 2**30 and lay["strategy"] == "zero3"
        copies = lay["breakdown"]["offload copies"]
        assert 0.1 < copies / lay["step_s"] < 0.5 and lay["breakdown"]["optimizer"] == 0.0
        assert lay["host_bytes"] > 140e9

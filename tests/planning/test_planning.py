"""The layout planner's time model, piece by piece, with hand-computed values; the shipped
machine descriptions; `mpishard plan` and `mpishard bench calibrate`.

The accuracy of the whole model (against runs measured here and published ones)
is benchmarks/plan_accuracy.py's, never a timed test.
"""
import json
import re

import numpy as np
import pytest

from mpishard.models import GPT, GPTConfig
from mpishard.parallel import bubble_fraction
from mpishard.planning.layout import Layout
from mpishard.planning import (Link, candidate_layouts, load_machine, machine_from_dict,
                               predict_step, shipped_machines, stage_flops)
from mpishard.planning.cost import _exposed, group_spans_nodes
from mpishard.planning.machine import MACHINES_DIR

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=8)
TOY = {"name": "toy", "kind": "gpu", "ranks_per_node": 4, "overlap": True,
       "device": {"flops": {"float32": 1e9}, "matmul_efficiency": 0.5,
                  "memory_bytes": 1e9, "memory_bandwidth": 1e9},
       "links": {"intra": {"latency_s": 1e-3, "bandwidth": 1e6},
                 "inter": {"latency_s": 1e-2, "bandwidth": 1e5}}}


def test_a_collective_costs_its_latency_per_call_plus_bus_bytes_over_bandwidth():
    assert Link(1e-3, 1e6).seconds(2e6, calls=3) == pytest.approx(3e-3 + 2.0)
    m = machine_from_dict(TOY)
    assert m.link("all_reduce", 4, spans_nodes=False) == Link(1e-3, 1e6)
    assert m.link("all_reduce", 8, spans_nodes=True) == Link(1e-2, 1e5)
    fitted = machine_from_dict({**TOY, "collectives": {
        "all_reduce@4": {"latency_s": 2e-4, "bandwidth": 5e8},
        "all_reduce@4/inter": {"latency_s": 5e-4, "bandwidth": 1e8}}})
    assert fitted.link("all_reduce", 4, False) == Link(2e-4, 5e8)        # calibrated
    assert fitted.link("all_reduce", 4, True) == Link(5e-4, 1e8)
    assert fitted.link("all_gather", 4, False) == Link(1e-3, 1e6)       # not fitted: the link
    # rails (see [Note: rails]): a ring across nodes runs on a NIC per rank of a node, up
    # to the node's own link; sends and all-to-alls, and a node of one NIC, on one
    railed_links = {**TOY["links"], "inter": {**TOY["links"]["inter"], "rails": 4}}
    railed = machine_from_dict({**TOY, "links": railed_links})
    assert railed.link("all_gather", 8, True, per_node=2).bandwidth == 2e5
    assert railed.link("reduce_scatter", 16, True, per_node=4).bandwidth == 4e5
    assert railed.link("all_reduce", 64, True, per_node=4).bandwidth == 4e5  # 4 NICs
    assert railed.link("all_reduce", 64, True, 8, ranks_per_node=16).bandwidth == 2e5
    assert railed.link("all_reduce", 8, True).bandwidth == 1e5               # one a node
    assert railed.link("send", 8, True, per_node=4).bandwidth == 1e5
    assert railed.link("all_to_all", 8, True, per_node=4).bandwidth == 1e5
    assert railed.link("all_reduce", 4, False, per_node=4) == Link(1e-3, 1e6)  # inside
    fast_nics = machine_from_dict({**TOY, "links": {**TOY["links"], "inter": {
        "latency_s": 1e-2, "bandwidth": 4e5, "rails": 4}}})
    assert fast_nics.link("all_reduce", 8, True, per_node=4).bandwidth == 1e6  # NVLink's
    assert m.link("all_reduce", 8, True, per_node=4) == Link(1e-2, 1e5)      # rails 1
    # two NICs for four ranks: two groups of 2 a node share them, one each
    assert railed.link("all_reduce", 8, True, 2, ranks_per_node=8).bandwidth == 1e5
    assert railed.link("all_reduce", 8, True, 4, ranks_per_node=8).bandwidth == 2e5
    # a calibrated line across nodes is no cap on the rails (the node's own link is)
    slow = machine_from_dict({**TOY, "links": railed_links, "collectives": {
        "all_reduce@8": {"latency_s": 1e-3, "bandwidth": 2e4}}})
    assert slow.link("all_reduce", 8, True, per_node=4).bandwidth == 4e5
    assert m.matmul_seconds(1e9, "float32") == pytest.approx(2.0)      # 1e9 at 0.5 x 1e9/s
    assert m.activation_seconds(1e9) == pytest.approx(3.0)             # three streams
    rated = machine_from_dict({**TOY, "device": {**TOY["device"], "activation_rate": 4e8,
                                                 "optimizer_rate": 2e9,
                                                 "optimizer_overhead_s": 1e-3}})
    assert rated.activation_seconds(1e9) == pytest.approx(2.5)
    assert rated.activation_seconds(1e9, "rmsnorm-swiglu") == pytest.approx(2.5)  # not rated
    by_ops = machine_from_dict({**TOY, "device": {**TOY["device"], "activation_rate": 4e8,
                                                  "activation_rates": {"rmsnorm-swiglu": 5e8}}})
    assert by_ops.activation_seconds(1e9, "rmsnorm-swiglu") == pytest.approx(2.0)
    assert by_ops.activation_seconds(1e9, "layernorm-gelu") == pytest.approx(2.5)
    with pytest.raises(ValueError, match="device.activation_rates.rmsnorm-swiglu=0"):
        machine_from_dict({**TOY, "device": {**TOY["device"],
                                             "activation_rates": {"rmsnorm-swiglu": 0}}})
    assert m.optimizer_seconds(1e9, 10) == pytest.approx(2.0)            # read and write
    assert rated.optimizer_seconds(1e9, 10) == pytest.approx(0.5 + 0.01)
    assert rated.grad_norm_seconds(1e9) == 0.0                          # not calibrated
    paths = machine_from_dict({**TOY, "device": {
        **TOY["device"], "optimizer_rate": 1e9, "optimizer_rates": [[64e6, 4e9], [0, 1e9]],
        "optimizer_overhead_s": 0.0, "grad_norm_rate": 5e9}})
    assert paths.optimizer_seconds(32e6, 1) == pytest.approx(32e6 / 1e9)   # NumPy's passes
    assert paths.optimizer_seconds(64e6, 1) == pytest.approx(64e6 / 4e9)   # compiled loop
    assert paths.grad_norm_seconds(1e9) == pytest.approx(0.2)
    for bad, match in (([[0, -1.0]], "optimizer_rates\\[0\\] rate=-1.0"), ([1, 2], "must be"),
                       ([[-1, 1e9]], "optimizer_rates\\[0\\] bytes=-1")):
        with pytest.raises(ValueError, match=match):
            machine_from_dict({**TOY, "device": {**TOY["device"], "optimizer_rates": bad}})


@pytest.mark.parametrize("pp,m,want", [(1, 8, 0.0), (2, 2, 1 / 3), (4, 4, 3 / 7),
                                       (4, 12, 3 / 15)])
def test_the_pipeline_bubble_is_p_minus_1_slots_of_m_plus_p_minus_1(pp, m, want):
    assert bubble_fraction(pp, m) == pytest.approx(want)


def test_overlap_rules_hide_what_runs_behind_compute():
    times = {"compute": 1.0, "backward": 0.6, "attention": 0.2}
    ddp = Layout(dp=4, strategy="ddp", seq_len=16)
    assert _exposed(ddp, "dp_cp", 0.5, 5, times, True) == pytest.approx(0.1)    # last bucket
    assert _exposed(ddp, "dp_cp", 0.9, 3, times, True) == pytest.approx(0.3)    # 0.9 - 0.6
    z3 = Layout(dp=4, strategy="zero3", seq_len=16)
    assert _exposed(z3, "dp_shard_cp", 0.8, 8, times, True) == pytest.approx(0.1)
    assert _exposed(z3, "dp_shard_cp", 1.5, 10, times, True) == pytest.approx(0.5)
    z1 = Layout(dp=4, strategy="zero1", seq_len=16)
    assert _exposed(z1, "dp_shard_cp", 1.6, 4, times, True) == pytest.approx(0.8 + 0.2)
    ring = Layout(cp=2, seq_len=16)
    assert _exposed(ring, "cp", 0.5, 10, times, True) == pytest.approx(0.3)
    assert _exposed(ring, "tp", 0.5, 10, times, True) == 0.5             # tensor parallel
    assert _exposed(z3, "dp_shard_cp", 0.8, 8, times, False) == 0.8      # no overlap (CPU)


def test_a_group_spans_nodes_when_its_ranks_do():
    lay = Layout(dp=4, tp=2, dp_replicate=2, seq_len=16)        # world 8: tp inner
    assert not group_spans_nodes(lay, "tp", 4)
    assert not group_spans_nodes(lay, "dp_shard", 4)            # ranks 0, 2
    assert group_spans_nodes(lay, "dp_replicate", 4)            # ranks 0, 4
    assert group_spans_nodes(lay, "dp", 2)                      # ranks 0, 2, 4, 6
    piped = Layout(dp=2, pp=2, seq_len=16)                      # stages 0-1 and 2-3
    assert group_spans_nodes(piped, "tied", 2) and not group_spans_nodes(piped, "tied", 4)
    experts = Layout(dp=4, ep=2, seq_len=16)                    # blocks (0, 1) and (2, 3)
    assert not group_spans_nodes(experts, "ep", 2) and group_spans_nodes(experts, "ep", 1)
    assert not group_spans_nodes(experts, "edp_shard", 3)       # ranks 0, 2
    assert group_spans_nodes(experts, "edp_shard", 2)


def test_a_group_crosses_nodes_on_a_nic_per_rank_it_has_on_a_node():
    """ZeRO-3 over two nodes of 8 H100s gathers at NVLink's rate (8 NICs a node, 8 ranks
    of the group on each); Megatron's data-parallel group under tp = 8 (one rank a node)
    on one NIC; the pipeline's ends on one."""
    from mpishard.planning.cost import group_ranks_on_node
    h100 = load_machine("h100-sxm")
    zero3 = Layout(dp=16, strategy="zero3", seq_len=16)
    assert group_ranks_on_node(zero3, "dp_shard_cp", 8) == 8
    megatron = Layout(dp=2, tp=8, seq_len=16)
    assert group_ranks_on_node(megatron, "dp", 8) == 1
    assert group_ranks_on_node(Layout(dp=4, tp=2, pp=2, seq_len=16), "tied", 8) == 1
    assert group_ranks_on_node(Layout(dp=4, tp=4, seq_len=16), "dp", 8) == 2
    assert group_ranks_on_node(Layout(dp=8, cp=3, seq_len=24), "dp", 8) == 2  # 3, 3, 2
    # a stage's own groups: stage 1 of dp 3 x tp 4 x pp 2 starts at rank 12, mid-node
    staged = Layout(dp=3, tp=4, pp=2, seq_len=16)
    assert group_ranks_on_node(staged, "dp", 8, stage=1) == 1
    assert group_ranks_on_node(staged, "dp", 8) == 1             # ranks 0, 4 | 8
    assert group_spans_nodes(staged, "dp", 16, stage=1)          # ranks 12 | 16, 20
    assert not group_spans_nodes(staged, "dp", 16)               # ranks 0, 4, 8
    assert h100.link("all_gather", 16, True, 8).bandwidth == h100.intra.bandwidth
    assert h100.link("all_reduce", 2, True, 1).bandwidth == h100.inter.bandwidth == 50e9
    assert h100.link("all_reduce", 4, True, 2).bandwidth == 100e9


def test_stage_flops_count_every_product_by_hand():
    model = GPT(CFG, materialize_now=False)
    lay = Layout(batch_size=2, seq_len=16)
    fl = stage_flops(model, lay)
    rows, C, V, T = 32, 8, 64, 16
    per_block = 2 * rows * (C * 3 * C + C * C + C * 4 * C + 4 * C * C)
    attention = 4 * 2 * T * T * C                   # scores and weighted values, all heads
    assert fl["blocks"] == pytest.approx(2 * (per_block + attention))
    assert fl["rest"] == pytest.approx(2 * rows * C * V)                 # the head
    assert fl["attention"] == pytest.approx(2 * attention)


def test_a_predicted_step_adds_up_its_parts():
    machine = machine_from_dict(TOY)
    lay = Layout(dp=2, strategy="ddp", batch_size=2, seq_len=16)
    cost = predict_step(lambda: GPT(CFG, materialize_now=False), lay, machine)
    assert cost.seconds == pytest.approx(sum(cost.breakdown.values()))
    assert cost.breakdown["bubble"] == 0.0 and "comm dp" in cost.breakdown
    flops = stage_flops(GPT(CFG, materialize_now=False), lay)
    assert cost.model_flops == pytest.approx(3 * (flops["blocks"] + flops["rest"]) * 2)
    assert cost.tokens_per_s == pytest.approx(2 * 2 * 16 / cost.seconds)
    pipe = predict_step(lambda: GPT(CFG, materialize_now=False),
                        Layout(pp=2, strategy="ddp", batch_size=1, seq_len=16,
                               micro_batches=2), machine)
    assert pipe.breakdown["bubble"] > 0


def test_recomputation_adds_its_forward_products_to_the_predicted_compute():
    """Full recomputation adds the blocks' forward products, selective only attention's
    (the scores and the weighted values); the model FLOPs stay the same."""
    machine, make = machine_from_dict(TOY), lambda: GPT(CFG, materialize_now=False)
    base = dict(strategy="ddp", batch_size=2, seq_len=16)
    costs = {name: predict_step(make, Layout(**base, **extra), machine)
             for name, extra in (("none", {}), ("full", {"activation_checkpointing": True}),
                                 ("selective", {"selective": True}))}
    fl = stage_flops(make(), Layout(**base))
    rate = 0.5 * 1e9                                           # TOY: efficiency x peak
    extra = {name: costs[name].breakdown["matmul"] - costs["none"].breakdown["matmul"]
             for name in ("full", "selective")}
    assert extra["selective"] == pytest.approx(fl["attention"] / rate, rel=0.05)
    assert extra["full"] > extra["selective"] > 0
    assert costs["none"].model_flops == costs["selective"].model_flops == costs["full"].model_flops
    with pytest.raises(ValueError, match="pass one of them"):
        Layout(**base, selective=True, activation_checkpointing=True)


def test_the_optimizer_term_is_the_state_the_update_touches():
    """ZeRO-1/2 keep whole parameters (and gradients) but update only their shard: the
    optimizer reads and writes that shard's values, gradients and two AdamW states, as
    much as ZeRO-3's, and clipping's norm reads the shard's gradients (ZeRO-1's whole
    buffer is not read); DDP updates and clips everything."""
    from mpishard.planning.layout import estimate_layout
    norm_rate = 5e8
    machine = machine_from_dict({**TOY, "device": {**TOY["device"], "optimizer_rate": 1e9,
                                                   "optimizer_overhead_s": 0.0,
                                                   "grad_norm_rate": norm_rate}})
    make = lambda: GPT(CFG, materialize_now=False)        # noqa: E731
    got, memory = {}, {}
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        lay = Layout(dp=4, strategy=strategy, batch_size=1, seq_len=16)
        memory[strategy] = mem = estimate_layout(make(), lay).stages[0].memory
        got[strategy] = predict_step(make, lay, machine).breakdown["optimizer"]
        shard_grads = mem.steady["optim"] / 2              # float32, one per AdamW state pair
        clipped = mem.steady["grads"] if strategy == "ddp" else shard_grads
        assert mem.clipped_grad_bytes == clipped
        assert got[strategy] == pytest.approx(2 * mem.steady["optim"] / 1e9
                                              + clipped / norm_rate)
    assert memory["zero1"].steady["grads"] > 3 * memory["zero1"].clipped_grad_bytes
    assert got["zero1"] == got["zero2"] == got["zero3"]
    n = sum(int(np.prod(p.shape)) for p in make().parameters())
    assert got["ddp"] == pytest.approx(16 * n / 1e9 + 4 * n / norm_rate)   # value, gradient,
    assert got["zero3"] < got["ddp"] / 3                   # 2 states; a quarter, plus padding


def test_shipped_machines_load_and_name_their_sources():
    names = shipped_machines()
    assert {"a100-80gb", "h100-sxm", "h200", "cpu-2core"} <= set(names)
    for name in names:
        m = load_machine(name)
        assert m.sources and m.memory_bytes > 0
    assert load_machine("h100-sxm").peak("bfloat16") == pytest.approx(989e12)


@pytest.mark.parametrize("change, words", [
    (dict(device={"flops": {}}), "device.flops needs"),
    (dict(device={"flops": {"float32": -1.0}, "memory_bytes": 1, "memory_bandwidth": 1}),
     "device.flops.float32=-1.0 must be a positive number"),
    (dict(kind="tpu"), "kind='tpu' must be 'gpu' or 'cpu'"),
    (dict(links={"intra": {"latency_s": 0, "bandwidth": 0}}), "links.intra.bandwidth=0"),
    (dict(links={"intra": {"bandwidth": 1}, "inter": {"bandwidth": 1, "rails": 0}}),
     "links.inter.rails=0 must be an integer >= 1"),
    (dict(device={**TOY["device"], "matmul_efficiency": 50}),
     "device.matmul_efficiency=50 must be in (0, 1], a share of the peak (0.8 for 80%)"),
    (dict(device={**TOY["device"], "elementwise_efficiency": 1.5}),
     "device.elementwise_efficiency=1.5 must be in (0, 1]"),
    (dict(device={**TOY["device"], "flash_attention_efficiency": 0}),
     "device.flash_attention_efficiency=0 must be in (0, 1]"),
    (dict(links={"intra": {"bandwidth": 1, "processor_usage": 1.5}}),
     "links.intra.processor_usage=1.5 must be in [0, 1)"),
    (dict(ranks_per_node=2.5), "ranks_per_node=2.5 must be an integer >= 1 (ranks on each node)"),
    (dict(cores=0), "cores=0 must be an integer >= 1"),
    (dict(overlap="no"), "overlap='no' must be true or false"),
    (dict(device={**TOY["device"], "matmul_efficency": 0.5}),
     "unknown key 'matmul_efficency' in device; did you mean 'matmul_efficiency'? "
     "(notes go in \"sources\")"),
    (dict(note="measured by hand"), "unknown key 'note' at the top level; did you mean 'name'?"),
    (dict(links={"intra": {"bandwidth": 1, "latency": 1e-5}}),
     "unknown key 'latency' in links.intra; did you mean 'latency_s'?"),
    (dict(host_link={"bandwidth": 1, "rails": 2}),
     "unknown key 'rails' in host_link; the keys there are latency_s, bandwidth"),
    (dict(collectives={"allreduce@4": {"latency_s": 0, "bandwidth": 1}}),
     "collectives key 'allreduce@4' must be kind@ranks or kind@ranks/inter (e.g. "
     "\"all_reduce@4\"), kind one of all_reduce, all_gather, reduce_scatter, all_to_all, "
     "send; did you mean 'all_reduce@4'?"),
    (dict(device=[1e9]), "device is a JSON list, not an object"),
    (dict(device={**TOY["device"], "flops": {"bfloat_16": 1e12}}),
     "unknown key 'bfloat_16' in device.flops; did you mean 'bfloat16'?"),
    (dict(device={**TOY["device"], "vector_flops": {"fp16": 1e12}}),
     "unknown key 'fp16' in device.vector_flops; did you mean 'float16'?"),
    (dict(device={**TOY["device"], "activation_rates": {"rmsnorm-swigl": 1e9}}),
     "unknown key 'rmsnorm-swigl' in device.activation_rates; did you mean 'rmsnorm-swiglu'?"),
    (dict(device={**TOY["device"], "matmul_efficiency_table": 5}),
     "device.matmul_efficiency_table=5 must be [[size, efficiency], ...]"),
])
def test_a_bad_machine_description_is_refused_naming_the_field(change, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        machine_from_dict({**TOY, **change})
    with pytest.raises(ValueError, match="or one of a100-80gb"):
        load_machine("no-such-machine")


def test_a_machine_file_of_anything_but_one_object_is_one_error_line(tmp_path, monkeypatch,
                                                                     capsys):
    import sys
    import threading
    from mpishard.cli.main import main
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)        # main() installs its own
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    listed = tmp_path / "m.json"
    listed.write_text(json.dumps([TOY]))
    with pytest.raises(ValueError, match="the file holds a JSON list, not an object"):
        load_machine(listed)
    assert main(["plan", "--ranks", "2", "--machine", str(listed)]) == 2
    assert capsys.readouterr().err == (
        f"mpishard: error: machine description {listed}: the file holds a JSON list, not an "
        f"object; a description is one JSON object, as `mpishard bench calibrate -o "
        f"machine.json` writes\n")
    raw = json.loads((MACHINES_DIR / "cpu-2core.json").read_text())
    raw["device"]["matmul_efficiency"] = 50
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw))
    assert main(["plan", "--ranks", "2", "--machine", str(bad)]) == 2
    assert capsys.readouterr().err == ("mpishard: error: machine description: device."
                                       "matmul_efficiency=50 must be in (0, 1], a share of "
                                       "the peak (0.8 for 80%)\n")


def test_notes_under_sources_take_any_key():
    raw = {**TOY, "sources": {"*": "measured by hand", "my note": "rack 4, BIOS 2.1"}}
    assert machine_from_dict(raw).sources["my note"] == "rack 4, BIOS 2.1"
    calibrated = {**TOY, "collectives": {"all_reduce@4/inter": {"latency_s": 0,
                                                                "bandwidth": 2e5}}}
    assert machine_from_dict(calibrated).link("all_reduce", 4, True).bandwidth == 2e5


def test_candidates_respect_the_model_and_the_batch():
    layouts = candidate_layouts(8, 4, seq_len=16, global_batch=8, n_layer=2, n_head=2)
    assert layouts and all(lay.tp <= 2 and lay.pp <= 2 for lay in layouts)
    assert all(lay.dp * lay.cp * lay.tp * lay.pp == 8 for lay in layouts)
    assert all(8 % lay.dp == 0 and lay.batch_size * lay.micro_batches * lay.dp == 8
               for lay in layouts)
    assert any(lay.dp_replicate > 1 for lay in layouts)


def test_plan_prints_a_ranked_table_and_json():
    from ckpt_scripts.common import run_mpishard as mpishard
    out = mpishard("plan", "--preset", "gpt2", "--ranks", "8", "--ranks-per-node", "8",
                   "--machine", "h100-sxm", "--global-batch", "64", "--top", "3")
    assert out.returncode == 0, out.stderr
    assert "layouts of 8 ranks on h100-sxm (bfloat16)" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.strip()[:2] in ("1 ", "2 ", "3 ")]
    assert len(rows) == 3
    js = mpishard("plan", "--preset", "gpt2", "--ranks", "8", "--machine", "h100-sxm",
                  "--global-batch", "64", "--top", "4", "--json")
    assert js.returncode == 0, js.stderr
    plan = json.loads(js.stdout)
    steps = [lay["step_s"] for lay in plan["layouts"]]
    assert len(steps) == 4 and steps == sorted(steps)
    assert all(lay["peak_bytes"] <= 80e9 for lay in plan["layouts"])
    bad = mpishard("plan", "--preset", "gpt2", "--ranks", "8", "--machine", "nope")
    assert bad.returncode != 0 and "no machine description 'nope'" in bad.stderr


def test_calibrate_fits_lines_and_writes_a_description_plan_reads(tmp_path):
    from mpishard.bench.calibrate import fit_line
    a, b = fit_line([1, 2, 3, 4], [3, 5, 7, 9])
    assert (a, b) == pytest.approx((1.0, 2.0))
    a, b = fit_line([1, 2, 3], [2, 1.9, 1.8])          # no slower when larger (noise)
    assert a == 0.0 and b > 0
    a, b = fit_line([1, 2], [1, 2.5])                 # a negative intercept: through 0
    assert a == 0.0 and b == pytest.approx(6 / 5)
    from ckpt_scripts.common import run_mpishard as mpishard
    path = tmp_path / "m.json"
    out = mpishard("bench", "calibrate", "-o", str(path), "--repeats", "2", n=2, timeout=300)
    assert out.returncode == 0, out.stderr
    machine = load_machine(path)
    assert machine.kind == "cpu" and machine.peak("float32") > 1e8
    assert "all_reduce@2" in machine.collectives and machine.activation_rate > 0
    assert set(machine.activation_rates) == {"layernorm-gelu", "rmsnorm-swiglu"}
    assert machine.activation_rate == machine.activation_rates["layernorm-gelu"]  # GPT's
    assert [b for b, _ in machine.optimizer_rates] == [0, 16 * (1 << 22)]   # by kernel path
    assert machine.optimizer_rate == machine.optimizer_rates[0][1] and machine.grad_norm_rate > 0
    assert set(machine.busy_slowdown) == {2} and machine.busy_slowdown[2] > 0
    plan = mpishard("plan", "--preset", "gpt-tiny", "--ranks", "2", "--machine", str(path),
                    "--vocab-size", "256", "--batch-size", "4", "--json")
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["layouts"][0]["step_s"] > 0
    assert np.isfinite(json.loads(plan.stdout)["layouts"][0]["mfu"])
    # a second "launch" twice as fast in products: the merged description plans with
    # the median, between the two
    raw = json.loads(path.read_text())
    raw["device"]["flops"] = {k: 2 * v for k, v in raw["device"]["flops"].items()}
    faster = tmp_path / "m2.json"
    faster.write_text(json.dumps(raw))
    merged = tmp_path / "merged.json"
    out = mpishard("bench", "calibrate", "--merge", str(path), str(faster), "-o", str(merged))
    assert out.returncode == 0, out.stderr
    assert load_machine(merged).peak("float32") == pytest.approx(1.5 * machine.peak("float32"))
    bad = mpishard("bench", "calibrate", "--merge", str(path), str(tmp_path / "none.json"))
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1].startswith("mpishard: error: --merge ")
    assert "none.json: cannot read it" in bad.stderr and "Traceback" not in bad.stderr
    same = mpishard("bench", "calibrate", "--merge", str(path), str(faster), "-o", str(path))
    assert same.returncode != 0 and "is one of the calibrations to merge" in same.stderr
    assert load_machine(path).peak("float32") == machine.peak("float32")     # untouched


def test_merged_calibrations_take_the_median_of_each_measurement_and_agree_on_the_rest():
    from mpishard.planning import merge_calibrations
    raw = json.loads((MACHINES_DIR / "cpu-2core.json").read_text())
    raw["device"]["optimizer_rates"] = [[0, 7e9], [16 << 22, 3e10]]     # as calibrate writes
    raw["device"]["grad_norm_rate"] = 7.5e9

    def launch(scale):
        out = json.loads(json.dumps(raw))
        out["device"]["flops"]["float32"] *= scale
        out["collectives"]["all_reduce@4"]["bandwidth"] *= scale
        out["busy_slowdown"]["4"] *= scale
        out["device"]["optimizer_rates"][1][1] *= scale
        return out
    merged = merge_calibrations([("a", launch(1.0)), ("b", launch(1.3)), ("c", launch(0.8))],
                                name="median")
    m = machine_from_dict(merged)
    base = machine_from_dict(raw)
    assert m.name == "median" and m.peak("float32") == pytest.approx(base.peak("float32"))
    assert m.busy_slowdown[4] == pytest.approx(base.busy_slowdown[4])
    assert m.optimizer_rates == base.optimizer_rates       # thresholds agree, rates median
    assert m.collectives == base.collectives
    assert "the median of 3 calibrations (a: " in m.sources["*"]
    two = merge_calibrations([("a", launch(1.0)), ("b", launch(1.5))])
    assert machine_from_dict(two).peak("float32") == pytest.approx(1.25 * base.peak("float32"))
    other = launch(1.0)
    del other["collectives"]["send@4"]
    with pytest.raises(ValueError, match=r"^a and b differ at collectives\.send@4 \(only a has"):
        merge_calibrations([("a", launch(1.0)), ("b", other)])
    other = launch(1.0)
    other["device"]["grad_norm_rate"] = None
    with pytest.raises(ValueError, match=r"differ at device\.grad_norm_rate \(a number "
                                         r"against a null\)"):
        merge_calibrations([("a", launch(1.0)), ("b", other)])
    other = launch(1.0)
    other["cores"] = None
    with pytest.raises(ValueError, match=r"differ at cores \(a number against a null\)"):
        merge_calibrations([("a", launch(1.0)), ("b", other)])
    other["overlap"] = 1                     # each file is read first: a flag is true or false
    with pytest.raises(ValueError, match=r"^b: machine description: overlap=1 must be true "
                                         r"or false"):
        merge_calibrations([("a", launch(1.0)), ("b", other)])
    with pytest.raises(ValueError, match=r"^b: not a machine description \(a JSON object\)"):
        merge_calibrations([("a", launch(1.0)), ("b", [1, 2])])
    other = launch(1.0)
    other["cores"] = 8
    with pytest.raises(ValueError, match=r"^a and b differ at cores \(2 against 8\)"):
        merge_calibrations([("a", launch(1.0)), ("b", other)])
    other = launch(1.0)
    other["device"]["optimizer_rates"][1][0] = 1024
    with pytest.raises(ValueError, match=r"differ at device\.optimizer_rates\.1\.0"):
        merge_calibrations([("a", launch(1.0)), ("b", other)])
    with pytest.raises(ValueError, match="two or more descriptions, got 1"):
        merge_calibrations([("a", raw)])
    with pytest.raises(ValueError, match="^h100: kind='gpu': only calibrations"):
        merge_calibrations([("a", raw), ("h100", json.loads(
            (MACHINES_DIR / "h100-sxm.json").read_text()))])


def test_each_family_s_elementwise_work_goes_at_the_rate_of_its_own_ops():
    """A Llama's blocks (RMS norm, SwiGLU) are costed at the calibrated rate of those ops,
    a GPT's (layer norm, GELU) at theirs: the same kept bytes, rates 2x apart, twice
    the elementwise seconds."""
    from mpishard.bench.calibrate import _activation_step
    from mpishard.models import Llama, LlamaConfig, spec_of
    cpu = {**TOY, "kind": "cpu", "overlap": False,
           "device": {**TOY["device"], "activation_rate": 1e8,
                      "activation_rates": {"layernorm-gelu": 1e8, "rmsnorm-swiglu": 2e8}}}
    machine = machine_from_dict(cpu)
    llama = LlamaConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_kv_head=1,
                        n_embd=8, intermediate_size=24)
    layout = Layout(seq_len=16, batch_size=2)
    for make, ops in ((lambda: GPT(CFG, materialize_now=False), "layernorm-gelu"),
                      (lambda: Llama(llama, materialize_now=False), "rmsnorm-swiglu")):
        assert spec_of(make()).elementwise == ops
        fast = predict_step(make, layout, machine).breakdown["elementwise"]
        one = machine_from_dict({**cpu, "device": {**cpu["device"], "activation_rates": {}}})
        slow = predict_step(make, layout, one).breakdown["elementwise"]
        assert fast == pytest.approx(slow / (2 if ops == "rmsnorm-swiglu" else 1), rel=0.05)
        step, kept = _activation_step(64, 8, 2, 16, ops)
        step()
        assert kept > 64 * 8 * 4
    with pytest.raises(ValueError, match="expected one of layernorm-gelu, rmsnorm-swiglu"):
        _activation_step(64, 8, 2, 16, "layernorm-relu")


def test_ranks_sharing_a_node_slow_compute_as_calibrated_and_the_bubble_by_turns():
    """[Note: ranks sharing a node]: compute and the optimizer take the calibrated
    ``busy_slowdown`` times as long (times the extra turns beyond what was measured),
    the bubble ``share`` times; without a calibration, compute takes ``share`` too."""
    cpu = {**TOY, "kind": "cpu", "cores": 2, "overlap": False}
    plain = machine_from_dict(cpu)
    assert plain.slowdown(4) == plain.share(4) == 2.0 and plain.slowdown(2) == 1.0
    measured = machine_from_dict({**cpu, "busy_slowdown": {"2": 1.1, "4": 2.5}})
    assert measured.slowdown(1) == 1.0 and measured.slowdown(2) == 1.1
    assert measured.slowdown(3) == pytest.approx(1.1 * 1.5)     # 1.5 turns, 1 measured
    assert measured.slowdown(8) == pytest.approx(2.5 * 2)       # 4 turns, 2 measured
    with pytest.raises(ValueError, match="busy_slowdown.4"):
        machine_from_dict({**cpu, "busy_slowdown": {"4": -1}})

    model = lambda: GPT(CFG, materialize_now=False)  # noqa: E731
    layout = Layout(dp=2, pp=2, strategy="ddp", batch_size=2, seq_len=16, micro_batches=2)
    b = predict_step(model, layout, plain, ranks_per_node=4).breakdown
    assert b["shared node"] == pytest.approx(b["matmul"] + b["elementwise"] + b["bubble"])
    c = predict_step(model, layout, measured, ranks_per_node=4).breakdown
    assert c["shared node"] == pytest.approx(1.5 * (c["matmul"] + c["elementwise"])
                                             + c["bubble"])
    assert c["optimizer"] == pytest.approx(b["optimizer"] / 2 * 2.5)
    alone = predict_step(model, layout, measured, ranks_per_node=1)
    assert "shared node" not in alone.breakdown


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_busy_slowdown_is_measured_for_every_group_size_with_either_workload():
    """``_busy_slowdown`` times a workload on 1 rank and on ``n`` at once for each group
    size that divides the world: a model's training step (``model_step``), or, for a model
    too large for every rank to train a copy, its products and a block's ops."""
    from mpi4py import MPI

    from mpishard.bench.calibrate import _activation_step, _busy_slowdown, _products, \
        model_step
    from mpishard.comm import Communicator
    world = Communicator(MPI.COMM_WORLD)
    sizes = {n for n in range(2, world.size + 1) if world.size % n == 0}
    step = model_step(GPT(CFG, materialize_now=False), 16, CFG.vocab_size)
    blocks = lambda rows: (lambda: (_products([(rows, 8, 24)])(),  # noqa: E731
                                    _activation_step(rows, 8, 2, 16)[0]()))
    for steps in (step, blocks):
        slowdown = _busy_slowdown(world, steps, 64, 3, lambda text: None)
        assert set(slowdown) == sizes
        assert all(0.2 < f < 10 * world.size for f in slowdown.values())


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_busy_step_lasts_until_its_slowest_rank_finishes():
    """A training step ends at its next collective, which waits for the slowest rank:
    with rank 1 taking three times rank 0's time (asleep, so no core is shared), every
    rank's step lasts rank 1's, 3x what rank 0 alone takes, not the 2x of their mean."""
    import time as clock

    from mpi4py import MPI

    from mpishard.bench.calibrate import _busy_slowdown
    from mpishard.comm import Communicator
    world = Communicator(MPI.COMM_WORLD)

    def steps(rows):
        return lambda: clock.sleep(0.06 if world.rank == 1 else 0.02)
    slowdown = _busy_slowdown(world, steps, 64, 3, lambda text: None)
    assert slowdown[2] == pytest.approx(3.0, rel=0.15)


def test_a_gpu_plan_follows_the_attention_choice_in_time_and_memory():
    """On a GPU machine the plan builds its models as the device runs them (the strict
    module's rules): with ``MPISHARD_ATTENTION=fused`` attention is costed as the flash
    kernels and keeps no T x T weights; with the default batched choice both the time
    and the memory count the weights, as that run would."""
    from ckpt_scripts.common import run_mpishard as mpishard
    from mpishard.cli.plan import plan_backend
    figures = {}
    for choice in ("batched", "fused"):
        out = mpishard("plan", "--preset", "gpt2", "--ranks", "8", "--machine", "h100-sxm",
                       "--global-batch", "32", "--strategy", "zero3",
                       "--top", "1000", "--json", env={"MPISHARD_ATTENTION": choice},
                       timeout=300)
        assert out.returncode == 0, out.stderr
        mine = [lay for lay in json.loads(out.stdout)["layouts"]
                if (lay["dp"], lay["dp_replicate"], lay["micro_batch"], lay["micro_batches"],
                    lay["activation_checkpointing"], lay["virtual_stages"]) ==
                (8, 1, 4, 1, False, 1)]
        assert len(mine) == 1, choice
        figures[choice] = (mine[0]["breakdown"]["compute attention"], mine[0]["peak_bytes"])
    assert figures["fused"][0] < 0.8 * figures["batched"][0]
    weights = 12 * 4 * 12 * 1024 * 1024 * 4          # layers x batch x heads x T^2 float32
    assert figures["batched"][1] - figures["fused"][1] > 0.9 * weights
    assert plan_backend(load_machine("h100-sxm")).name == "strict"
    assert plan_backend(load_machine("cpu-2core")).name == "numpy"


def test_the_search_also_ranks_layouts_recomputed_by_op():
    """A checkpointed layout that fits is tried recomputed by op too (every second
    product's output kept): between plain and full in memory, ranked before full where
    it fits, left out where it does not."""
    import dataclasses
    from mpishard.planning.layout import estimate_layout
    from mpishard.planning.search import format_table, rank_layouts
    cfg = GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=4, n_embd=128)

    def make():
        return GPT(cfg, materialize_now=False)
    layouts = [Layout(1, 1, 1, "ddp", "bfloat16", batch_size=8, seq_len=256,
                      activation_checkpointing=ac) for ac in (False, True)]
    plain, full = (estimate_layout(make(), lay).total_peak_bytes for lay in layouts)
    op = estimate_layout(make(), dataclasses.replace(layouts[1], keep_products=True))
    assert full < op.total_peak_bytes < plain
    machine = load_machine("h100-sxm")
    ranked, over = rank_layouts(make, layouts, machine,
                                memory_bytes=(op.total_peak_bytes + plain) // 2)
    assert over == 1
    assert [r.layout.keep_products for r in ranked] == [True, False]
    assert ranked[0].cost.seconds < ranked[1].cost.seconds
    assert "  op " in format_table(ranked).splitlines()[2]
    ranked, _ = rank_layouts(make, layouts, machine,
                             memory_bytes=(full + op.total_peak_bytes) // 2)
    assert [r.layout.keep_products for r in ranked] == [False]

"""The planner against the published Megatron-LM runs (``benchmarks/plan_accuracy.py
--published-only``): the targets of issue "Reproduce the published tables".

    pytest -q tests/planning/test_published_accuracy.py

A change to the step-time model, the machine descriptions or the memory plan that
moves the published errors past a target fails here, not silently in the README.
"""
import importlib.util
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_accuracy.py"


@pytest.fixture(scope="module")
def accuracy():
    spec = importlib.util.spec_from_file_location("plan_accuracy", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("plan_accuracy", module)
    spec.loader.exec_module(module)
    start = time.perf_counter()
    result = module.published()
    return module, result, time.perf_counter() - start


def test_the_published_part_takes_seconds(accuracy):
    _, result, seconds = accuracy
    assert len(result["rows"]) >= 19
    assert seconds < 15, f"the published runs took {seconds:.1f} s to predict"


def test_errors_meet_the_targets_with_both_signs(accuracy):
    """The issue's targets: median |error| <= 5%, worst <= 10%, Korthikanti Table 5's
    mean <= 3.5%, errors of both signs (a change that moves a figure past them fails)."""
    module, result, _ = accuracy
    assert result["signs"] == ["+", "-"]
    assert result["median_abs_error"] <= module.MEDIAN_TARGET
    assert result["worst_abs_error"] <= module.WORST_TARGET
    assert result["table5_mean_abs_error"] <= module.TABLE5_TARGET


def test_a_reduction_the_paper_did_not_overlap_is_exposed(accuracy):
    """Korthikanti's Section 6.3 run reduces gradients with no overlap, as the paper says:
    its data-parallel all-reduce is exposed where the dp = 1 run of Table 5 has none."""
    _, result, _ = accuracy
    rows = {r["id"]: r for r in result["rows"]}
    assert rows["korthikanti2022_sec6.3_530B_dp8_present_work"]["breakdown"]["comm dp"] > 0.1
    assert rows["korthikanti2022_table5_530B_present_work"]["breakdown"].get("comm dp", 0) == 0


def test_every_published_run_fits_its_gpu_by_the_plan(accuracy):
    """The planned peak of the busiest stage within the GPU's memory less its reserve."""
    _, result, _ = accuracy
    for row in result["rows"]:
        assert row["peak_gib"] <= row["usable_gib"], row["id"]


def test_the_readme_and_the_docs_quote_the_figures_the_code_prints(accuracy):
    """The published runs' median, worst and Table 5 figures, the NeMo rows' bound and the
    other stacks' range, and the memory the Hopper layouts plan, as the benchmark prints
    them, are the README's and docs/planning.md's (and the tightest layout's,
    docs/concepts.md's): a change that moves them fails here until the docs follow."""
    module, result, _ = accuracy
    root = BENCH.parents[1]
    readme, planning = ((root / f).read_text() for f in ("README.md", "docs/planning.md"))
    median, worst, table5 = (f"{result[k]:.1%}" for k in (
        "median_abs_error", "worst_abs_error", "table5_mean_abs_error"))
    assert f"{median} median error (worst {worst}, both signs; {table5} mean on " \
        f"Korthikanti's Table 5) on {len(result['rows'])} published" in readme
    assert f"Median absolute error **{median}** over the {len(result['rows'])} runs" in planning
    assert f"worst **{worst}**" in planning and f"eight runs **{table5}**" in planning
    rows = module.hopper()
    nemo = f"{max(abs(r['error']) for r in rows if r['framework'] == 'nemo'):.1%}"
    others = [abs(r["error"]) for r in rows if r["framework"] != "nemo"]
    fast = f"{min(others):.1%}".rstrip("%") + f"-{max(others):.1%} fast"
    assert f"8-2304 H100s within {nemo} (" in readme and f"runs predicted {fast})" in readme
    assert f"All six are within\n{nemo}" in planning or f"All six are within {nemo}" in planning
    assert f"(Megatron-Core's, within {nemo})" in planning
    # the memory each Hopper layout plans: NeMo's range, llm-foundry's, the tightest
    # (405B on 576 GPUs) in docs/planning.md and docs/concepts.md
    concepts = (root / "docs" / "concepts.md").read_text()

    def peaks(framework):
        return [r["peak_gib"] for r in rows if r["framework"] == framework]
    nemo_gib, foundry_gib = peaks("nemo"), peaks("llm-foundry")
    quoted = " ".join(planning.split())
    assert f"({min(nemo_gib):.1f}-{max(nemo_gib):.1f} GiB per GPU)" in quoted
    assert f"llm-foundry's three ({min(foundry_gib):.1f}-{max(foundry_gib):.1f} GiB)" in quoted
    tightest = {r["id"]: r for r in rows}["dgxc_nemo2409_h100_bf16_llama3.1_405b_576gpu"]
    assert tightest["peak_gib"] == max(nemo_gib)
    usable = f"{tightest['usable_gib']:.1f}"
    assert f"fit the {usable} GiB an H100 leaves" in quoted
    assert f"fits at {tightest['peak_gib']:.1f} GiB because ZeRO-1's" in quoted
    assert f"({tightest['peak_gib']:.1f} GiB planned per GPU;" in concepts


def test_the_planning_docs_table_of_published_runs_is_what_the_benchmark_prints(accuracy):
    """docs/planning.md's table of the published Megatron-LM runs: every run once, its
    published and predicted seconds to the third decimal and its error as
    ``plan_accuracy.py --published-only`` prints them."""
    _, result, _ = accuracy
    rows = {r["id"]: r for r in result["rows"]}
    planning = (BENCH.parents[1] / "docs" / "planning.md").read_text()
    quoted = []
    for line in planning.splitlines():
        if not line.startswith(("| Narayanan ", "| Korthikanti ")):
            continue
        label, published, predicted, error = (c.strip() for c in line.strip("|").split("|"))
        author, size = label.split()[:2]
        if author == "Narayanan":
            ids = [f"narayanan2021_table1_{size}"]
        elif "Section 6.3" in label:
            ids = [f"korthikanti2022_sec6.3_{size}_dp8_present_work"]
        else:
            assert "full / present" in label, line
            ids = [f"korthikanti2022_table5_{size}_{k}" for k in ("full_recompute",
                                                                   "present_work")]
        runs = [rows[i] for i in ids]
        assert published == " / ".join(f"{r['published_s']:.3f}" for r in runs), line
        assert predicted == " / ".join(f"{r['predicted_s']:.3f}" for r in runs), line
        assert error == " / ".join(f"{r['error']:+.1%}" for r in runs), line
        quoted += ids
    assert sorted(quoted) == sorted(rows), "a published run missing or twice in the table"


def test_the_sequence_sweep_localises_llm_foundrys_error_as_the_docs_say():
    """llm-foundry's MPT-1B from 512 to 32,768 tokens (its README's rows; a diagnostic):
    the error shrinks as attention's share grows, and the fit the benchmark prints (the
    published steps as a x the predicted rest + b x the predicted attention) is the one
    docs/planning.md quotes."""
    spec = importlib.util.spec_from_file_location("plan_accuracy", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sweep = module.sequence_sweep()
    h100 = sorted((r for r in sweep["rows"] if r["machine"] == "h100-sxm"),
                  key=lambda r: r["attention_share"])
    assert len(h100) == 7 and h100[0]["attention_share"] < 0.15 < 0.8 < \
        h100[-1]["attention_share"]
    assert [r["error"] for r in h100] == sorted(r["error"] for r in h100)
    planning = (BENCH.parents[1] / "docs" / "planning.md").read_text()
    fit, old = sweep["fits"]["h100-sxm"], sweep["fits"]["a100-80gb"]
    quoted = " ".join(planning.split())
    assert f"fit as {fit['rest']:.2f} x the predicted rest" in quoted
    assert f"plus {fit['attention']:.2f} x the predicted attention" in quoted
    assert f"fit as {old['rest']:.2f} x the rest and {old['attention']:.2f} x attention" \
        in quoted
    assert f"from {h100[0]['error']:.1%} to {h100[-1]['error']:.1%} on the H100s" in quoted


def test_torchtitan_op_policy_recomputes_every_second_block_product():
    """torchtitan's ``selective_ac_option = "op"`` saves every op's output but every second
    ``aten.mm`` of a block (counted per block) and recomputes the rest of its non-matmul
    kernels; the fused attention is saved. ``KernelSet(selective="core")`` (Megatron-LM's,
    mpishard's) repeats attention's core only."""
    from mpishard.models import Llama, LlamaConfig
    from mpishard.planning.gpu_time import FLASH2_KERNELS, TORCHTITAN_KERNELS, stage_ops
    from mpishard.planning.layout import Layout
    cfg = LlamaConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_kv_head=2,
                      n_embd=64, intermediate_size=128)
    model = Llama(cfg, materialize_now=False)
    layout = Layout(1, 1, 1, "ddp", "bfloat16", batch_size=1, seq_len=64, selective=True)
    op = stage_ops(model, layout, 2, TORCHTITAN_KERNELS)
    products = [o for o in op if o.matrix and o.block and not o.flash]
    assert len(products) == 2 * 7                           # q, k, v, o, gate, up, down
    assert [o.selective for o in products[:7]] == [False, True, False, True, False, True,
                                                   False]
    assert not any(o.selective for o in op if o.flash)
    assert all(o.selective for o in op if o.block and not o.matrix and not o.flash)
    core = stage_ops(model, layout, 2, FLASH2_KERNELS)
    assert [o for o in core if o.selective] == [o for o in core if o.core]


def test_hopper_references_are_predicted_on_their_own_hardware():
    """Every Hopper reference has a prediction; torchtitan's at both ends of its GPUs'
    peak range (its benchmark: between the NVL's and the SXM's) with their 2.4 TB/s."""
    spec = importlib.util.spec_from_file_location("plan_accuracy", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = {r["id"]: r for r in module.hopper()}
    titan = [k for k in rows if k.startswith("torchtitan")]
    assert len(titan) == 8 and len(rows) == 17        # Tables 1 and 3, eager and compiled
    for run in {k.split(" @")[0] for k in titan}:
        low, high = sorted((k for k in titan if k.startswith(run + " @")),
                           key=lambda k: rows[k]["predicted_tokens_per_s_per_gpu"])
        assert "NVL" in low and "SXM" in high
    # NVIDIA's NeMo recipes (Megatron-Core on H100s, 8 to 2304 GPUs): the target
    nemo = [r for r in rows.values() if r["framework"] == "nemo"]
    assert len(nemo) == 6
    assert all(abs(r["error"]) <= module.HOPPER_TARGET for r in nemo), \
        {r["id"]: round(r["error"], 3) for r in nemo}
    # docs/planning.md quotes them within 1.9%: the multi-node rows' reductions cross
    # nodes on a NIC per GPU (see [Note: rails]); on one NIC a rank the 8B's 128-GPU row
    # was 3.2% slow
    assert max(abs(r["error"]) for r in nemo) < 0.02, {r["id"]: round(r["error"], 4)
                                                         for r in nemo}
    assert "nemo: 6 of 6 within 10%" in "; ".join(
        f"{k}: {v}" for k, v in module.hopper_summary(list(rows.values())).items())
    # as mpishard would run them (its flash kernels, a device's memory): every layout fits
    # the 70.5 GiB an H100 leaves; the tightest, 405B on 576 GPUs (ZeRO-1, bfloat16
    # gradients), only because its float32 gradient shard exists at the step alone (see
    # [Note: stage 1's gradient shard]): 69.1 GiB, 71.8 with that shard held always
    fits = {r["id"]: r["peak_gib"] <= r["usable_gib"] for r in nemo}
    assert all(fits.values()), fits
    assert rows["dgxc_nemo2409_h100_bf16_llama3.1_405b_576gpu"]["peak_gib"] > 69
    # and the other stacks' layouts too: llm-foundry's; torchtitan's recomputed by op
    # (mpishard's "op": every second product's output kept), on its 96 GB parts
    assert all(r["peak_gib"] <= r["usable_gib"] for r in rows.values()), \
        {k: (round(r["peak_gib"], 1), round(r["usable_gib"], 1)) for k, r in rows.items()}
    titan = rows["torchtitan2024_h100_llama3.1_8b_fsdp_table1 @NVL peak"]
    assert 85 < titan["usable_gib"] < 86 and titan["peak_gib"] < 60


def test_torchtitans_eager_ops_account_for_what_torch_compile_saves():
    """torchtitan's tables give the same runs with and without torch.compile, which fuses
    each block's ops: 0.386 s (8 GPUs) and 0.408 s (128) less a step of 16,384 tokens a
    GPU. The kernel model's count of the eager ops (RMSNorm's 8 kernels, the complex
    rotary product, silu then the product) against the compiled blocks' fused kernels
    predicts 0.432 s for both, within 15% of either, at either end of the peak range
    (memory-bound kernels: the peak does not move them); a model that fused both would
    predict nothing saved."""
    spec = importlib.util.spec_from_file_location("plan_accuracy", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = {r["id"]: r for r in module.hopper() if r["framework"].startswith("torchtitan")}

    def step(row, key):       # seconds a step: each GPU's 2 sequences of 8192 tokens
        return 2 * 8192 / row[key]
    pairs = 0
    for key, eager in rows.items():
        if "_compile" in key:
            continue
        compiled = rows[key.replace("_fsdp_", "_fsdp_compile_")]
        published, predicted = (step(eager, k) - step(compiled, k) for k in (
            "published_tokens_per_s_per_gpu", "predicted_tokens_per_s_per_gpu"))
        assert 0.38 < published < 0.41 and predicted == pytest.approx(published, rel=0.15), \
            (key, published, predicted)
        pairs += 1
    assert pairs == 4


def test_repredict_crosses_stored_runs_with_stored_calibrations(accuracy, tmp_path):
    """``--repredict``: every stored run predicted from every calibration, scored as a
    measured run is (its rows' own figures, the mean over the pairs)."""
    import json
    module, _, _ = accuracy
    results = Path(module.__file__).parent / "results" / "2026-12-05"
    run = json.loads((results / "plan_accuracy_optimizer_paths.json").read_text()
                     .strip().splitlines()[-1])["measured_here"]
    few = {"measured_here": {"rows": run["rows"][:6]}}       # the 1-rank ones and two more
    stored = tmp_path / "run.json"
    stored.write_text(json.dumps(few) + "\n")
    machines = [results / "plan_accuracy_optimizer_paths_machine.json",
                results / "calibrate_config_s_machine.json"]
    said = []
    got = module.repredict([stored], machines, said.append)
    assert len(got["pairs"]) == 2 and len(said) == 3
    from mpishard.planning import load_machine
    for pair, machine in zip(got["pairs"], machines):
        rows = [module._predicted(r, load_machine(machine)) for r in few["measured_here"]["rows"]]
        assert pair["median_abs_error"] == pytest.approx(module._score(rows)["median_abs_error"])
        assert all(r["predicted_s"] > 0 for r in rows)
    assert got["mean_median_abs_error"] == pytest.approx(
        sum(p["median_abs_error"] for p in got["pairs"]) / 2)
    assert 0 <= got["pairs_within_target"] <= 2

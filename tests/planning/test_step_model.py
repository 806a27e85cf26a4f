"""The GPU kernel model (mpishard/planning/gpu_time.py), the machine's efficiency tables,
memory reserve and figures' provenance, with hand-computed values.

    pytest -q tests/planning/test_step_model.py
"""
import pytest

from mpishard.models import GPT, GPTConfig
from mpishard.parallel.compose import build_stage
from mpishard.planning import load_machine, machine_from_dict, predict_step, stage_flops
from mpishard.planning.gpu_time import (MEGATRON_KERNELS, TENSOR_CORE_ATTENTION_SHARE,
                                        KernelSet, Op, micro_batch_times, op_seconds,
                                        stage_ops, tensor_core_attention_seconds)
from mpishard.planning.layout import Layout, estimate_layout, mesh_shape
from mpishard.planning.search import candidate_layouts, rank_layouts

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=8, dropout=0.1)
KERNEL = {"name": "kernels", "kind": "gpu", "ranks_per_node": 4, "overlap": True,
          "device": {"flops": {"float16": 1e12, "float32": 1e12}, "matmul_efficiency": 1.0,
                     "memory_bytes": 1e9, "memory_bandwidth": 1e11,
                     "matmul_efficiency_table": [[1, 0.5], [0, 0.25]],
                     "vector_flops": {"float16": 1e11},
                     "memory_efficiency_table": [[0, 0.5]], "launch_s": 1e-6},
          "links": {"intra": {"latency_s": 0.0, "bandwidth": 1e9}}}


def make():
    return GPT(CFG, materialize_now=False)


def test_the_kernels_products_are_the_stages_products():
    """Forward FLOPs of the products and attention's batched products equal
    stage_flops' count (an independent walk), backward twice them."""
    lay = Layout(batch_size=2, seq_len=16)
    ops = stage_ops(make(), lay, itemsize=2)
    fl = stage_flops(make(), lay)
    products = [op for op in ops if op.matrix]
    assert sum(op.fw_flops for op in products) == pytest.approx(fl["blocks"] + fl["rest"])
    assert sum(op.bw_flops for op in products) == pytest.approx(2 * (fl["blocks"] + fl["rest"]))
    assert sum(op.fw_flops for op in products if op.core) == pytest.approx(fl["attention"])


def test_a_kernel_is_its_flops_then_its_bytes_plus_a_launch():
    machine = machine_from_dict(KERNEL)
    big = Op("matmul", 2e9, 1e8, 4e9, 2e8, matrix=True)           # 2 GFLOP: table row 1
    fw, bw = op_seconds(big, machine, "float16")
    assert fw == pytest.approx(2e9 / (1e12 * 0.5) + 1e8 / (1e11 * 0.5) + 1e-6)
    assert bw == pytest.approx(2 * fw)                              # two products backward
    capped = machine_from_dict({**KERNEL, "device": {**KERNEL["device"],
                                                     "matmul_efficiency": 0.4}})
    assert op_seconds(big, capped, "float16")[0] == pytest.approx(
        2e9 / (1e12 * 0.4) + 1e8 / (1e11 * 0.5) + 1e-6)             # the measured best caps it
    small = Op("norm", 1e6, 1e6, 2e6, 1.5e6, bw_kernels=1)          # vector units, row 0
    assert op_seconds(small, machine, "float16")[0] == pytest.approx(
        1e6 / 1e11 + 1e6 / (1e11 * 0.5) + 1e-6)


def test_sequence_parallelism_splits_the_norms_and_residual_adds_over_tp():
    plain, sp = (Layout(tp=2, batch_size=2, seq_len=16, sequence_parallel=s)
                 for s in (False, True))

    def bytes_of(lay, cls):
        stage = build_stage(make(), mesh_shape(lay, 0), None, lay.cp_mode,
                            lay.sequence_parallel, 1)
        return sum(op.fw_bytes for op in stage_ops(stage, lay, 2) if op.cls == cls)
    for cls in ("norm", "dropout+residual"):
        assert bytes_of(sp, cls) == pytest.approx(bytes_of(plain, cls) / 2)
    assert bytes_of(sp, "matmul") == bytes_of(plain, "matmul")      # products: gathered rows


def test_recomputation_repeats_the_blocks_or_attentions_core_forward():
    machine, lay = machine_from_dict(KERNEL), Layout(batch_size=2, seq_len=16)
    ops = stage_ops(make(), lay, 2)
    times = {name: micro_batch_times(ops, machine, "float16", Layout(
        batch_size=2, seq_len=16, **extra)) for name, extra in
        (("none", {}), ("full", {"activation_checkpointing": True}),
         ("selective", {"selective": True}))}
    forward = {cls: sum(op_seconds(op, machine, "float16")[0] for op in ops if test(op))
               for cls, test in (("blocks", lambda op: op.block),
                                 ("core", lambda op: op.core))}
    assert times["none"]["recompute"] == 0.0
    assert times["full"]["recompute"] == pytest.approx(forward["blocks"])
    assert times["selective"]["recompute"] == pytest.approx(forward["core"])
    assert 0 < forward["core"] < forward["blocks"]


def test_a_gpu_step_adds_up_and_halves_pipeline_bytes_on_full_duplex_links():
    machine = machine_from_dict(KERNEL)
    lay = Layout(pp=2, strategy="ddp", batch_size=1, seq_len=16, micro_batches=2)
    cost = predict_step(make, lay, machine)
    assert cost.seconds == pytest.approx(sum(cost.breakdown.values()))
    assert any(k.startswith("compute ") for k in cost.breakdown) and cost.breakdown["bubble"] > 0
    from mpishard.planning.layout import estimate_layout
    sent = estimate_layout(make(), lay).stages[cost.stage].bus_bytes["pp"]
    assert cost.comm_total["pp"] == pytest.approx(sent / 2 / 1e9)


def test_the_memory_reserve_is_kept_back_from_what_layouts_plan():
    layouts = candidate_layouts(2, 2, 16, 4, CFG.n_layer, CFG.n_head, strategies=["ddp"],
                                checkpointing=(False,))
    machine = machine_from_dict(KERNEL)
    fits, _ = rank_layouts(make, layouts, machine)
    peak = min(r.peak_bytes for r in fits)
    reserved = machine_from_dict({**KERNEL, "device": {
        **KERNEL["device"], "memory_reserve_bytes": KERNEL["device"]["memory_bytes"] - peak
        + 1}})
    assert reserved.usable_memory_bytes == peak - 1
    assert rank_layouts(make, layouts, reserved)[0] == []


def test_shipped_gpus_are_costed_by_kernels_with_every_figure_sourced():
    for name in ("a100-80gb", "h100-sxm", "h200"):
        machine = load_machine(name)
        assert machine.kernel_model and machine.memory_reserve_bytes > 0
        for key in ("matmul_efficiency_table", "vector_flops", "memory_efficiency_table",
                    "flash_attention_efficiency", "launch_s", "memory_reserve_bytes"):
            assert f"device.{key}" in machine.sources, (name, key)
        kinds = machine.provenance()
        assert "datasheet" in kinds and "published tables" in kinds
    cpu = load_machine("cpu-2core")
    assert not cpu.kernel_model and set(cpu.provenance()) == {"measured here"}
    with pytest.raises(ValueError, match="sizes descending to 0"):
        machine_from_dict({**KERNEL, "device": {**KERNEL["device"],
                                                "matmul_efficiency_table": [[0, 1], [1, 1]]}})


def test_mpishards_kernels_fuse_attention_where_the_tensor_core_kernel_takes_it(monkeypatch):
    """With ``MPISHARD_ATTENTION=fused``, 16-bit rows, a head size a multiple of 16 and no
    dropout of the weights: one fused kernel forward, two backward (dq; dk and dv) at the
    tensor-core share of the flash rate; with dropout (or 4-byte rows), or the default
    batched choice, the batched path's products and softmax, as the run would do."""
    monkeypatch.setenv("MPISHARD_ATTENTION", "fused")
    lay = Layout(batch_size=2, seq_len=16)
    wide = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)

    def attention(cfg, itemsize, kernels=KernelSet()):
        return [op for op in stage_ops(GPT(cfg, materialize_now=False), lay, itemsize,
                                       kernels) if op.core]
    fused = attention(wide, 2)
    assert [(op.flash, op.fw_kernels, op.bw_kernels) for op in fused] == \
        [(TENSOR_CORE_ATTENTION_SHARE, 1, 2)] * 2                    # one per block
    assert all(not op.flash for op in attention(wide, 4))          # float32: no WMMA kernel
    assert all(not op.flash for op in attention(CFG, 2))            # dropout 0.1, head size 4
    assert {op.flash for op in attention(wide, 2, KernelSet("flash2"))} == {1.0}
    assert all(not op.flash for op in attention(wide, 2, MEGATRON_KERNELS))
    monkeypatch.setenv("MPISHARD_ATTENTION", "batched")
    assert all(not op.flash for op in attention(wide, 2))
    assert {op.flash for op in attention(wide, 2, KernelSet("flash2"))} == {1.0}
    with pytest.raises(ValueError, match="attention must be one of"):
        KernelSet("sdpa")


def test_the_tensor_core_kernels_alone_are_the_fused_attention_a_step_plans(monkeypatch):
    """``tensor_core_attention_seconds`` (what benchmarks/attention.py times the kernels
    against) is the fused attention op of a 16-bit step at the same shape; at GPT-2
    small's (batch 8, 12 heads, T = 1024, head size 64) on an H100 its backward is the
    0.25 ms docs/gpu.md quotes beside the 2.28 ms measured around it."""
    monkeypatch.setenv("MPISHARD_ATTENTION", "fused")
    h100 = load_machine("h100-sxm")
    cfg = GPTConfig(vocab_size=64, block_size=64, n_layer=1, n_head=2, n_embd=64, dropout=0.0)
    op, = [op for op in stage_ops(GPT(cfg, materialize_now=False),
                                  Layout(batch_size=3, seq_len=64), 2) if op.core]
    assert tensor_core_attention_seconds(h100, 3 * 2, 64, 32, "float16") == \
        op_seconds(op, h100, "float16")
    forward, backward = tensor_core_attention_seconds(h100, 8 * 12, 1024, 64, "float16")
    assert round(backward * 1e3, 2) == 0.25 and forward < backward


def test_the_loss_reads_16_bit_logits_once_fused_or_streams_float32_copies():
    lay = Layout(batch_size=2, seq_len=16)
    logits = 2 * 16 * CFG.vocab_size

    def loss(kernels):
        (op,) = [op for op in stage_ops(make(), lay, 2, kernels) if op.cls == "loss"]
        return op
    fused, megatron = loss(KernelSet()), loss(MEGATRON_KERNELS)
    assert (fused.fw_bytes, fused.bw_bytes) == (2 * logits, 4 * logits)
    assert (megatron.fw_bytes, megatron.bw_bytes) == (38 * logits, 14 * logits)
    assert (megatron.fw_kernels, megatron.bw_kernels) == (6, 2)


def test_pipeline_messages_cost_the_planned_bytes_half_each_way():
    """The plan's pp bytes (without sequence parallelism 1 / tp of a message per tp rank,
    its all-gather in tp's bytes) cross a full-duplex link: half of them each way."""
    machine = machine_from_dict(KERNEL)
    for sp in (False, True):
        lay = Layout(tp=2, pp=2, strategy="ddp", batch_size=2, seq_len=16, micro_batches=2,
                     sequence_parallel=sp)
        plan = estimate_layout(make(), lay)
        cost = predict_step(make, lay, machine, plan=plan)
        stage = plan.stages[cost.stage]
        link = machine.link("send", 2, False)
        assert cost.comm_total["pp"] == pytest.approx(link.seconds(stage.bus_bytes["pp"] / 2,
                                                                   2 * lay.micro_batches))


def test_ddp_hides_its_all_reduce_behind_the_last_micro_batch_only():
    """no_sync before the last micro-batch: 4 micro-batches hide no more than 1 does;
    16-bit gradient reductions send half of float32's bytes."""
    slow = machine_from_dict({**KERNEL, "links": {"intra": {"latency_s": 0.0,
                                                            "bandwidth": 5e9}}})
    wide = GPTConfig(vocab_size=16, block_size=16, n_layer=2, n_head=2, n_embd=512)

    def make():         # 25 MB of gradients: 6 buckets, the embeddings' (the last) small
        return GPT(wide, materialize_now=False)
    one, four = (predict_step(make, Layout(dp=2, strategy="ddp", precision="float16",
                                           batch_size=1, seq_len=16, micro_batches=m), slow)
                 for m in (1, 4))
    assert four.comm_total["dp"] == pytest.approx(one.comm_total["dp"])
    assert four.breakdown["comm dp"] == pytest.approx(one.breakdown["comm dp"])
    assert 0.3 * one.comm_total["dp"] < one.breakdown["comm dp"] < one.comm_total["dp"]
    half = predict_step(make, Layout(dp=2, strategy="ddp", precision="float16", batch_size=1,
                                     seq_len=16), slow, kernels=KernelSet(grad_reduce_itemsize=2))
    assert half.comm_total["dp"] == pytest.approx(one.comm_total["dp"] / 2)


def test_hidden_communication_costs_the_links_processor_usage_of_its_time():
    """ZeRO-3's gathers and reduce-scatters hide behind the compute, but take the link's
    ``processor_usage`` of their seconds from it (the ``overlap`` row, Calculon's model);
    what stays exposed costs nothing more, and a link without it adds no row."""
    layout = Layout(dp=2, strategy="zero3", precision="float16", batch_size=2, seq_len=16)
    plain = predict_step(make, layout, machine_from_dict(KERNEL))
    busy = predict_step(make, layout, machine_from_dict(
        {**KERNEL, "links": {"intra": {"latency_s": 0.0, "bandwidth": 1e9,
                                       "processor_usage": 0.25}}}))
    assert "overlap" not in plain.breakdown
    hidden = plain.comm_total["dp"] - plain.breakdown["comm dp"]
    assert hidden > 0
    assert busy.breakdown["overlap"] == pytest.approx(0.25 * hidden)
    assert busy.seconds == pytest.approx(plain.seconds + 0.25 * hidden)
    with pytest.raises(ValueError, match="processor_usage=1.5 must be in"):
        machine_from_dict({**KERNEL, "links": {"intra": {"bandwidth": 1e9,
                                                         "processor_usage": 1.5}}})


def test_a_framework_that_overlaps_sp_collectives_exposes_the_forward_reduce_scatters_last_split():
    """``KernelSet(tp_overlap=4)`` (Megatron-Core's --tp-comm-overlap, the forward
    reduce-scatters in 4 splits): of the tp group's seconds under sequence parallelism
    only the forward reduce-scatters' last split, ``1 / (4 * 4)``, stays exposed; the
    rest hides at the link's processor usage; without sequence parallelism
    (all-reduces) nothing changes."""
    machine = machine_from_dict({**KERNEL, "links": {"intra": {
        "latency_s": 0.0, "bandwidth": 1e9, "processor_usage": 0.25}}})
    sp = Layout(tp=2, strategy="ddp", precision="float16", batch_size=2, seq_len=16,
                sequence_parallel=True)
    plain = predict_step(make, sp, machine)
    over = predict_step(make, sp, machine, kernels=KernelSet(tp_overlap=4))
    t = plain.comm_total["tp"]
    assert plain.breakdown["comm tp"] == pytest.approx(t) and t > 0
    assert over.comm_total["tp"] == pytest.approx(t)
    assert over.breakdown["comm tp"] == pytest.approx(t / 16)
    assert over.breakdown["overlap"] - plain.breakdown.get("overlap", 0.0) == \
        pytest.approx(0.25 * (t - t / 16))
    with pytest.raises(ValueError, match="tp_overlap=True.*an integer >= 0"):
        KernelSet(tp_overlap=True)
    no_sp = Layout(tp=2, strategy="ddp", precision="float16", batch_size=2, seq_len=16)
    assert predict_step(make, no_sp, machine, kernels=KernelSet(tp_overlap=4)) \
        .breakdown["comm tp"] == pytest.approx(predict_step(make, no_sp, machine)
                                               .breakdown["comm tp"])


def test_grouped_kv_context_parallelism_sends_the_kv_heads_and_16_bit_gradients():
    """``KernelSet(cp_grouped_kv=True)`` (Transformer Engine's ring): the K/V blocks of
    the key/value heads, not expanded to the query heads, and their gradients in the
    activations' dtype (hand-computed: 2 layers of 4 query heads over 1 key/value head,
    head size 8, at cp 2, each rank's 16 rows of 2 sequences, 16-bit; the rest of the cp
    group's bytes, the gradients' all-reduce over dp x cp, stays)."""
    from mpishard.models import Llama, LlamaConfig
    cfg = LlamaConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_kv_head=1,
                      n_embd=32, intermediate_size=64)

    def llama():
        return Llama(cfg, materialize_now=False)
    layout = Layout(dp=1, cp=2, strategy="ddp", precision="float16", batch_size=2, seq_len=32)
    machine = machine_from_dict(KERNEL)          # 1 GB/s, no latency
    mine = predict_step(llama, layout, machine)
    grouped = predict_step(llama, layout, machine, kernels=KernelSet(cp_grouped_kv=True))
    c, rows, hs = 2, 2 * 16, 8
    # per layer, sent and received: the K/V block once (cp - 1 = 1) each way, forward and
    # backward, and the gradients' block cp = 2 times
    expanded = 2 * rows * 2 * 4 * hs * (2 * c + 2 * 4)       # float32 gradients
    kv = 2 * rows * 2 * 1 * hs * (2 * c + 2 * c)
    assert mine.comm_total["cp"] - grouped.comm_total["cp"] == \
        pytest.approx(2 * (expanded - kv) / 1e9)
    plain = Layout(cp=2, strategy="ddp", precision="float16", batch_size=2, seq_len=16)
    gpt = predict_step(make, plain, machine, kernels=KernelSet(cp_grouped_kv=True))
    # GPT: 2 layers, 2 x 8 rows, K and V of 2 heads of size 4; no grouping, so only the
    # gradients' dtype changes
    ring = 2 * (2 * 8) * 2 * 2 * 4 * (2 * c + 2 * 4)
    assert predict_step(make, plain, machine).comm_total["cp"] - gpt.comm_total["cp"] == \
        pytest.approx(2 * ring * (2 * 4 - 2 * c) / (2 * c + 2 * 4) / 1e9)
    # one memo and stage cache across layouts that differ only in recomputation (as a
    # search shares them): each as predicted alone
    from mpishard.planning.search import StageCache
    whole = llama()
    cache, memo = StageCache(llama, whole), {}
    for ckpt in (False, True, False):
        lay = Layout(dp=1, cp=2, strategy="ddp", precision="float16", batch_size=2,
                     seq_len=32, activation_checkpointing=ckpt)
        alone = predict_step(llama, lay, machine, kernels=KernelSet(cp_grouped_kv=True))
        shared = predict_step(llama, lay, machine, kernels=KernelSet(cp_grouped_kv=True),
                              stages=cache.of(lay), memo=memo, whole=whole,
                              plan=estimate_layout(whole, lay, stage_of=cache.of(lay),
                                                   memo=memo))
        assert shared.comm_total["cp"] == pytest.approx(alone.comm_total["cp"]), ckpt


LLAMA = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
             intermediate_size=48)


def test_torchtitans_eager_ops_are_counted_kernel_by_kernel():
    """``eager``: torchtitan's RMSNorm as 8 kernels forward (36 bytes an element in 16 bits:
    the casts, pow, mean, the two products) and 16 backward (92), SwiGLU as silu then the
    product (10 bytes forward, 18 backward); ``"outside blocks"`` (torch.compile of each
    block) leaves the blocks' fused and the final norm eager."""
    from mpishard.models import Llama, LlamaConfig
    from mpishard.planning.gpu_time import TORCHTITAN_COMPILED_KERNELS, TORCHTITAN_KERNELS
    lay = Layout(batch_size=2, seq_len=16)
    model = Llama(LlamaConfig(**LLAMA), materialize_now=False)
    rows, C, F = 2 * 16, LLAMA["n_embd"], LLAMA["intermediate_size"]

    def of(kernels, cls):
        return [op for op in stage_ops(model, lay, 2, kernels) if op.cls == cls]
    norms = of(TORCHTITAN_KERNELS, "norm")
    assert len(norms) == 5                                          # 2 a block, the final
    assert {(op.fw_kernels, op.bw_kernels, op.fw_bytes, op.bw_bytes) for op in norms} == \
        {(8, 16, 36.0 * rows * C, 92.0 * rows * C)}
    swiglu, = {(op.fw_bytes, op.bw_bytes, op.fw_kernels, op.bw_kernels)
               for op in of(TORCHTITAN_KERNELS, "activation")}
    assert swiglu == (10.0 * rows * F, 18.0 * rows * F, 2, 3)
    compiled = of(TORCHTITAN_COMPILED_KERNELS, "norm")
    assert [op.fw_kernels for op in compiled] == [1, 1, 1, 1, 8]       # the final norm eager
    assert [op.block for op in compiled] == [True] * 4 + [False]
    assert {op.fw_bytes for op in of(TORCHTITAN_COMPILED_KERNELS, "activation")} == \
        {3.0 * 2 * rows * F}                                        # fused: two in, one out
    with pytest.raises(ValueError, match="eager one of"):
        KernelSet(eager="some")


def test_rotary_embeddings_and_key_value_copies_by_framework():
    """A Llama's rotary embeddings cost q's and k's elements once each way fused, 20 bytes
    an element each way as torchtitan's complex product; mpishard's packed rows one
    kernel each way (q, k and v read, the packed rows written: k and v copied out to
    the query heads), or inside its one-op attention where that runs (casts, complex
    products, 14 launches forward and 3 backward); torchtitan's ``repeat_kv``
    copies k and v out to the query heads, only where they are fewer. A GPT has none."""
    from mpishard.models import Llama, LlamaConfig
    from mpishard.planning.gpu_time import (MPISHARD_KERNELS, NEMO_KERNELS,
                                            TORCHTITAN_KERNELS)
    lay = Layout(batch_size=2, seq_len=16)
    rows, hs = 2 * 16, LLAMA["n_embd"] // LLAMA["n_head"]
    eq, ekv = rows * 4 * hs, rows * 2 * hs

    def rotary(kernels, **extra):
        model = Llama(LlamaConfig(**{**LLAMA, **extra}), materialize_now=False)
        return [op for op in stage_ops(model, lay, 2, kernels) if op.cls == "rotary"]
    fused = rotary(NEMO_KERNELS)
    assert len(fused) == 2 and fused[0].fw_bytes == fused[0].bw_bytes == 2.0 * 2 * (eq + ekv)
    complex_ = rotary(TORCHTITAN_KERNELS)
    assert complex_[0].fw_bytes == (2 * 2 + 16.0) * (eq + ekv)
    assert (complex_[0].fw_kernels, complex_[0].bw_kernels) == (6, 6)
    # mpishard's Llama without tp or cp and without flash kernels (batched attention, the
    # default) rotates inside its one op: q, k, v up to float32, the turns (4 bytes an
    # element written, turn and conjugate, and the conjugate's read, per head and
    # position), the complex products (rows, turns, results) and casts
    one_op = rotary(MPISHARD_KERNELS)
    assert len(one_op) == 2 and (one_op[0].fw_kernels, one_op[0].bw_kernels) == (14, 3)
    assert one_op[0].fw_bytes == 6.0 * (eq + 2 * ekv) + 12.0 * 16 * hs * (4 + 2) \
        + (12.0 + 6) * (eq + ekv) + 4.0 * ekv
    assert one_op[0].bw_bytes == 12.0 * (eq + ekv) + 6.0 * (eq + 2 * ekv)
    assert one_op[0].fw_bytes > fused[0].fw_bytes

    def copies(kernels, **extra):
        model = Llama(LlamaConfig(**{**LLAMA, **extra}), materialize_now=False)
        return [op for op in stage_ops(model, lay, 2, kernels)
                if op.cls == "attention" and not op.matrix and not op.core]
    grouped = copies(TORCHTITAN_KERNELS)
    assert len(grouped) == 2 and grouped[0].fw_bytes == 2.0 * 2 * (eq + ekv)
    assert copies(TORCHTITAN_KERNELS, n_kv_head=4) == []             # as many heads: none
    assert copies(NEMO_KERNELS) == []
    assert not [op for op in stage_ops(make(), lay, 2, TORCHTITAN_KERNELS)
                if op.cls == "rotary"]
    for tp, kv in ((2, 1), (4, 2)):         # tp splits the 2 key/value heads, or keeps both
        split = Layout(tp=tp, batch_size=2, seq_len=16)
        stage = build_stage(Llama(LlamaConfig(**LLAMA), materialize_now=False),
                            mesh_shape(split, 0), None, split.cp_mode, False, 1)
        op, = [o for o in stage_ops(stage, split, 2, NEMO_KERNELS) if o.cls == "rotary"][:1]
        assert op.fw_bytes == 2.0 * 2 * rows * (4 // tp + kv) * hs, tp
    # 16 query heads on 2 key/value heads, tp 4: each rank's 4 query heads read one
    # key/value head, both kept whole: mpishard's rope_qkv kernels (the per-projection
    # path tp takes) read both and write the rank's packed rows, one launch each way
    wide = {**LLAMA, "n_head": 16, "n_embd": 64}
    split = Layout(tp=4, batch_size=2, seq_len=16)
    stage = build_stage(Llama(LlamaConfig(**wide), materialize_now=False),
                        mesh_shape(split, 0), None, split.cp_mode, False, 1)
    op, = [o for o in stage_ops(stage, split, 2, MPISHARD_KERNELS) if o.cls == "rotary"][:1]
    assert (op.fw_kernels, op.bw_kernels) == (1, 1)                  # tp: rope_qkv's kernels
    eq, ekv = rows * 4 * (64 // 16), rows * 2 * (64 // 16)           # 4 query, 2 kv heads
    assert op.fw_bytes == op.bw_bytes == 2.0 * (4 * eq + 2 * ekv)
    assert op.fw_bytes < 2.0 * (eq + ekv) * (2 + 8)                  # the complex product's


def test_the_one_op_rotary_costing_follows_the_layout_not_the_stage(monkeypatch):
    """Which path a Llama's rotations are costed on comes from the layout and the attention
    setting, as the model decides it (``takes_one_op_path``): the one op without tp, cp,
    recomputation by op or fused attention for its heads; ``rope_qkv``'s kernels
    otherwise, including fused attention on float32 rows (no tensor cores, still the
    fused path). A stage left in "op" mode by an earlier layout changes nothing."""
    from mpishard.models import Llama, LlamaConfig
    from mpishard.planning.gpu_time import MPISHARD_KERNELS
    model = Llama(LlamaConfig(**LLAMA), materialize_now=False)

    def launches(lay, itemsize=2):
        return {(op.fw_kernels, op.bw_kernels) for op in stage_ops(model, lay, itemsize,
                                                                   MPISHARD_KERNELS)
                if op.cls == "rotary"}
    plain = Layout(batch_size=2, seq_len=16)
    by_op = Layout(batch_size=2, seq_len=16, activation_checkpointing=True, keep_products=True)
    monkeypatch.setenv("MPISHARD_ATTENTION", "batched")
    assert launches(plain) == {(14, 3)} and launches(plain, 4) == {(11, 2)}
    assert launches(by_op) == {(1, 1)}
    for block in model.model.layers.values():           # as an "op" layout leaves the stage
        block.keep_products = True
    assert launches(plain) == {(14, 3)}
    monkeypatch.setenv("MPISHARD_ATTENTION", "fused")
    assert launches(plain) == launches(plain, 4) == {(1, 1)}


def test_flashattentions_triton_kernels_run_at_the_first_generations_share():
    """``KernelSet("flash1")`` (llm-foundry's Triton kernels): one fused kernel forward, two
    backward, at FLASH1_ATTENTION_SHARE of the flash rate, so its products take twice
    FlashAttention-2's time on a description whose flash rate binds."""
    from mpishard.planning.gpu_time import FLASH1_ATTENTION_SHARE
    lay = Layout(batch_size=2, seq_len=16)
    wide = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32,
                         dropout=0.0), materialize_now=False)
    one, = [op for op in stage_ops(wide, lay, 2, KernelSet("flash1")) if op.core]
    two, = [op for op in stage_ops(wide, lay, 2, KernelSet("flash2")) if op.core]
    assert (one.flash, one.fw_kernels, one.bw_kernels) == (FLASH1_ATTENTION_SHARE, 1, 2)
    assert (one.fw_flops, one.fw_bytes) == (two.fw_flops, two.fw_bytes)
    machine = machine_from_dict({**KERNEL, "device": {
        **KERNEL["device"], "flash_attention_efficiency": 0.5, "launch_s": 0.0,
        "memory_bandwidth": 1e30}})
    assert op_seconds(one, machine, "float16")[0] == pytest.approx(
        2 * op_seconds(two, machine, "float16")[0])

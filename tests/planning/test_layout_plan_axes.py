"""The layout planner's context-parallel, hybrid-sharding and sequence-parallel axes.

What needs no run: a :class:`Layout` refuses sizes that do not fit (naming the
fix), a :class:`MeshShape` names its groups as a :class:`Mesh` names its
communicators (checked against a real mesh on 4 ranks), the plan shards ZeRO
over ``dp_shard x cp`` and prints the new axes, and the models' activation
formulas take the split as keywords or from the stage. tests/planning/test_layout_plan.py
holds the figures against runs.
"""
import dataclasses

import pytest
from mpi4py import MPI

from mpishard.comm import Communicator, Mesh
from mpishard.models import GPT, GPTConfig, Llama, LlamaConfig
from mpishard.models.gpt.activations import gpt_activation_bytes
from mpishard.models.llama.activations import llama_activation_bytes
from mpishard.core.mesh_axes import MeshShape
from mpishard.planning.layout import Layout, estimate_layout, mesh_shape
from mpishard.planning.memory import estimate_memory
from mpishard.parallel.compose import build_stage

CFG = GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_embd=64)
LLAMA = LlamaConfig(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                    intermediate_size=96)


def gpt():
    return GPT(CFG, materialize_now=False)


@pytest.mark.parametrize("fields, words", [
    (dict(dp=4, dp_replicate=3), "dp_replicate that divides 4"),
    (dict(cp=2, seq_len=6), "multiple of 4"),
    (dict(cp_mode="ulysses"), "use 'ring' or 'all-to-all'"),
    (dict(tp=4, batch_size=1, seq_len=6, sequence_parallel=True), "divisible by 4"),
    (dict(cp=0), "positive integer"),
])
def test_a_layout_that_does_not_fit_is_refused_naming_the_fix(fields, words):
    with pytest.raises(ValueError, match=words):
        Layout(**{"seq_len": 16, **fields})


def test_all_to_all_needs_heads_that_split_over_cp():
    with pytest.raises(ValueError, match="cp_mode 'ring'"):
        estimate_layout(gpt(), Layout(tp=2, cp=4, seq_len=16, cp_mode="all-to-all"))
    estimate_layout(gpt(), Layout(tp=2, cp=4, seq_len=16))              # the ring needs no split


def test_positional_layouts_keep_their_meaning():
    lay = Layout(2, 2, 1, "zero3", None, "adamw", 4, 32)
    assert (lay.cp, lay.dp_replicate, lay.cp_mode, lay.sequence_parallel) == (1, 1, "ring",
                                                                              False)
    assert lay.dp_shard == 2 and lay.local_seq_len == 32


@pytest.mark.parametrize("sizes, names", [
    (dict(dp=4), ["dp"]),
    (dict(dp=4, dp_replicate=2), ["dp_replicate", "dp_shard", "dp"]),
    (dict(dp=4, dp_replicate=4), ["dp"]),
    (dict(dp=1, cp=4), ["cp"]),
    (dict(dp=2, cp=2), ["dp", "cp", "dp_cp"]),
    (dict(dp=2, dp_replicate=2, cp=2), ["dp", "cp", "dp_cp"]),
    (dict(dp=2, tp=2, pp=2, cp=2), ["pp", "dp", "cp", "dp_cp", "tp"]),
])
def test_a_layouts_mesh_shape_names_groups_as_the_mesh_does(sizes, names):
    mesh = mesh_shape(Layout(**sizes, seq_len=16), 0)
    assert mesh.active_names() == names
    assert mesh.dp_cp.size == sizes.get("dp", 1) * sizes.get("cp", 1)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("sizes", [dict(dp=4, dp_replicate=2), dict(dp=2, dp_replicate=2, cp=2),
                                   dict(dp=1, cp=2, tp=2), dict(dp=2, cp=2), dict(dp=4),
                                   dict(dp=2, pp=2), dict(dp=4, ep=2), dict(dp=2, cp=2, ep=4),
                                   dict(dp=2, cp=2, ep=2)])
def test_a_layouts_mesh_shape_matches_a_real_mesh(sizes):
    world = Communicator(MPI.COMM_WORLD)
    if world.size != 4:
        pytest.skip("needs 4 ranks")
    full = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "dp_replicate": 1, "ep": 1, **sizes}
    mesh = Mesh(world, **full)
    shape = MeshShape(pp=full["pp"], dp_replicate=full["dp_replicate"],
                      dp_shard=full["dp"] // full["dp_replicate"], cp=full["cp"], tp=full["tp"],
                      ep=full["ep"], world_rank=world.rank)
    assert shape.active_names() == list(mesh.active_axes())
    for group in ("dp", "tp", "pp", "cp", "dp_replicate", "dp_shard", "dp_cp", "dp_shard_cp",
                  "ep", "edp", "edp_shard"):
        ours, theirs = getattr(shape, group), getattr(mesh, group)
        assert (ours.size, ours.rank) == (theirs.size, theirs.rank), group
        if theirs.size > 1:
            assert ours.name == theirs.name, group
    mesh.free()


def test_zero_shards_over_dp_shard_and_cp_and_ddp_keeps_whole_parameters():
    base = dict(batch_size=2, seq_len=16)
    z4 = estimate_layout(gpt(), Layout(dp=4, strategy="zero3", **base)).busiest
    cp = estimate_layout(gpt(), Layout(dp=2, cp=2, strategy="zero3", **base)).busiest
    hybrid = estimate_layout(gpt(), Layout(dp=4, dp_replicate=2, strategy="zero3", **base)).busiest
    z2 = estimate_layout(gpt(), Layout(dp=2, strategy="zero3", **base)).busiest
    assert cp.memory.steady == z4.memory.steady and hybrid.memory.steady == z2.memory.steady
    ddp = estimate_layout(gpt(), Layout(dp=2, cp=2, strategy="ddp", **base)).busiest
    assert ddp.memory.steady["params"] == 4 * gpt().num_parameters()
    assert set(hybrid.bus_bytes) >= {"dp_replicate", "dp_shard", "dp"}
    assert hybrid.bus_bytes["dp_replicate"] > 0 and hybrid.bus_bytes["dp_shard"] > 0
    assert ddp.bus_bytes["dp_cp"] > 0 and ddp.bus_bytes["cp"] > 0 and ddp.bus_bytes["dp"] == 0


def test_cp_and_sequence_parallelism_shrink_activations():
    base = dict(batch_size=2, seq_len=64)
    whole = estimate_layout(gpt(), Layout(**base)).busiest.activation_bytes
    ring = estimate_layout(gpt(), Layout(cp=4, **base)).busiest.activation_bytes
    assert ring < whole / 3
    tp = estimate_layout(gpt(), Layout(tp=2, **base)).busiest
    sp = estimate_layout(gpt(), Layout(tp=2, sequence_parallel=True, **base)).busiest
    assert sp.activation_bytes < tp.activation_bytes
    assert sp.bus_bytes["tp"] > tp.bus_bytes["tp"]    # the backward gathers again


def test_the_plan_prints_the_new_axes():
    text = estimate_layout(Llama(LLAMA, materialize_now=False),
                       Layout(dp=4, dp_replicate=2, tp=2, cp=2, strategy="zero2", batch_size=1,
                              seq_len=16, cp_mode="all-to-all",
                              sequence_parallel=True)).format()
    assert "zero2 on dp=4 (dp_replicate=2 x dp_shard=2) x cp=2 (all-to-all) x tp=2 " \
           "(sequence parallel) x pp=1" in text
    assert "micro-batch(es) of 1 x 8 (of 16)" in text
    traffic = text.splitlines()[-1]
    for name in ("dp_replicate", "dp_shard", "cp", "dp_shard_cp", "dp_cp", "tp"):
        assert f" {name} " in traffic, name
    plain = estimate_layout(gpt(), Layout(dp=2, tp=2, batch_size=1, seq_len=16)).format()
    assert "zero3 on dp=2 x tp=2 x pp=1:" in plain and "(of" not in plain


@pytest.mark.parametrize("cls, cfg, formula", [(GPT, CFG, gpt_activation_bytes),
                                               (Llama, LLAMA, llama_activation_bytes)])
@pytest.mark.parametrize("split", [dict(cp=2, cp_mode="ring"), dict(cp=4, cp_mode="all-to-all"),
                                   dict(tp=2, sequence_parallel=True)])
def test_activation_formulas_take_the_split_as_keywords(cls, cfg, formula, split):
    tp, cp = split.get("tp", 1), split.get("cp", 1)
    stage = build_stage(cls(cfg, materialize_now=False), MeshShape(cp=cp, tp=tp),
                        cp_mode=split.get("cp_mode", "ring"),
                        sequence_parallel=split.get("sequence_parallel", False))
    T = 32 // cp
    if tp == 1:   # the whole model, told the split
        plain = cls(cfg, materialize_now=False)
        assert formula(plain, 2, T, cp=cp, cp_mode=split["cp_mode"]) == \
            stage.activation_bytes(2, T)
        assert formula(plain, 2, T) == formula(plain, 2, T, cp=1) != \
            stage.activation_bytes(2, T)
    else:         # the tp stage, told there is no split
        assert formula(stage, 2, T, sp=1) > stage.activation_bytes(2, T) == \
            formula(stage, 2, T, sp=tp)


def test_plan_memory_takes_replicas_of_the_shards():
    one = estimate_memory(gpt(), "zero2", 2)
    hybrid = estimate_memory(gpt(), "zero2", 4, dp_replicate=2)
    assert hybrid.steady == one.steady
    assert hybrid.bus_bytes_by_group["dp_shard_cp"] == one.bus_bytes_by_group["dp_shard_cp"]
    assert hybrid.bus_bytes_by_group["dp_replicate"] > 0
    assert hybrid.bus_bytes_per_step == sum(hybrid.bus_bytes_by_group.values())
    with pytest.raises(ValueError, match="must divide dp_size"):
        estimate_memory(gpt(), "zero2", 4, dp_replicate=3)
    assert dataclasses.asdict(estimate_memory(gpt(), "ddp", 4))["bus_bytes_by_group"]["dp_cp"] > 0

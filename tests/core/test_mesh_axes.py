"""The mesh's one table of axes and groups (mpishard.core.mesh_axes), without MPI.

Every :class:`MeshShape` group, for every world rank of many shapes (expert axes
included), against an independent enumeration: its ranks (size, this rank's index,
lowest and highest world rank), one colour per group, and the name the mesh gives its
communicator (the first group over the same ranks). tests/comm/test_comm_mesh_axes.py checks
the real :class:`~mpishard.comm.Mesh` against the same enumeration under mpiexec.
"""
import itertools

import pytest

from mpishard.core.mesh_axes import GROUPS_OUTERMOST_FIRST, MESH_AXES, MESH_GROUPS, MeshShape

SHAPES = [dict(), dict(dp_shard=4), dict(dp_replicate=2, dp_shard=2), dict(cp=2, tp=2),
          dict(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=2), dict(dp_shard=3, tp=2),
          dict(dp_shard=2, ep=2), dict(dp_shard=2, cp=2, ep=2), dict(dp_shard=2, cp=2, ep=4),
          dict(dp_shard=4, cp=2, ep=2), dict(dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=2),
          dict(pp=2, dp_shard=6, ep=3), dict(dp_shard=2, cp=3, ep=3)]


def members_of(sizes: dict) -> dict:
    """world rank -> {group: its world ranks}, from nested loops over the axes (tp
    innermost) and the expert blocks: ep consecutive ranks of dp_shard x cp."""
    coords = {r: dict(zip(MESH_AXES, c)) for r, c in
              enumerate(itertools.product(*(range(sizes[a]) for a in MESH_AXES)))}
    for c in coords.values():
        inner = c["dp_shard"] * sizes["cp"] + c["cp"]
        c["block"], c["ep"] = inner // sizes["ep"], inner % sizes["ep"]
    fixed = {"ep": ("pp", "dp_replicate", "block", "tp"), "edp": ("pp", "ep", "tp"),
             "edp_shard": ("pp", "dp_replicate", "ep", "tp")}
    for name, axes in MESH_GROUPS.items():
        fixed.setdefault(name, tuple(a for a in MESH_AXES if a not in axes))
    return {r: {name: [o for o, d in coords.items() if all(d[a] == c[a] for a in keep)]
                for name, keep in fixed.items()} for r, c in coords.items()}


@pytest.mark.parametrize("given", SHAPES, ids=lambda g: "x".join(f"{a}{n}" for a, n in
                                                                 g.items()) or "one")
def test_every_group_holds_the_enumerated_ranks_and_names_as_the_mesh(given):
    sizes = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "ep": 1, **given}
    expected = members_of(sizes)
    colors = {name: {} for name in MESH_GROUPS}
    for rank, groups in expected.items():
        shape = MeshShape(**sizes, world_rank=rank)
        assert list(shape.groups) == list(MESH_GROUPS)
        for name, ranks in groups.items():
            group = shape.groups[name]
            assert getattr(shape, name) is group
            assert (group.size, group.rank) == (len(ranks), ranks.index(rank)), (name, rank)
            assert (group.first_world_rank, group.last_world_rank) == (ranks[0], ranks[-1])
            assert group.world_ranks() == ranks, (name, rank)
            for per_node in (1, 2, 3, 4, 5, 8):
                nodes = [r // per_node for r in ranks]
                assert group.fewest_ranks_on_a_node(per_node) == \
                    min(nodes.count(n) for n in set(nodes)), (name, rank, per_node)
            assert colors[name].setdefault(group.color, ranks) == ranks, (name, rank)
            same = next(n for n in MESH_GROUPS if groups[n] == ranks)
            assert group.name == (same if len(ranks) > 1 else name), (name, rank)
        active = [shape.groups[n].name for n in GROUPS_OUTERMOST_FIRST
                  if shape.groups[n].size > 1]
        assert shape.active_names() == list(dict.fromkeys(active))


def test_a_group_spans_nodes_when_its_lowest_and_highest_ranks_do():
    shape = MeshShape(dp_replicate=2, dp_shard=2, tp=2, world_rank=2)   # ranks 0..7
    assert shape.dp_shard.first_world_rank == 0 and shape.dp_shard.last_world_rank == 2
    assert not shape.dp_shard.spans_nodes(4) and shape.dp_shard.spans_nodes(2)
    assert shape.dp_replicate.spans_nodes(4) and not shape.tp.spans_nodes(2)


def test_a_group_counts_the_fewest_ranks_it_has_on_a_node():
    """An outer group over nodes of 4 has a rank per tp rank on each node: 2 of 4 with
    tp = 2 inside it, 1 of 2 over nodes of 2; an inner one all of them. Where nodes do
    not divide it, the node with the fewest counts: dp 8 x cp 3 over nodes of 8 has
    3, 3 and 2 of rank 0's dp group (0, 3, ..., 21) on its three nodes."""
    shape = MeshShape(dp_replicate=2, dp_shard=2, tp=2, world_rank=5)   # ranks 0..7
    assert shape.dp.fewest_ranks_on_a_node(4) == 2
    assert shape.dp.fewest_ranks_on_a_node(2) == 1
    assert shape.dp_replicate.fewest_ranks_on_a_node(4) == 1
    assert shape.tp.fewest_ranks_on_a_node(8) == 2
    assert shape.dp.fewest_ranks_on_a_node(8) == 4
    uneven = MeshShape(dp_shard=8, cp=3, world_rank=0)
    assert uneven.dp.world_ranks() == list(range(0, 24, 3))
    assert uneven.dp.fewest_ranks_on_a_node(8) == 2


@pytest.mark.parametrize("kwargs, words", [
    (dict(tp=0), "mesh tp=0 must be a positive int"),
    (dict(dp_shard=2, cp=3, ep=4), "pass an ep that divides 6"),
    (dict(dp_shard=2, world_rank=2), "use 0 <= world_rank < 2"),
])
def test_a_shape_that_cannot_be_says_the_fix(kwargs, words):
    with pytest.raises(ValueError, match=words):
        MeshShape(**kwargs)

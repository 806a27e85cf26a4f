"""The five-axis mesh pp x dp_replicate x dp_shard x cp x tp: every group holds the ranks
an independent enumeration says, derived groups reuse equal communicators, nodes."""
import itertools

import pytest

from mpishard.comm import Mesh
from mpishard.comm.mesh import ranks_per_node
from mpishard.testing.fake_cupy import make_test_comm

pytestmark = pytest.mark.timeout(60)
AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
GROUPS = {"pp": ("pp",), "dp_replicate": ("dp_replicate",), "dp_shard": ("dp_shard",),
          "cp": ("cp",), "tp": ("tp",), "dp": ("dp_replicate", "dp_shard"),
          "dp_cp": ("dp_replicate", "dp_shard", "cp"), "dp_shard_cp": ("dp_shard", "cp")}


def enumerate_coords(sizes):
    """world rank -> coordinates, tp innermost, pp outermost (nested loops)."""
    ranges = [range(sizes[a]) for a in AXES]
    return {r: dict(zip(AXES, c)) for r, c in enumerate(itertools.product(*ranges))}


SHAPES = [dict(dp_replicate=2, dp_shard=2), dict(cp=4), dict(cp=2, tp=2),
          dict(dp_replicate=2, cp=2), dict(pp=2, cp=2), dict(dp_replicate=2, tp=2),
          dict(dp_replicate=3), dict(cp=3), dict(dp_replicate=2, dp_shard=2, tp=2),
          dict(cp=2, tp=2, pp=2), dict(dp_replicate=2, dp_shard=1, cp=2)]


@pytest.mark.mpi
@pytest.mark.parametrize("given", SHAPES, ids=lambda g: "x".join(f"{a}{n}" for a, n in g.items()))
def test_every_group_holds_the_enumerated_ranks(given):
    world = make_test_comm("world")
    sizes = {a: given.get(a, 1) for a in AXES}
    if "dp_shard" not in given:
        rest = world.size // (sizes["pp"] * sizes["dp_replicate"] * sizes["cp"] * sizes["tp"])
        sizes["dp_shard"] = rest
    product = 1
    for n in sizes.values():
        product *= n
    if product != world.size or sizes["dp_shard"] < 1:
        world.free()
        pytest.skip(f"{given} does not fit world size {world.size}")
    mesh = Mesh(world, **given)
    coords = enumerate_coords(sizes)
    mine = coords[world.rank]
    for a in AXES:
        assert mesh.coords[a] == mine[a]
        assert mesh.shape[a] == sizes[a]
    assert mesh.shape["dp"] == sizes["dp_replicate"] * sizes["dp_shard"]
    for name, axes in GROUPS.items():
        expected = [r for r, c in coords.items()
                    if all(c[a] == mine[a] for a in AXES if a not in axes)]
        group = mesh.axis(name)
        assert group.all_gather_obj(world.rank) == expected, name
    # derived groups with the same ranks are the same communicator, under one name
    if sizes["cp"] == 1 and mesh.dp.size > 1:
        assert mesh.dp_cp is mesh.dp
    if sizes["dp_replicate"] == 1 and sizes["dp_shard"] > 1:
        assert mesh.dp is mesh.dp_shard and mesh.dp.name == "dp"
    names = list(mesh.active_axes())
    assert len(names) == len(set(names))
    assert mesh.world_rank(pp=mine["pp"], dp=mesh.dp_rank, cp=mine["cp"], tp=mine["tp"]) \
        == world.rank
    assert len(mesh.describe_groups()) == len(names)
    mesh.free()
    world.free()


@pytest.mark.parametrize("kwargs,match", [
    (dict(dp_replicate=3, dp=4), r"mesh dp_replicate=3 does not divide dp=4; pass a "
                                 r"dp_replicate that divides 4"),
    (dict(dp_replicate=2, dp_shard=3, dp=4), r"mesh dp_replicate=2 x dp_shard=3 is not "
                                             r"dp=4; pass a dp_replicate that divides 4"),
    (dict(cp=0), r"mesh cp=0 must be a positive int"),
    (dict(cp=3, tp=3), r"mesh cp=3 x tp=3|mesh tp=3 x cp=3"),
])
def test_bad_five_axis_sizes_say_the_fix(kwargs, match):
    world = make_test_comm("world")
    world.mpi, real, world.size = None, world.mpi, 4   # checked before any communication
    with pytest.raises(ValueError, match=match):
        Mesh(world, **kwargs)
    world.mpi, world.size = real, real.Get_size()
    world.free()


@pytest.mark.mpi
def test_ranks_per_node_from_the_environment_or_shared_memory():
    world = make_test_comm("world")
    detected = ranks_per_node(world, environ={})
    assert world.size % detected == 0
    if world.size % 2 == 0:
        assert ranks_per_node(world, environ={"MPISHARD_RANKS_PER_NODE": "2"}) == 2
    with pytest.raises(ValueError, match="MPISHARD_RANKS_PER_NODE='x' must be a positive"):
        ranks_per_node(world, environ={"MPISHARD_RANKS_PER_NODE": "x"})
    world.free()

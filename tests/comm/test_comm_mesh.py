"""Mesh axes hold the right ranks; a mesh that does not fit fails on every rank."""
import pytest
from mpi4py import MPI

from mpishard.comm import Communicator, Mesh, node_local_rank
from mpishard.testing.fake_cupy import make_test_comm

pytestmark = pytest.mark.timeout(60)


def expected_groups(world_size, dp, tp, pp):
    """Independent reference: enumerate coordinates, tp innermost, pp outermost."""
    coords = {}
    rank = 0
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                coords[rank] = (p, d, t)
                rank += 1
    assert rank == world_size

    def members(rank, axis):
        p, d, t = coords[rank]
        same = {"tp": lambda c: c[:2] == (p, d), "dp": lambda c: (c[0], c[2]) == (p, t),
                "pp": lambda c: c[1:] == (d, t)}[axis]
        return [r for r in range(world_size) if same(coords[r])]
    return coords, members


@pytest.mark.mpi
@pytest.mark.parametrize("sizes", [dict(dp=2, tp=2), dict(dp=4), dict(tp=4),
                                   dict(dp=None, tp=1, pp=4), dict(dp=1, tp=2, pp=2),
                                   dict(dp=None)],
                         ids=["dp2xtp2", "dp4xtp1", "dp1xtp4", "pp4", "tp2xpp2", "inferred"])
def test_mesh_groups(sizes):
    world = make_test_comm("world")
    n = world.size
    dp, tp, pp = sizes.get("dp"), sizes.get("tp", 1), sizes.get("pp", 1)
    if (dp or 1) * tp * pp > n or n % (tp * pp) or (dp is not None and dp * tp * pp != n):
        world.free()
        pytest.skip(f"{sizes} does not fit world size {n}")
    mesh = Mesh(world, **sizes)
    dp = n // (tp * pp) if dp is None else dp
    coords, members = expected_groups(n, dp, tp, pp)
    assert (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank) == coords[world.rank]
    assert {a: mesh.shape[a] for a in ("pp", "dp", "tp")} == {"pp": pp, "dp": dp, "tp": tp}
    assert mesh.world is world
    for axis in ("dp", "tp", "pp"):
        group = mesh.axis(axis)
        assert isinstance(group, Communicator) and group.size == mesh.shape[axis]
        assert group.rank == mesh.coords[axis]
        # Who is actually in the group, in group-rank order, per the group itself.
        assert group.all_gather_obj(world.rank) == members(world.rank, axis)
    assert mesh.world_rank(pp=mesh.pp_rank, dp=mesh.dp_rank, tp=mesh.tp_rank) == world.rank
    mesh.free()
    world.free()


@pytest.mark.mpi(min_size=4)
def test_mesh_2x2_and_4x1_explicit():
    """The done-when groups written out for world size 4."""
    world = make_test_comm("world")
    if world.size != 4:
        world.free()
        pytest.skip("written for exactly 4 ranks")
    r = world.rank
    square = Mesh(world, dp=2, tp=2)
    assert square.tp.all_gather_obj(r) == [[0, 1], [0, 1], [2, 3], [2, 3]][r]
    assert square.dp.all_gather_obj(r) == [[0, 2], [1, 3], [0, 2], [1, 3]][r]
    assert square.pp.all_gather_obj(r) == [r]
    flat = Mesh(world, dp=4, tp=1)
    assert flat.dp.all_gather_obj(r) == [0, 1, 2, 3]
    assert flat.tp.all_gather_obj(r) == [r]
    square.free()
    flat.free()
    world.free()


@pytest.mark.mpi
@pytest.mark.parametrize("kwargs,match", [
    (dict(dp=3, tp=2), r"mesh dp=3 x tp=2 = 6 does not match world size {n}; pass sizes "
                       r"whose product is {n}"),
    (dict(dp=0), r"mesh dp=0 must be a positive int"),
    (dict(tp=2.0), r"mesh tp=2.0 must be a positive int"),
    (dict(tp=3, pp=3), r"mesh tp=3 x pp=3 = 9 exceeds the world size {n}; launch at least 9 "
                       r"ranks"),
    (dict(sp=2), r"unknown mesh axis 'sp'; the axes are pp, dp_replicate, dp_shard, cp and tp"),
    (dict(ep=5), r"mesh ep=5 must be a positive int dividing dp_shard x cp"),
])
def test_mesh_that_does_not_fit(kwargs, match):
    world = make_test_comm("world")
    world.mpi, real = None, world.mpi  # any communication would fail differently
    with pytest.raises(ValueError, match=match.format(n=world.size)):
        Mesh(world, **kwargs)
    world.mpi = real
    world.free()


@pytest.mark.mpi
def test_mesh_sizes_that_do_not_divide():
    """tp x pp below the world size but not a divisor of it (a world of 6, tp=4)."""
    world = make_test_comm("world")
    world.mpi, real, world.size = None, world.mpi, 6   # checked before any communication
    with pytest.raises(ValueError, match=r"mesh tp=4 = 4 does not divide world size 6"):
        Mesh(world, tp=4)
    world.mpi, world.size = real, real.Get_size()
    world.free()


def test_mesh_rejects_raw_mpi_and_unknown_axis_lookup():
    with pytest.raises(TypeError, match="needs a mpishard Communicator"):
        Mesh(MPI.COMM_SELF)
    mesh = Mesh(Communicator(MPI.COMM_SELF, "self"))
    with pytest.raises(ValueError, match="mesh has no axis 'sp'"):
        mesh.axis("sp")
    with pytest.raises(ValueError, match="coordinate tp=1 is out of range"):
        mesh.world_rank(tp=1)
    assert mesh.shape == {"pp": 1, "dp": 1, "tp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1,
                          "ep": 1}
    mesh.free()


@pytest.mark.mpi
def test_node_local_rank():
    world = make_test_comm("world")
    local = node_local_rank(world)
    # All ranks of a CI run share one node: local rank equals world rank.
    hosts = world.all_gather_obj(MPI.Get_processor_name())
    if len(set(hosts)) == 1:
        assert local == world.rank
    assert 0 <= local < world.size
    assert node_local_rank(MPI.COMM_SELF) == 0
    world.free()

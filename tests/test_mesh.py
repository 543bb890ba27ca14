"""The (dp, cp) mesh: group membership at world 4, node locality, and the ring x ulysses split."""

from __future__ import annotations

import pytest

from tests.distributed import spawn


def _groups(mesh):
    return {"dp": mesh["dp"].mesh.tolist(), "cp": mesh["cp"].mesh.tolist(), "names": mesh.mesh_dim_names}


def _mesh_worker(rank, world):
    import torch.distributed as dist

    from cp_lightning import build_mesh
    from cp_lightning.mesh import cp_groups

    out = {cp: _groups(build_mesh(cp)) for cp in (1, 2, 4)}
    groups = cp_groups(build_mesh(4, ring=2), ring=2)
    out["ring2"] = {
        "ulysses": dist.get_process_group_ranks(groups.ulysses),
        "ring": dist.get_process_group_ranks(groups.ring),
        "sizes": (groups.cp_size, groups.ring_size, groups.ulysses_size),
    }
    return out


def _two_node_worker(rank, world):
    from cp_lightning import build_mesh

    out = {"cp2": _groups(build_mesh(2))}
    try:
        build_mesh(4)
    except ValueError as err:
        out["cp4_error"] = str(err)
    out["cp4_opt_in"] = _groups(build_mesh(4, allow_cross_node=True))
    return out


@pytest.fixture(scope="module")
def world4():
    return spawn(_mesh_worker, 4)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_dp_and_cp_groups_at_world_4(world4, cp):
    dp = 4 // cp
    for rank, result in enumerate(world4):
        groups = result[cp]
        assert groups["names"] == ("dp", "cp")
        start = rank // cp * cp
        assert groups["cp"] == list(range(start, start + cp)), (rank, groups)  # consecutive ranks
        assert groups["dp"] == [rank % cp + i * cp for i in range(dp)], (rank, groups)


def test_ring_and_ulysses_split_of_the_cp_axis(world4):
    for rank, result in enumerate(world4):
        ring2 = result["ring2"]
        assert ring2["sizes"] == (4, 2, 2)
        assert ring2["ulysses"] == [rank // 2 * 2, rank // 2 * 2 + 1]  # ulysses innermost: neighbours
        assert ring2["ring"] == [rank % 2, rank % 2 + 2]


def test_cp_groups_stay_inside_a_simulated_node():
    # two "nodes" of two processes each, ranks numbered node by node as launchers do
    results = spawn(_two_node_worker, 4, env={"LOCAL_WORLD_SIZE": "2"})
    for rank, result in enumerate(results):
        node = rank // 2
        assert all(r // 2 == node for r in result["cp2"]["cp"]), result
        assert "span nodes" in result["cp4_error"] and "allow_cross_node" in result["cp4_error"]
        assert result["cp4_opt_in"]["cp"] == [0, 1, 2, 3]

"""The (dp, cp) mesh: group membership at world 4, node locality, and the ring x ulysses split."""

from __future__ import annotations

import pytest

from tests.distributed import spawn


def _groups(mesh):
    return {"dp": mesh["dp"].mesh.tolist(), "cp": mesh["cp"].mesh.tolist(), "names": mesh.mesh_dim_names}


def _mesh_worker(rank, world):
    import torch
    import torch.distributed as dist

    from cp_lightning import build_mesh
    from cp_lightning.mesh import cp_groups, cp_subgroups

    out = {cp: _groups(build_mesh(cp)) for cp in (1, 2, 4)}

    # every group is warmed (one collective) where it is created, not at its first use mid-step
    warmed, all_reduce = [], dist.all_reduce

    def spy(tensor, *args, group=None, **kwargs):
        warmed.append(dist.get_process_group_ranks(group))
        return all_reduce(tensor, *args, group=group, **kwargs)

    dist.all_reduce = spy
    try:
        mesh = build_mesh(4, ring=2)
        out["warmed_mesh"], warmed[:] = list(warmed), []
        groups = cp_groups(mesh, ring=2)
        out["warmed_ring2"], warmed[:] = list(warmed), []
        cp_subgroups(mesh, ring=2)
        out["warmed_sub"] = list(warmed)
    finally:
        dist.all_reduce = all_reduce
    out["ring2"] = {
        "ulysses": dist.get_process_group_ranks(groups.ulysses),
        "ring": dist.get_process_group_ranks(groups.ring),
        "sizes": (groups.cp_size, groups.ring_size, groups.ulysses_size),
    }

    # CUDA visible, but the process group is gloo: the mesh must be a CPU one (a "cuda" mesh over gloo breaks
    # the CPU suite, the checker and the demos on a GPU machine)
    is_available = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        out["device_over_gloo"] = build_mesh(2).device_type
    except Exception as err:  # noqa: BLE001 - the old behaviour: a "cuda" mesh on a CPU build
        out["device_over_gloo"] = f"{type(err).__name__}: {err}"
    finally:
        torch.cuda.is_available = is_available
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


def test_the_mesh_device_follows_the_process_group_not_cuda_visibility(world4):
    assert [result["device_over_gloo"] for result in world4] == ["cpu"] * 4


def test_every_new_group_is_warmed_where_it_is_created(world4):
    for rank, result in enumerate(world4):
        pair, ring = [rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2]
        assert result["warmed_mesh"] == [[rank], [0, 1, 2, 3]], result  # dp, cp
        assert result["warmed_ring2"] == [pair, ring], result  # ulysses, ring
        assert result["warmed_sub"] == [[rank], pair], result  # dynamic CP's degrees 1 and 2


def test_backend_device_type_reads_multi_device_backends(monkeypatch):
    import torch.distributed as dist

    from cp_lightning.mesh import backend_device_type

    for backend, device in (("gloo", "cpu"), ("nccl", "cuda"), ("cpu:gloo,cuda:nccl", "cuda"), ("mpi", "cpu")):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, backend=backend: backend)
        assert backend_device_type() == device, backend

"""The (dp, cp) device mesh: the one object that owns every process group cp_lightning uses.

Ranks are laid out row-major as ``(dp, cp)``, so each context-parallel (CP) group is a run of
consecutive ranks. Launchers (torchrun, Lightning, SLURM) number ranks node by node, so a CP group
stays inside a node whenever ``cp`` divides the number of processes per node. Inside the cp axis,
ranks are further laid out as ``(ring, ulysses)`` with ulysses innermost: Ulysses' all-to-alls run
between neighbouring (intra-node) ranks, the ring between groups of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# Axis names, kept in one place.
DP = "dp"
CP = "cp"
RING = "ring"
ULYSSES = "ulysses"


def _require_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "cp_lightning needs an initialised default process group: call "
            "torch.distributed.init_process_group(...) first (or launch through Lightning / torchrun), "
            "or pass an existing DeviceMesh as mesh=."
        )


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r}).")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}.")
    return value


def validate_degrees(
    cp: int, ring: int, world_size: int, local_world_size: int | None = None, *, allow_cross_node: bool = False
) -> None:
    """Check a (cp, ring) layout against the job's size; raises ValueError with the fix.

    Pure arithmetic, no collectives: safe to call on every rank before any communication.
    """
    _check_int("cp", cp)
    _check_int("ring", ring)
    if cp % ring != 0:
        raise ValueError(f"ring={ring} must divide cp={cp} (cp = ring x ulysses); pick ring from the divisors of cp.")
    if world_size % cp != 0:
        raise ValueError(
            f"cp={cp} must divide the number of processes ({world_size}); the data-parallel degree is "
            f"world/cp. Use a cp that divides {world_size}, or launch a multiple of {cp} processes."
        )
    if local_world_size is not None and not allow_cross_node and local_world_size % cp != 0:
        raise ValueError(
            f"cp={cp} does not divide the {local_world_size} processes per node, so a CP group would span "
            f"nodes (slow inter-node all-to-alls). Use a cp that divides {local_world_size}, or pass "
            "allow_cross_node=True if that is what you want."
        )


def _local_world_size() -> int | None:
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else None


# The device a backend's collectives run on. gloo takes CUDA tensors for some collectives but not for send/recv
# (DESIGN.md section 9.4), so a gloo group means a CPU mesh even where CUDA is visible.
_BACKEND_DEVICES = {"nccl": "cuda", "xccl": "xpu", "hccl": "hpu"}


def backend_device_type(group: dist.ProcessGroup | None = None) -> str:
    """The device type ``group``'s (default: the world's) collectives run on: ``"cuda"`` for NCCL, ``"cpu"``
    for gloo. A multi-device backend string (``"cpu:gloo,cuda:nccl"``) gives its accelerator."""
    backend = str(dist.get_backend(group)).lower()
    for part in backend.split(","):
        name = part.rpartition(":")[2]
        if name in _BACKEND_DEVICES:
            return _BACKEND_DEVICES[name]
    return "cpu"


def build_mesh(cp: int, *, ring: int = 1, device_type: str | None = None, allow_cross_node: bool = False) -> DeviceMesh:
    """Build the ``(dp, cp)`` DeviceMesh over the default process group.

    ``dp = world_size // cp``. CP groups are consecutive ranks, inside a node unless
    ``allow_cross_node`` (checked against ``LOCAL_WORLD_SIZE`` when the launcher sets it).
    ``ring`` is validated here (it must divide ``cp``); the ``(ring, ulysses)`` groups themselves are
    built by :func:`cp_groups`. ``device_type`` defaults to the process group's
    (:func:`backend_device_type`: ``"cuda"`` over NCCL, ``"cpu"`` over gloo, whether or not CUDA is
    visible). The mesh's groups are warmed at once (:func:`warm_groups`).
    """
    _require_process_group()
    world_size = dist.get_world_size()
    validate_degrees(cp, ring, world_size, _local_world_size(), allow_cross_node=allow_cross_node)
    if device_type is None:
        device_type = backend_device_type()
    elif not isinstance(device_type, str):
        raise TypeError(f"device_type must be a str such as 'cuda' or 'cpu', got {type(device_type).__name__}.")
    mesh = init_device_mesh(device_type, (world_size // cp, cp), mesh_dim_names=(DP, CP))
    warm_groups([mesh[DP].get_group(), mesh[CP].get_group()], device_type)
    return mesh


def _device_for(device_type: str) -> torch.device:
    """This rank's device of ``device_type``: for CUDA the one the default group is bound to (eager NCCL
    init), else the current one; new groups must name the bound device if there is one."""
    if device_type != "cuda":
        return torch.device(device_type)
    bound = dist.distributed_c10d._get_default_group().bound_device_id
    return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())


def warm_groups(groups, device_type: str) -> None:
    """One tiny all-reduce on each of this rank's ``groups`` (None and repeats skipped), in order.

    NCCL creates a group's communicator at its first collective: without this, dynamic CP's sub-groups and
    the ring/Ulysses groups would each pay that (seconds, and a collective with every peer) in the middle of a
    training step, at the first step that uses them. Collective: every member of each group calls this with
    the same groups in the same order (the group lists below are built alike on every rank).
    """
    seen: set[int] = set()
    for group in groups:
        if group is None or id(group) in seen:
            continue
        seen.add(id(group))
        dist.all_reduce(torch.zeros(1, device=_device_for(device_type)), group=group)


@dataclass(frozen=True)
class CPGroups:
    """The process groups inside one CP group: the whole cp axis, and its ring and ulysses parts."""

    cp: dist.ProcessGroup
    ulysses: dist.ProcessGroup
    ring: dist.ProcessGroup | None
    cp_size: int
    ring_size: int

    @property
    def ulysses_size(self) -> int:
        return self.cp_size // self.ring_size


# Keyed by (id(mesh), ring); the mesh is stored beside its groups so that its id cannot be reused.
_GROUP_CACHE: dict[tuple[int, int], tuple[DeviceMesh, CPGroups]] = {}


def cp_groups(mesh: DeviceMesh, ring: int = 1) -> CPGroups:
    """Return the cp / ring / ulysses process groups of ``mesh`` (a mesh with a ``"cp"`` axis).

    With ``ring == 1`` no new group is created: Ulysses runs over the whole cp axis. Otherwise every
    rank of the mesh must call this (new groups are created collectively); results are cached.
    """
    if mesh.mesh_dim_names is None or CP not in mesh.mesh_dim_names:
        raise ValueError(
            f"the mesh needs an axis named {CP!r}, got axes {mesh.mesh_dim_names}; build it with build_mesh."
        )
    cp_mesh = mesh[CP] if mesh.ndim > 1 else mesh
    cp_size = cp_mesh.size()
    _check_int("ring", ring)
    if cp_size % ring != 0:
        raise ValueError(
            f"ring={ring} must divide cp={cp_size} (cp = ring x ulysses); pick ring from the divisors of cp."
        )
    key = (id(mesh), ring)
    if key in _GROUP_CACHE:
        return _GROUP_CACHE[key][1]
    if ring == 1:
        groups = CPGroups(cp=cp_mesh.get_group(), ulysses=cp_mesh.get_group(), ring=None, cp_size=cp_size, ring_size=1)
    else:
        # B, cp -> dp, ring, ulysses over the same ranks: ulysses innermost so its groups are neighbours.
        layout = mesh.mesh.reshape(-1, ring, cp_size // ring)
        sub = DeviceMesh(mesh.device_type, layout, mesh_dim_names=(DP, RING, ULYSSES))
        groups = CPGroups(
            cp=cp_mesh.get_group(),
            ulysses=sub[ULYSSES].get_group(),
            ring=sub[RING].get_group(),
            cp_size=cp_size,
            ring_size=ring,
        )
        warm_groups([groups.ulysses, groups.ring], mesh.device_type)  # new groups: every rank is here
    _GROUP_CACHE[key] = (mesh, groups)
    return groups


def sub_degrees(cp: int) -> list[int]:
    """The CP degrees dynamic CP runs at: every power of two dividing ``cp`` (``cp`` must be one), ascending."""
    _check_int("cp", cp)
    if cp & (cp - 1):
        raise ValueError(
            f"dynamic_cp needs a power-of-two cp (its sub-groups halve down to 1), got cp={cp}; use cp="
            f"{1 << (cp.bit_length() - 1)} or {1 << cp.bit_length()}, or dynamic_cp=False."
        )
    return [1 << k for k in range(cp.bit_length())]


def sub_layout(degree: int, cp: int, ring: int) -> tuple[int, int]:
    """(ring, ulysses) of a CP sub-group of ``degree`` ranks, when the whole cp axis runs ``ring`` x ``cp / ring``.

    Ulysses keeps at most the full layout's degree (so every head count that suits the full layout suits
    each sub-group), filling the sub-group before any ring is added."""
    ulysses = min(degree, cp // ring)
    return degree // ulysses, ulysses


_SUBGROUP_CACHE: dict[tuple[int, int], tuple[DeviceMesh, dict[int, CPGroups]]] = {}


def cp_subgroups(mesh: DeviceMesh, ring: int = 1) -> dict[int, CPGroups]:
    """This rank's CP sub-groups: for every degree c of :func:`sub_degrees`, runs of c consecutive ranks of its
    CP group, split into (ring, ulysses) like the whole axis (:func:`sub_layout`). Degree cp is
    :func:`cp_groups`' own. Collective: every rank of the world calls it (new groups); results are cached."""
    cp_size = (mesh[CP] if mesh.ndim > 1 else mesh).size()
    key = (id(mesh), ring)
    if key in _SUBGROUP_CACHE:
        return _SUBGROUP_CACHE[key][1]
    world, rank = dist.get_world_size(), dist.get_rank()
    device_id = _device_for("cuda") if mesh.device_type == "cuda" else None
    out: dict[int, CPGroups] = {}
    for degree in sub_degrees(cp_size):
        if degree == cp_size:
            out[degree] = cp_groups(mesh, ring)
            continue
        sub_ring, ulysses = sub_layout(degree, cp_size, ring)
        starts = range(0, world, degree)  # CP groups are consecutive runs of cp ranks, and degree divides cp
        cp_group = _subgroup([list(range(s, s + degree)) for s in starts], rank, device_id)
        ulysses_group, ring_group = cp_group, None
        if sub_ring > 1:
            # s + ring position x ulysses + ulysses position, as in cp_groups
            ulysses_group = _subgroup([list(range(u, u + ulysses)) for u in range(0, world, ulysses)], rank, device_id)
            rings = [list(range(s + i, s + degree, ulysses)) for s in starts for i in range(ulysses)]
            ring_group = _subgroup(rings, rank, device_id)
        out[degree] = CPGroups(cp=cp_group, ulysses=ulysses_group, ring=ring_group, cp_size=degree, ring_size=sub_ring)
    # every rank built every group above: warm its own, degree by degree, in the same order everywhere
    warm_groups([g for d in sorted(out) if d != cp_size for g in (out[d].cp, out[d].ulysses, out[d].ring)],
                mesh.device_type)  # fmt: skip
    _SUBGROUP_CACHE[key] = (mesh, out)
    return out


def _subgroup(rank_lists: list[list[int]], rank: int, device_id: torch.device | None = None) -> dist.ProcessGroup:
    """Create every group of ``rank_lists`` (collective: all ranks create all of them) and return ``rank``'s.

    ``device_id`` (CUDA meshes): NCCL connects each new group at creation (eager init) instead of at its
    first collective."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks, device_id=device_id)
        if rank in ranks:
            mine = group
    assert mine is not None, (rank, rank_lists)
    return mine

"""``parallelize``: the framework-free entry point that makes a diffusers model context parallel.

Order of work: validate everything that can be validated locally (plan, degrees, heads), then build
or read the mesh (the first collective), then install split/gather hooks and route attention. A user
mistake is therefore a ValueError on every rank alike, never a hang in a half-entered collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

from cp_lightning import attention, collectives, routing
from cp_lightning.checks import ConsistencyCheck
from cp_lightning.kernels import get_kernel
from cp_lightning.mask_layout import Layout
from cp_lightning.mesh import CP, CPGroups, _require_process_group, build_mesh, cp_groups, validate_degrees
from cp_lightning.plan import JointInput, apply_plan, check_loss_parallel, remove_plan, resolve_plan, unsplit_paths
from cp_lightning.split_table import SplitState

_STATE = "_cp_lightning_state"


@dataclass
class ParallelState:
    """What ``parallelize`` changed on a module, so that :func:`remove` can undo it."""

    mesh: DeviceMesh
    groups: CPGroups
    handles: list[RemovableHandle]
    attention_modules: list[tuple[str, nn.Module]]
    check: ConsistencyCheck | None  # None when check_steps is 0: nothing of it is installed
    loss_parallel: bool
    split: SplitState  # every rank's shard lengths in the current forward pass
    routes: list = field(default_factory=list)  # routing.Route per routed attention module
    layout: str = "contiguous"  # how the split hooks cut the sequence (see parallelize's ``layout``)


def _library_entry(module: nn.Module, plan):
    """The plan library's entry ``parallelize`` uses (None when the caller passes a plan)."""
    from cp_lightning.models import lookup

    return lookup(module) if plan is None else None


def _check_entry_loss_parallel(module: nn.Module, plan) -> None:
    """A library plan whose outputs cannot stay sharded for a reason no engine rule sees (its entry says why)."""
    entry = _library_entry(module, plan)
    if entry is not None and entry.loss_parallel:
        raise ValueError(
            f"loss_parallel cannot be used with {type(module).__name__}: {entry.loss_parallel}. Train it without "
            "loss_parallel (its outputs are gathered, and exact)."
        )


def parallelize(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    cp: int | None = None,
    ring: int = 1,
    plan: Mapping | None = None,
    kernel: str | None = None,
    loss_parallel: bool = False,
    check_steps: int = 0,
    layout: str = "contiguous",
) -> nn.Module:
    """Make ``module`` context parallel, in place, and return it.

    Inputs must be full and identical on every rank of a CP group; outputs at the plan's gather
    points come back full and identical. After ``backward()`` each rank's parameter gradients are
    its own shard's contribution: their SUM over the CP group is the single-device gradient.

    Args:
        module: a diffusers transformer (or any module, given ``plan``).
        mesh: a mesh with a ``"cp"`` axis (from :func:`build_mesh`); built from ``cp`` when omitted.
        cp: the CP degree; needed when ``mesh`` is omitted, checked against it otherwise.
        ring: ring degree inside cp (cp = ring x ulysses); 1 means pure Ulysses.
        plan: a plan in diffusers' ``_cp_plan`` vocabulary; defaults to the plan library's entry for the
            module's class, else its diffusers ``_cp_plan`` (:func:`cp_lightning.models.plan_for`).
        kernel: the local attention kernel ring attention uses (see ``cp_lightning.kernels.KERNELS``);
            by default the best one for the device and dtype.
        loss_parallel: leave the outputs at the plan's gather points sharded; compute the loss on
            each rank's shard (see :func:`loss_shard` for the targets).
        check_steps: for this many training forward passes, check at every split point that the CP
            peers were given identical inputs (:class:`cp_lightning.checks.CPMismatchError` if not).
        layout: how the split hooks cut the sequence. ``"contiguous"`` (default): one run per rank.
            ``"head_tail"``: rank r holds runs r and 2P-1-r of 2P (whole frames where they divide evenly,
            :meth:`~cp_lightning.mask_layout.Layout.head_tail`), so a ring under a block-causal mask is
            balanced; gathers put the tokens back in order. For plan-library entries that support it
            (SkyReels-V2); refused with loss_parallel, JointInput plans and dynamic CP (docs/masks.md).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize() takes a torch.nn.Module, got {type(module).__name__}.")
    if getattr(module, _STATE, None) is not None:
        raise ValueError("this module is already parallelized; call cp_lightning.remove(module) first.")
    if mesh is None and cp is None:
        raise ValueError("pass either mesh= (from cp_lightning.build_mesh) or cp= (the context-parallel degree).")
    _require_process_group()
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh) or mesh.mesh_dim_names is None or CP not in mesh.mesh_dim_names:
            raise ValueError(
                f"mesh must be a DeviceMesh with a {CP!r} axis (use cp_lightning.build_mesh); got {mesh!r}."
            )
        mesh_cp = mesh[CP].size() if mesh.ndim > 1 else mesh.size()
        if cp is not None and cp != mesh_cp:
            raise ValueError(f"cp={cp} disagrees with the mesh's cp axis of size {mesh_cp}; pass one or the other.")
        cp = mesh_cp
        validate_degrees(cp, ring, mesh.size(), allow_cross_node=True)
    else:
        validate_degrees(cp, ring, dist.get_world_size(), allow_cross_node=True)
    if kernel is not None:
        get_kernel(kernel)

    entries = resolve_plan(module, plan)
    _check_layout(module, plan, entries, layout, loss_parallel)
    if loss_parallel:
        check_loss_parallel(module, entries)
        _check_entry_loss_parallel(module, plan)
    found = routing.check_processors(module, cp // ring, unsplit_paths(entries))

    if mesh is None:
        mesh = build_mesh(cp, ring=ring)
    groups = cp_groups(mesh, ring)
    check = ConsistencyCheck(groups.cp, check_steps) if check_steps else None
    state = SplitState(groups.cp, check)  # written by the split hooks, read by the gathers and the attention
    handles = apply_plan(entries, groups.cp, check=check, gather=not loss_parallel, state=state, root=module)
    if check is not None:
        handles.append(module.register_forward_pre_hook(lambda mod, _args: check.on_forward(mod), prepend=True))
    routes = routing.route_processors(found, attention.ContextParallelAttention(groups, kernel, state), state)
    handles.extend(handle for route in routes for handle in route.handles)
    entry = _library_entry(module, plan)
    if entry is not None and entry.install is not None:  # the entry's own hooks (a mask spec), removed with ours
        handles.extend(entry.install(module))
    setattr(module, _STATE, ParallelState(mesh, groups, handles, found, check, loss_parallel, state, routes, layout))
    return module


def _check_layout(module: nn.Module, plan, entries, layout: str, loss_parallel: bool) -> None:
    """Refuse, before any collective, a ``layout`` the split hooks cannot follow exactly for this model."""
    if layout not in ("contiguous", "head_tail"):
        raise ValueError(f"layout must be 'contiguous' or 'head_tail', got {layout!r}.")
    if layout == "contiguous":
        return
    joint = [entry.path for entry in entries if isinstance(entry.spec, Mapping)
             for value in entry.spec.values() if isinstance(value, JointInput)]  # fmt: skip
    if joint:
        raise ValueError(
            f"layout='head_tail' cannot split this plan exactly: it has JointInput tensors (at {joint[0]!r}) that "
            "concatenate sequences split apart, whose ranks' pieces a single head_tail layout does not describe. "
            "Use layout='contiguous'."
        )
    entry = _library_entry(module, plan)
    if entry is None or not entry.head_tail:
        how = "a plan passed by hand" if plan is not None else f"{type(module).__name__}'s plan-library entry"
        raise ValueError(
            f"layout='head_tail' is not supported with {how}: the sequence and its frame size must be known before "
            "each forward's first split, which only entries whose hooks report them provide (SkyReels-V2, "
            "plan=None). Use layout='contiguous' (Ulysses, ring=1, is balanced under any mask)."
        )
    if loss_parallel:
        raise ValueError(
            "loss_parallel cannot be combined with layout='head_tail': the outputs would stay sharded in the "
            "layout's head and tail runs, and loss_shard cuts targets contiguously. Train with loss_parallel=False "
            "(the outputs are gathered back in token order, and exact)."
        )


def set_layout(module: nn.Module, length: int, unit: int = 1) -> Layout | None:
    """This forward's token layout of the ``length``-token sequence (``unit``: tokens per frame), for a module
    parallelized with ``layout="head_tail"``; None (contiguous) otherwise. An entry's hooks call it before the
    forward's first split: the split hooks, the gathers and the mask-spec attention then all follow it, until
    the next call (activation checkpointing's recomputation, after forward, finds the same one). Local."""
    state = parallel_state(module)
    if state is None or state.layout != "head_tail":
        return None
    layout = Layout.head_tail(length, state.groups.cp_size, unit)
    state.split.layout = layout
    for route in state.routes:
        route.config.layout = layout
    return layout


def remove(module: nn.Module) -> nn.Module:
    """Undo :func:`parallelize`: remove hooks and restore local attention. Returns ``module``."""
    state = getattr(module, _STATE, None)
    if state is None:
        raise ValueError("this module is not parallelized.")
    remove_plan(state.handles)
    routing.unroute_processors(state.attention_modules, state.routes)
    delattr(module, _STATE)
    return module


def set_groups(module: nn.Module, groups: CPGroups) -> None:
    """Run a parallelized ``module``'s next forward passes over ``groups`` instead (a CP sub-group of the one
    it was parallelized over: :mod:`cp_lightning.dynamic`). Local, no collective: every rank of the new
    group must switch before the next forward pass, and the model's heads must suit its Ulysses degree."""
    state = parallel_state(module)
    if state is None:
        raise ValueError("this module is not parallelized.")
    if state.layout != "contiguous":
        raise ValueError(
            f"dynamic CP cannot switch a module parallelized with layout={state.layout!r}: its layouts are built for "
            "the CP degree it was parallelized at. Use layout='contiguous' with dynamic CP."
        )
    state.groups = groups
    state.split.set_group(groups.cp)
    if state.check is not None:
        state.check.group = groups.cp  # the consistency check then compares the sub-group's peers
    for route in state.routes:
        route.config.groups = groups


def parallel_state(module: nn.Module) -> ParallelState | None:
    """The :class:`ParallelState` of a parallelized module, or None."""
    return getattr(module, _STATE, None)


def loss_shard(target, module: nn.Module, dim: int = 1):
    """This rank's shard of ``target`` when ``module`` runs in loss-parallel mode, else ``target``.

    In loss-parallel mode the model's output stays split along the sequence, so the loss needs the
    matching slice of the target. The same code then runs unchanged with and without CP. The loss
    must be a mean over the shard's tokens (e.g. ``F.mse_loss``): when the CP degree does not divide
    the sequence, shards differ in length, and the output's gradient is weighted so that DDP's mean
    over ranks equals the full-sequence mean (see ``cp_lightning.plan.hooks._gather_hook``).
    """
    state = parallel_state(module)
    if state is None or not state.loss_parallel:
        return target
    return collectives.shard(target, dim, state.groups.cp)

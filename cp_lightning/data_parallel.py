"""How a context-parallel model is made data parallel: the one place the adapters share.

The Lightning strategy, the Fabric strategy and the Accelerate integration are thin adapters over the
functions here, applied in a fixed order:

1. :func:`check_cp_options` (and the adapter's own layout checks): pure arithmetic, before any collective;
2. :func:`seed_by_dp_rank`: one job seed offset by the dp rank (equal on CP peers, different across dp);
3. :func:`parallelize_targets`: :func:`cp_lightning.parallelize` every module that has a plan;
4. data-parallel wrapping with the exact gradient math

       full gradient = SUM over cp (each CP rank holds its shard's part) and MEAN over dp

   DDP: :func:`register_ddp_hook` (one all-reduce per bucket over the flattened dp x cp group, divided
   by dp; plain DDP divides by dp x cp, cp times too small). In loss-parallel mode each rank's loss
   covers its own shard, so DDP's plain mean over dp x cp is already exact and no hook is installed;
5. checkpoint state: :func:`gather_rng_states` / :func:`restore_rng_state` keep each dp rank's RNG.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cp_lightning.kernels import get_kernel
from cp_lightning.mesh import _check_int
from cp_lightning.models import has_plan
from cp_lightning.parallelize import parallel_state, parallelize
from cp_lightning.plan import resolve_plan

__all__ = [
    "check_cp_options",
    "gather_rng_states",
    "parallelize_targets",
    "plan_targets",
    "register_ddp_hook",
    "restore_rng_state",
    "seed_by_dp_rank",
    "sum_cp_mean_dp_hook",
]


# -- options ----------------------------------------------------------------------------------------
def check_cp_options(cp: int, ring: int, plan: Mapping | None, kernel: str | None, check_steps: int) -> None:
    """Validate the CP options shared by the strategies and the Accelerate integration (no collectives)."""
    _check_int("cp", cp)
    _check_int("ring", ring)
    if cp % ring != 0:
        raise ValueError(f"ring={ring} must divide cp={cp} (cp = ring x ulysses); pick ring from the divisors of cp.")
    if plan is not None and not isinstance(plan, Mapping):
        raise TypeError(f"plan must be a dict of module path -> CP plan, got {type(plan).__name__}.")
    if kernel is not None:
        get_kernel(kernel)
    if check_steps < 0:
        raise ValueError(f"check_steps must be >= 0, got {check_steps}.")


# -- seeding ----------------------------------------------------------------------------------------
def seed_by_dp_rank(dp_rank: int, base: int | str | None) -> int:
    """Seed torch (CPU and every CUDA device) and ``random`` with one job seed offset by the dp rank.

    Noise, timesteps and dropout drawn in a training step must be equal on CP peers and differ across
    dp ranks. Rank 0's ``base`` is broadcast, so ranks that were seeded differently still agree;
    ``None`` on rank 0 draws a fresh random base. Collective: every rank calls it. Returns the seed.
    """
    shared = [int(base) if base is not None else random.SystemRandom().randrange(2**31)]
    dist.broadcast_object_list(shared, src=0)
    seed = (shared[0] + 1_000_003 * dp_rank) % 2**63
    torch.manual_seed(seed)
    random.seed(seed)
    return seed


# -- parallelization --------------------------------------------------------------------------------
def plan_targets(root: nn.Module, plan: Mapping | None) -> list[tuple[str, nn.Module, Mapping | None]]:
    """(path, module, plan) for every module to parallelize: those named by ``plan``, else every
    outermost submodule that has a plan (a diffusers ``_cp_plan`` or an entry in cp_lightning.models)."""
    if plan is not None:
        targets = []
        for path, module_plan in plan.items():
            try:
                targets.append((path, root.get_submodule(path), module_plan))
            except AttributeError:
                raise ValueError(f"plan names module {path!r}, which {type(root).__name__} does not have.") from None
        return targets
    targets, covered = [], []
    for name, module in root.named_modules():
        if has_plan(module) and not any(name.startswith(c + ".") or c == "" for c in covered):
            targets.append((name, module, None))
            covered.append(name)
    if not targets:
        raise ValueError(
            f"no submodule of {type(root).__name__} has a diffusers `_cp_plan` or a plan in cp_lightning.models, so "
            "there is nothing to split. "
            "Pass plan={'path.to.module': {...}} (to ContextParallelStrategy or cp_lightning.accelerate) with a plan "
            "per module, in diffusers' ContextParallelInput/ContextParallelOutput vocabulary."
        )
    return targets


def check_targets(root: nn.Module, plan: Mapping | None) -> None:
    """Resolve every target's plan (a ValueError on every rank alike; no collectives)."""
    for _, module, module_plan in plan_targets(root, plan):
        resolve_plan(module, module_plan)


def parallelize_targets(
    root: nn.Module,
    *,
    mesh: DeviceMesh,
    plan: Mapping | None,
    ring: int,
    kernel: str | None,
    loss_parallel: bool,
    check_steps: int,
) -> None:
    """:func:`parallelize` every target of :func:`plan_targets`, after validating all of them (so a bad
    plan is a ValueError on every rank before the first collective). Already parallelized ones are skipped."""
    targets = plan_targets(root, plan)
    for _, module, module_plan in targets:
        resolve_plan(module, module_plan)
    for _, module, module_plan in targets:
        if parallel_state(module) is None:
            parallelize(
                module,
                mesh=mesh,
                ring=ring,
                plan=module_plan,
                kernel=kernel,
                loss_parallel=loss_parallel,
                check_steps=check_steps,
            )


# -- DDP gradient math ------------------------------------------------------------------------------
def sum_cp_mean_dp_hook(dp_size, bucket):
    """All-reduce a gradient bucket over dp x cp and divide by dp: SUM over cp, MEAN over dp.

    (No annotations: DDP checks them against dist.GradBucket, and this module's are strings.)
    """
    buffer = bucket.buffer()
    buffer.div_(dp_size)
    work = dist.all_reduce(buffer, group=dist.group.WORLD, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def register_ddp_hook(ddp: nn.parallel.DistributedDataParallel, dp_size: int, loss_parallel: bool) -> None:
    """Give ``ddp`` (wrapping the whole dp x cp world) the exact gradient reduction."""
    if loss_parallel:
        return  # plain DDP mean over dp x cp is exact when each rank's loss covers its own shard
    ddp.register_comm_hook(state=dp_size, hook=sum_cp_mean_dp_hook)


# -- checkpoint state -------------------------------------------------------------------------------
def gather_rng_states(dp_rank: int) -> dict[int, dict]:
    """Every dp rank's RNG state, on every rank (collective). CP peers hold equal states."""
    local = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        local["cuda"] = torch.cuda.get_rng_state_all()
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, (dp_rank, local))
    return dict(states)


def restore_rng_state(states: dict | None, dp_rank: int, dp_size: int | None = None) -> None:
    """Restore this dp rank's RNG state from :func:`gather_rng_states`'s result (no collectives).

    Every rank checks that *all* ``dp_size`` dp ranks have a state, so a layout the checkpoint cannot
    serve is the same ValueError everywhere rather than some ranks waiting for the others.
    """
    if not states:
        return
    needed = range(dp_size) if dp_size is not None else [dp_rank]
    missing = [r for r in needed if r not in states]
    if missing:
        raise ValueError(
            f"the checkpoint holds RNG states for dp ranks {sorted(states)}, but this run has dp ranks "
            f"{list(needed)}; resume with a dp degree of at most {len(states)} (e.g. the saved dp x cp layout), "
            "or drop 'cp_lightning' from the checkpoint to start the RNG afresh."
        )
    state = states[dp_rank]
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

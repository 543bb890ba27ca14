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
   covers its own shard, so DDP's plain mean over dp x cp is already exact and no hook is installed.
   FSDP2: :func:`cp_lightning.sharding.apply_fsdp` (``fully_shard`` per repeated block plus each
   parallelized root, over the flattened dp x cp mesh, or HSDP: shard over cp, replicate over dp), the
   gradient divided by dp (dp x cp in loss-parallel mode) with sum-only reductions on gloo;
5. checkpoint state: :func:`gather_rng_states` / :func:`restore_rng_state` keep each dp rank's RNG;
   :func:`cp_lightning.sharding.full_state_dict` consolidates a sharded model for export.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
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
    "prepare_ddp",
    "register_ddp_hook",
    "restore_rng_state",
    "seed_by_dp_rank",
    "sum_cp_mean_dp_hook",
    "sync_module_states",
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
    layout: str = "contiguous",
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
                layout=layout,
            )


# -- DDP: one copy of the weights, equal on every rank ---------------------------------------------
_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _checksum(tensor: torch.Tensor, chunk: int = 1 << 16) -> torch.Tensor:
    """An exact, bitwise checksum of ``tensor``: its bits summed as integers, chunk by chunk, weighted by the
    chunk's position, plus a strided sum (``sum(dtype=int64)`` copies its input in int64, so chunks keep
    that copy to 512 KB)."""
    flat = tensor.detach().reshape(-1)
    if flat.is_floating_point() or flat.is_complex():
        flat = flat.view(_INT_VIEWS[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for index, start in enumerate(range(0, flat.numel(), chunk)):
        part = flat[start : start + chunk]
        # (int64 sums wrap alike on every rank: order-independent, so equal tensors give equal checksums)
        total += part.sum(dtype=torch.int64) * (index + 1) + part[1::3].sum(dtype=torch.int64)
    return total


@torch.no_grad()
def sync_module_states(module: nn.Module) -> int:
    """What DDP does at construction (every parameter and buffer equal to rank 0's), without its copies.

    DDP's own sync broadcasts every tensor, frozen ones included, through 250 MB flat buckets: on the ranks
    that receive, the bucket plus the tensors it is copied into (a memory-mapped file's pages turn into
    private memory): ~1.4x the model in host memory at start-up. Here each tensor's checksum is compared
    across ranks (two small all-reduces) and only tensors that differ are broadcast from rank 0, one at a
    time, in place. Collective: every rank calls it; pass ``init_sync=False`` to DDP after it. Returns the
    number of tensors broadcast."""
    tensors = [*module.parameters(), *module.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    shape = [len(tensors), sum(t.numel() for t in tensors)]
    low, high = _min_max(torch.tensor(shape, dtype=torch.int64, device=device))
    if not torch.equal(low, high):  # (the same answer on every rank: all raise, none waits)
        raise ValueError(
            f"the ranks' models differ in structure (tensors and elements from {low.tolist()} to "
            f"{high.tolist()}); every rank must build the same model before DDP wraps it."
        )
    if not tensors:
        return 0
    low, high = _min_max(torch.stack([_checksum(t).to(device) for t in tensors]))
    differ = (low != high).nonzero().flatten().tolist()
    for i in differ:  # (a uint8 view of float8 data: gloo has no float8)
        data = tensors[i].data
        dist.broadcast(data.view(torch.uint8) if data.dtype in _FLOAT8 else data, src=0)
    hide_float8_from_ddp(module)
    return len(differ)


def _min_max(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    low, high = values.clone(), values.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return low, high


# -- DDP gradient math ------------------------------------------------------------------------------
def prepare_ddp(module: nn.Module) -> None:
    """Call before DDP wraps ``module``: its float8 tensors (an fp8 frozen base, :mod:`cp_lightning.fp8`) are
    broadcast from rank 0 here, as bytes, and hidden from DDP, whose construction-time broadcast of every
    parameter fails on gloo ("Invalid scalar type": gloo has no float8). Rank 0's weights still win on every rank,
    as DDP makes them. Collective when ``module`` has float8 tensors (every rank calls it); else a no-op."""
    fp8 = _float8_tensors(module)
    if not fp8:
        return
    if dist.get_world_size() > 1:  # a uint8 view writes the broadcast bytes into the float8 storage
        dist._broadcast_coalesced(dist.group.WORLD, [t.view(torch.uint8) for _, t in fp8], 2**26, 0)
    hide_float8_from_ddp(module)


_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _float8_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    named = [*module.named_parameters(), *module.named_buffers()]
    return [(name, t) for name, t in named if t.dtype in _FLOAT8]


def hide_float8_from_ddp(module: nn.Module) -> None:
    """Keep DDP's own start-up broadcast away from ``module``'s float8 tensors (no collective)."""
    names = {name for name, _ in _float8_tensors(module)}
    if names:
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ())) | names
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, sorted(ignored))


def sum_cp_mean_dp_hook(dp_size, bucket):
    """All-reduce a gradient bucket over dp x cp and divide by dp: SUM over cp, MEAN over dp.

    (No annotations: DDP checks them against dist.GradBucket, and this module's are strings.)
    """
    buffer = bucket.buffer()
    buffer.div_(dp_size)
    work = dist.all_reduce(buffer, group=dist.group.WORLD, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def register_ddp_hook(
    ddp: nn.parallel.DistributedDataParallel, dp_size: int, loss_parallel: bool, nonfinite=None
) -> None:
    """Give ``ddp`` (wrapping the whole dp x cp world) the exact gradient reduction. With an active
    :class:`cp_lightning.faults.NonFiniteCheck`, each bucket's local gradients are checked first."""
    check = nonfinite if nonfinite is not None and nonfinite.active else None
    if loss_parallel:
        if check is None:
            return  # plain DDP mean over dp x cp is exact when each rank's loss covers its own shard
        state, hook = None, default_hooks.allreduce_hook  # DDP's own mean, as a hook
    else:
        state, hook = dp_size, sum_cp_mean_dp_hook
    if check is not None:
        state, hook = (check, state, hook), _checked_hook
    ddp.register_comm_hook(state=state, hook=hook)


def _checked_hook(state, bucket):
    """Note whether this rank's own gradients are finite (before the all-reduce mixes ranks), then reduce."""
    check, inner_state, inner = state
    check.note_grads(bucket.buffer())
    return inner(inner_state, bucket)


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

"""Dynamic CP degree: each step runs at the CP degree its samples' length calls for, with exact gradients.

With one fixed cp, a short sample (an image of 1-4k tokens) split over cp ranks leaves each rank a sliver and
the step spends its time in collectives. With ``dynamic_cp=True`` the adapters build, at set-up, CP sub-groups
of every power-of-two degree c dividing cp (:func:`cp_lightning.mesh.cp_subgroups`: runs of c consecutive ranks
of a CP group), and each step runs at one degree for the whole world: the largest c whose tokens per rank,
``tokens / c``, stay at or above ``min_tokens_per_rank`` (:func:`choose_degree`; cp for samples long enough, 1
for the shortest). The cp / c sub-groups of a CP group then take different samples; the c ranks of a sub-group
share theirs.

The step's degree comes from the data: each rank describes its micro-batch with a :class:`DynamicStep` (tokens
per sample, samples, and W, the step's total) and :meth:`DynamicCP.begin` all-gathers those few numbers over the
world before any collective that depends on the degree, so every rank sees every rank's and they agree, or all
raise the same ValueError (never some ranks waiting in a group the others did not enter). Then the split and
gather hooks and the attention of every parallelized module are pointed at the degree's sub-group
(:func:`cp_lightning.parallelize.set_groups`; no collective).

Gradient rule (DESIGN.md section 8.4): the step's gradient is g = sum_i w_i grad(l_i) / W over all its samples
(every sub-group's, every accumulation micro-batch), w_i = 1 (``weighting="samples"``, the diffusion convention)
or the sample's tokens (``"tokens"``), W = sum_i w_i known before backward. Each rank back-propagates its
sub-group's sum_i w_i l_i / W (:meth:`DynamicCP.begin` returns the factor that turns its batch-mean loss into
that); each rank's gradient is its shard's part of it (the CP convention), so the SUM over the world is g: the
DDP hook divides by 1 and FSDP2's divide factor is 1 (sum-only on gloo). Nothing divides by a degree, so steps
at different degrees, and micro-batches at different degrees inside one step, add up exactly.

A sample's loss must not depend on the degree it ran at: noise, timesteps and caption dropout are drawn from a
generator keyed by the sample (:func:`sample_generator`), not from the per-dp-rank global RNG (which sub-groups
of one CP group share).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from cp_lightning.mesh import CP, CPGroups, cp_subgroups, sub_degrees
from cp_lightning.parallelize import parallel_state, set_groups

log = logging.getLogger("lightning.pytorch")

WEIGHTINGS = ("samples", "tokens")
DEFAULT_MIN_TOKENS_PER_RANK = 4096


@dataclass(frozen=True)
class DynamicStep:
    """What one rank's micro-batch is, for dynamic CP: equal on the ranks of a sub-group.

    Args:
        tokens: tokens per sample (the sequence the model splits: image or video tokens).
        samples: samples in the micro-batch (the loss returned is their mean).
        step_total: W, the optimizer step's total weight over the world: its sample count (``"samples"``
            weighting) or token count (``"tokens"``), all sub-groups and all accumulation micro-batches. None:
            computed from this micro-batch alone, which is W only without gradient accumulation.
    """

    tokens: int
    samples: int
    step_total: float | None = None

    def __post_init__(self) -> None:
        for name in ("tokens", "samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DynamicStep.{name} must be an int >= 1, got {value!r}.")
        if self.step_total is not None and not self.step_total > 0:
            raise ValueError(f"DynamicStep.step_total must be > 0 (or None), got {self.step_total!r}.")


def check_dynamic_options(
    cp: int,
    *,
    min_tokens_per_rank: int | None,
    weighting: str,
    loss_parallel: bool,
    compile: object = None,
    hsdp: bool = False,
) -> int:
    """Validate ``dynamic_cp=True``'s options (no collectives); returns ``min_tokens_per_rank`` or its default."""
    sub_degrees(cp)  # a power of two
    if loss_parallel:
        raise ValueError(
            "dynamic_cp does not support loss_parallel (a loss-parallel rank's loss is a mean over its own shard, "
            "which the per-sample weighting across degrees does not cover); drop loss_parallel."
        )
    if compile:
        raise ValueError(
            "dynamic_cp does not support compile (a compiled graph bakes in its CP group); pass compile=False, "
            "or train at a fixed cp."
        )
    if hsdp:
        raise ValueError("dynamic_cp is not supported with hsdp=True; shard over dp x cp (hsdp=False) or use DDP.")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"dynamic_weighting must be one of {WEIGHTINGS}, got {weighting!r}.")
    if min_tokens_per_rank is None:
        return DEFAULT_MIN_TOKENS_PER_RANK
    if isinstance(min_tokens_per_rank, bool) or not isinstance(min_tokens_per_rank, int) or min_tokens_per_rank < 1:
        raise ValueError(f"min_tokens_per_rank must be an int >= 1, got {min_tokens_per_rank!r}.")
    return min_tokens_per_rank


def choose_degree(tokens: int, cp: int, min_tokens_per_rank: int) -> int:
    """The largest power-of-two degree c <= cp with ``tokens / c >= min_tokens_per_rank`` (1 if none)."""
    degree = 1
    for c in sub_degrees(cp):
        if tokens >= c * min_tokens_per_rank:
            degree = c
    return degree


def ring_for_heads(heads: Sequence[int], cp: int, ring: int) -> int:
    """The ring degree the full cp runs at so that its Ulysses degree (cp / ring) has a head per rank.

    Sub-degrees never need more (their Ulysses degree is at most the full one's, :func:`mesh.sub_layout`), so a
    model with fewer heads than cp / ring falls back to ring attention for the degrees above its head count."""
    fewest = min(heads, default=cp)
    while cp // ring > fewest:
        ring *= 2
    return ring


def ring_for_targets(root: nn.Module, plan: Mapping | None, cp: int, ring: int) -> int:
    """:func:`ring_for_heads` over the attention modules of every module ``root`` parallelizes (no collectives);
    logs the fall-back when the ring degree grows."""
    from cp_lightning.data_parallel import plan_targets
    from cp_lightning.routing import attention_modules

    heads = [
        sub.heads
        for _, target, _ in plan_targets(root, plan)
        for _, sub in attention_modules(target)
        if isinstance(getattr(sub, "heads", None), int)
    ]
    chosen = ring_for_heads(heads, cp, ring)
    if chosen != ring and dist.is_initialized() and dist.get_rank() == 0:
        log.info(
            f"dynamic_cp: {min(heads)} attention heads cannot give each of cp / ring = {cp // ring} Ulysses ranks one; "
            f"degrees above {cp // chosen} run ring attention (ring={chosen} at cp={cp})."
        )
    return chosen


def sample_generator(sample_id: int, seed: int = 0, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator keyed by the sample: its noise, timestep and dropout draws do not depend on the degree, the
    rank or the batch it ran in."""
    return torch.Generator(device).manual_seed((int(seed) * 1_000_003 + int(sample_id)) % 2**63)


class DynamicCP:
    """The sub-groups, the current degree and the step's gradient weights of one dynamic-CP run.

    Build it after :func:`cp_lightning.parallelize` (every rank: the sub-groups are new process groups); the
    modules in ``roots`` (or their parallelized submodules) follow :meth:`begin`'s degree."""

    def __init__(
        self,
        mesh,
        roots: Sequence[nn.Module],
        *,
        ring: int = 1,
        min_tokens_per_rank: int = DEFAULT_MIN_TOKENS_PER_RANK,
        weighting: str = "samples",
        timeout: timedelta | None = None,
    ) -> None:
        self.cp = (mesh[CP] if mesh.ndim > 1 else mesh).size()
        self.ring, self.min_tokens_per_rank, self.weighting = ring, min_tokens_per_rank, weighting
        self.groups: dict[int, CPGroups] = cp_subgroups(mesh, ring)  # collective
        if timeout is not None:  # new groups get the backend's 30 min, whatever the world's (faults.py)
            for groups in self.groups.values():
                for group in (groups.cp, groups.ulysses, groups.ring):
                    if group is not None:
                        dist.distributed_c10d._set_pg_timeout(timeout, group)
        self.targets = [m for root in roots for m in root.modules() if parallel_state(m) is not None]
        if not self.targets:
            raise ValueError("dynamic_cp found no parallelized module to switch between degrees.")
        self.degree = self.cp
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.history: list[int] = []  # the degree of every micro-batch begun (benchmarks, tests)

    def degree_for(self, tokens: int) -> int:
        return choose_degree(tokens, self.cp, self.min_tokens_per_rank)

    def data_layout(self, degree: int) -> tuple[int, int]:
        """(replicas, rank) of the data at ``degree``: one data rank per sub-group, world / degree of them."""
        return self.world // degree, self.rank // degree

    def bind(self, degree: int) -> None:
        """Point every parallelized module at this rank's sub-group of ``degree`` (no collective)."""
        if degree not in self.groups:
            raise ValueError(f"degree {degree} is not one of the sub-group degrees {sorted(self.groups)}.")
        if degree != self.degree or not self.history:
            for module in self.targets:
                set_groups(module, self.groups[degree])
        self.degree = degree

    def begin(self, step: DynamicStep, *, accumulate: int = 1, training: bool = True) -> float:
        """Collective (world). Agree on this micro-batch's degree, switch to it, and return the factor that turns
        the micro-batch's mean loss into the sub-group's share of the step's loss, sum_i w_i l_i / W, times
        ``accumulate`` (what the caller divides the loss by afterwards, as Lightning does)."""
        if not isinstance(step, DynamicStep):
            raise TypeError(
                f"dynamic_cp needs a cp_lightning.dynamic.DynamicStep per batch, got {type(step).__name__}."
            )
        degree = self.degree_for(step.tokens)
        total = -1.0 if step.step_total is None else float(step.step_total)
        rows = _all_gather_rows([degree, step.tokens, step.samples, total])
        degrees = [int(r[0]) for r in rows]
        if len(set(degrees)) != 1:
            raise ValueError(
                f"the ranks chose different CP degrees for this micro-batch: {degrees} (one per rank, from tokens per "
                f"sample {[int(r[1]) for r in rows]} and min_tokens_per_rank={self.min_tokens_per_rank}). Every "
                "rank's micro-batch of a step must come from buckets of one degree (the recipes' bucket sampler "
                "schedules them so); check the sampler and the tokens each batch reports."
            )
        degree = degrees[0]
        for start in range(0, self.world, degree):
            peers = rows[start : start + degree]
            if any(r[1:3] != peers[0][1:3] for r in peers):
                raise ValueError(
                    f"ranks {start}..{start + degree - 1} share a degree-{degree} sub-group, so they must share the "
                    f"micro-batch, but report (tokens, samples) {[tuple(int(x) for x in r[1:3]) for r in peers]}."
                )
        totals = {r[3] for r in rows}
        if len(totals) != 1:
            raise ValueError(f"the ranks report different step totals W: {sorted(totals)}; W is the whole step's.")
        self.bind(degree)
        self.history.append(degree)
        if not training:
            return 1.0
        weight = [r[2] * (r[1] if self.weighting == "tokens" else 1) for r in rows]
        if total < 0:
            if accumulate != 1:
                raise ValueError(
                    f"with gradient accumulation ({accumulate} micro-batches) the step's total W must be known "
                    "before the first backward: give DynamicStep(step_total=...) (the bucket sampler knows it)."
                )
            total = sum(weight) / degree  # each sub-group's samples are counted once, not by each of its ranks
        return weight[self.rank] * accumulate / total


def _all_gather_rows(values: list[float]) -> list[list[float]]:
    """Every rank's ``values`` (a few numbers), on every rank: one small all-gather over the world."""
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    local = torch.tensor(values, dtype=torch.float64, device=device)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return [p.tolist() for p in parts]


def step_of(module, batch) -> DynamicStep:
    """The module's ``dynamic_cp_step(batch)`` (checked by :func:`check_module` at set-up)."""
    step = module.dynamic_cp_step(batch)
    if isinstance(step, Mapping):
        step = DynamicStep(**step)
    return step


def check_module(module) -> None:
    """Before any collective: the LightningModule (or task) tells each batch's tokens and samples."""
    if not callable(getattr(module, "dynamic_cp_step", None)):
        raise ValueError(
            f"dynamic_cp=True needs {type(module).__name__}.dynamic_cp_step(batch) -> cp_lightning.dynamic.DynamicStep "
            "(tokens per sample, samples in the batch, the step's total W), to pick each step's CP degree and "
            "weight its loss; define it, or drop dynamic_cp."
        )

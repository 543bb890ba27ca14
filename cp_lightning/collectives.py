"""Collectives of the CP engine, each a small autograd Function with a stated backward.

Gradient convention (DESIGN.md section 2): every rank of a CP group computes the *same* loss from
the gathered output, and after ``backward()`` each rank's parameter gradient is the contribution of
its own sequence shard, so that the SUM over the CP group is the single-device gradient. Each
backward below is written to keep that invariant.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

_COUNTERS: list[Counter] = []


@contextmanager
def count_bytes() -> Iterator[Counter]:
    """Count the bytes this rank sends, by kind ("all_to_all", "all_gather", "p2p:<tag>"), while active.

    Bytes that stay on the rank (its own chunk of an all-to-all) are not counted; an all-gather counts
    the ring algorithm's (P-1) sends of the local shard.
    """
    counter: Counter = Counter()
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


def record_sent(kind: str, nbytes: int) -> None:
    for counter in _COUNTERS:
        counter[kind] += nbytes


def shard(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's equal slice of ``x`` along ``dim`` (no communication).

    Backward is autograd's own for ``narrow``: the gradient lands in this rank's slice and zeros
    elsewhere. Tensors upstream of a split are computed identically on every CP rank, so each rank
    contributes exactly the gradient of its own shard and their sum is the full gradient.
    """
    world = dist.get_world_size(group)
    size = x.shape[dim]
    if size % world != 0:
        raise ValueError(
            f"cannot split dim {dim} of size {size} evenly over {world} CP ranks; use a sequence length "
            f"divisible by {world} (pad the input, or change the resolution / frame count)."
        )
    local = size // world
    return x.narrow(dim, dist.get_rank(group) * local, local)


class _GatherSeq(torch.autograd.Function):
    """Forward: all-gather equal shards along ``dim``. Backward: this rank's slice of the gradient.

    Why the slice (not a reduce-scatter) is right: downstream of the gather every CP rank holds the
    same full tensor and computes the same loss, so the incoming gradient is identical on all ranks.
    The full gradient of the shard this rank produced is therefore its slice of that gradient; summing
    the peers' gradients (a reduce-scatter) would count the loss ``cp`` times.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather_no_grad(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        local = grad.shape[ctx.dim] // world
        return grad.narrow(ctx.dim, dist.get_rank(ctx.group) * local, local).contiguous(), None, None


def gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather equal shards along ``dim``; the backward hands each rank its slice (see ``_GatherSeq``)."""
    return _GatherSeq.apply(x, dim, group)


def all_gather_no_grad(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather equal shards along ``dim`` outside autograd (attention masks, checksums)."""
    x = x.detach().contiguous()
    world = dist.get_world_size(group)
    record_sent("all_gather", x.numel() * x.element_size() * (world - 1))
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


class _AllToAll(torch.autograd.Function):
    """Forward: chunk ``i`` of dim 0 goes to rank ``i``; chunk ``i`` of the result came from rank ``i``.

    Backward: the same exchange applied to the gradient. With equal chunks the operator is a
    permutation of elements across ranks, and the adjoint of a permutation is its inverse: the
    gradient of the chunk that rank ``i`` sent us must go back to rank ``i`` as its chunk for us,
    which is again an all-to-all.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    world = dist.get_world_size(group)
    record_sent("all_to_all", x.numel() * x.element_size() * (world - 1) // world)
    dist.all_to_all_single(out, x, group=group)
    return out


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Exchange equal dim-0 chunks between the ranks of ``group`` (differentiable)."""
    return _AllToAll.apply(x, group)

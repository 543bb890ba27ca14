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
    the ring algorithm's (P-1) sends of the local shard. Under ``torch.compile`` only ring attention's
    bytes are counted (see :func:`record_sent`).
    """
    counter: Counter = Counter()
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


_PAUSED: list[bool] = []


@contextmanager
def uncounted() -> Iterator[None]:
    """Record nothing while active: code re-run around collectives that do not communicate (a selective
    recompute answers them from its cache, see cp_lightning.offload)."""
    _PAUSED.append(True)
    try:
        yield
    finally:
        _PAUSED.pop()


def record_sent(kind: str, nbytes: int) -> None:
    if torch.compiler.is_compiling():
        # Nothing of the counters enters a compiled graph (dynamo would guard on them and recompile
        # when counting starts or stops). The ring's bytes are still counted: they are recorded by its
        # custom ops, which run eagerly inside compiled code; collectives traced into the graph are not.
        return
    if _PAUSED:
        return
    for counter in _COUNTERS:
        counter[kind] += nbytes


def chunk_sizes(size: int, world: int) -> list[int]:
    """How a dim of ``size`` is split over ``world`` ranks: ``torch.tensor_split``'s sizes, the first
    ``size % world`` ranks holding one element more. Every rank computes the same list locally."""
    return [size // world + (rank < size % world) for rank in range(world)]


def shard(x: torch.Tensor, dim: int, group: dist.ProcessGroup, layout=None) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (no communication); sizes as in :func:`chunk_sizes`.

    ``layout``: a :class:`cp_lightning.mask_layout.Layout` whose length ``x`` has along ``dim`` (the
    ``head_tail`` layout of a model's sequence, ``parallelize.set_layout``): this rank's runs of it,
    concatenated, instead (backward alike: the gradient lands in those runs, zeros elsewhere).

    A dim that ``world`` does not divide is split unevenly (no padding): the extra elements go to the
    first ranks, and the attention and gathers downstream exchange the actual lengths. Backward is
    autograd's own for ``narrow``: the gradient lands in this rank's slice and zeros elsewhere. Tensors
    upstream of a split are computed identically on every CP rank, so each rank contributes exactly
    the gradient of its own shard and their sum is the full gradient.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    size = x.shape[dim]
    if layout is not None and layout.length == size:
        return layout.shard(x, dim, rank)
    if size < world:
        raise ValueError(
            f"cannot split dim {dim} of size {size} over {world} CP ranks: every rank needs at least one element. "
            f"Use a longer sequence (at least {world}) or a smaller cp."
        )
    sizes = chunk_sizes(size, world)
    return x.narrow(dim, sum(sizes[:rank]), sizes[rank])


def exchange_lengths(lengths: list[int], group: dist.ProcessGroup, device: torch.device) -> list[list[int]]:
    """All-gather a few integers per rank (e.g. local sequence lengths); returns one list per rank."""
    local = torch.tensor(lengths, dtype=torch.int64, device=device)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return [part.tolist() for part in parts]


class _GatherSeq(torch.autograd.Function):
    """Forward: all-gather the shards along ``dim``. Backward: by the rule of ``record`` (gradients.py).

    The free slice (``record.free``): this rank's slice of the incoming gradient. Right when, after
    the gathers, every CP rank computes the same loss from the same tensors with no trainable
    parameter in between and no re-split: the incoming gradient is then identical on all ranks and is
    the full gradient, so this rank's shard's gradient is its slice; summing the peers' (a
    reduce-scatter) would count the loss ``cp`` times. Otherwise (``record.free`` False, or no record
    at all) the general rule: each rank's incoming gradient is a partial one (the root outputs'
    gradients are scaled by 1/cp, parameters after the gather each get their share), and the full
    gradient of this rank's shard is its slice of their sum: a reduce-scatter, on a fresh buffer.
    Without a record (a gather called on its own) the caller promises the free slice's conditions.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: dist.ProcessGroup, lengths: list[int] | None, record):
        ctx.dim, ctx.group, ctx.record = dim, group, record
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.lengths = [x.shape[dim]] * world if lengths is None else lengths
        ctx.start = sum(ctx.lengths[:rank])
        ctx.length = x.shape[dim]
        if record is not None:
            record.note_gather(ctx)
        return all_gather_no_grad(x, dim, group, lengths)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.record is None or ctx.record.free:
            return grad.narrow(ctx.dim, ctx.start, ctx.length).contiguous(), None, None, None, None
        return reduce_scatter_seq(grad, ctx.dim, ctx.group, ctx.lengths), None, None, None, None


def gather(
    x: torch.Tensor,
    dim: int,
    group: dist.ProcessGroup,
    *,
    even: bool = True,
    record=None,
    lengths: list[int] | None = None,
    layout=None,
) -> torch.Tensor:
    """All-gather the shards along ``dim``; the backward follows ``record``'s rule (see ``_GatherSeq``).

    ``record``: the :class:`cp_lightning.gradients.ForwardRecord` of this forward pass, which says
    whether the backward may slice or must reduce-scatter; without one it slices (every rank then
    computes the same loss from the gathered tensor, with no parameters after it). Shards of different
    lengths: pass every rank's ``lengths`` when known (the split hooks know them), or ``even=False`` to
    exchange them first (one small all-gather and a host synchronisation).
    ``layout``: shards cut by this :class:`cp_lightning.mask_layout.Layout` (``shard``'s ``layout``) when the
    gathered length is its length: the ranks' parts, gathered in rank order, are put back in token order.
    That reordering is a permutation autograd differentiates as one (narrow and cat), so the gradient reaches
    ``_GatherSeq`` in rank order, where its slice or reduce-scatter hands each rank its own runs' gradient.
    """
    if lengths is None and not even:
        lengths = [row[0] for row in exchange_lengths([x.shape[dim]], group, x.device)]
    if lengths is not None and len(set(lengths)) == 1:
        lengths = None
    out = _GatherSeq.apply(x, dim, group, lengths, record)
    if layout is not None and layout.length == out.shape[dim]:
        out = layout.unshard(out.split(layout.lengths, dim), dim)  # rank order -> token order
    return out


def reduce_scatter_seq(grad: torch.Tensor, dim: int, group: dist.ProcessGroup, lengths: list[int]) -> torch.Tensor:
    """Sum ``grad`` over ``group`` and keep this rank's slice along ``dim`` (``lengths``: every rank's).

    Works on a fresh buffer, never on ``grad`` itself. Slices of different lengths are padded to the
    longest, since reduce-scatter needs equal chunks.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    longest = max(lengths)
    g = grad.movedim(dim, 0)  # the sequence first: chunk p of dim 0 is rank p's slice
    if len(set(lengths)) == 1:
        send = g.contiguous()
        # torch.compile cannot compare data pointers (and functionalizes the exchange anyway): copy
        if torch.compiler.is_compiling() or send.data_ptr() == grad.data_ptr():
            send = send.clone()
    else:
        parts = []
        for part in g.split(lengths):
            pad = longest - part.shape[0]
            parts.append(torch.cat([part, part.new_zeros(pad, *part.shape[1:])]) if pad else part)
        send = torch.cat(parts)
    out = send.new_empty(longest, *send.shape[1:])
    record_sent("reduce_scatter", out.numel() * out.element_size() * (world - 1))
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(out, send, group=group)
    return out[: lengths[rank]].movedim(0, dim).contiguous()


def all_gather_no_grad(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup, lengths: list[int] | None = None
) -> torch.Tensor:
    """All-gather shards along ``dim`` outside autograd (attention masks, checksums).

    ``lengths``: each rank's size along ``dim`` when they differ. Shards are then padded to the
    longest, gathered and trimmed, since not every backend gathers tensors of different shapes.
    """
    x = x.detach()
    world = dist.get_world_size(group)
    longest = x.shape[dim] if lengths is None else max(lengths)
    if longest > x.shape[dim]:
        pad = list(x.shape)
        pad[dim] = longest - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad)], dim=dim)
    x = x.contiguous()
    record_sent("all_gather", x.numel() * x.element_size() * (world - 1))
    # functional, as in _all_to_all: a result selective checkpointing can keep (dim 0 holds the ranks' x in order)
    out = torch.ops._c10d_functional.all_gather_into_tensor(x, world, group.group_name)
    parts = torch.ops._c10d_functional.wait_tensor(out).chunk(world)
    if lengths is not None:
        parts = [part.narrow(dim, 0, length) for part, length in zip(parts, lengths, strict=True)]
    return torch.cat(parts, dim=dim)


class _AllToAll(torch.autograd.Function):
    """Forward: chunk ``i`` of dim 0 goes to rank ``i``; chunk ``i`` of the result came from rank ``i``.

    Chunks are equal, or sized by ``send`` (what this rank sends to each rank) and ``recv`` (what it
    receives from each). Backward: the same exchange applied to the gradient with ``send`` and
    ``recv`` swapped. The operator moves each element to one place on one rank (a permutation of
    elements across ranks), and the adjoint of a permutation is its inverse: the gradient of the
    chunk that rank ``i`` sent us must go back to rank ``i``, which is again an all-to-all.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, send: list[int] | None, recv: list[int] | None):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return _all_to_all(x, group, send, recv)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group, ctx.recv, ctx.send), None, None, None


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, send: list[int] | None, recv: list[int] | None):
    x = x.contiguous()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if send is None:
        record_sent("all_to_all", x.numel() * x.element_size() * (world - 1) // world)
    else:
        row = x[0].numel() * x.element_size() if x.dim() > 1 else x.element_size()
        record_sent("all_to_all", (sum(send) - send[rank]) * row)
    # The functional op (what torch.compile traces dist.all_to_all_single into) returns its result rather than
    # filling `out` in place, so selective checkpointing can keep it and a recompute communicates nothing
    # (cp_lightning.offload); the in-place c10d op it replaces returns only a Work handle.
    split = [x.shape[0] // world] * world if send is None else send
    out = torch.ops._c10d_functional.all_to_all_single(x, recv or split, split, group.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def all_to_all(
    x: torch.Tensor, group: dist.ProcessGroup, send: list[int] | None = None, recv: list[int] | None = None
) -> torch.Tensor:
    """Exchange dim-0 chunks between the ranks of ``group`` (differentiable).

    Chunks are equal unless ``send`` / ``recv`` give, per rank, the rows sent to / received from it.
    """
    return _AllToAll.apply(x, group, send, recv)


class _AllReduceSum(torch.autograd.Function):
    """Forward: the SUM of ``x`` over ``group``, on every rank. Backward: the SUM of the gradients over ``group``.

    Why the backward is an all-reduce too: forward computes ``y = sum_p x_p`` and hands the same ``y`` to
    every rank, which uses it with its own shard (linear attention: its own queries). Rank p's incoming
    gradient ``g_p`` is therefore only the part of dL/dy that flows through rank p's use of ``y``, and the
    full dL/dy is ``sum_p g_p``. Since ``dy/dx_p`` is the identity for every p, the gradient of each rank's
    own ``x_p`` is that full dL/dy: the all-reduce of the incoming gradients. (Returning ``g_p`` alone would
    drop the other ranks' queries' dependence on this rank's keys.) This keeps the CP convention: the
    gradient of everything upstream of ``x_p`` on rank p is its own shard's contribution.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup):
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.group), None


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    world = dist.get_world_size(group)
    # what a ring all-reduce sends: a reduce-scatter and an all-gather, each (P-1)/P of the tensor
    record_sent("all_reduce", 2 * x.numel() * x.element_size() * (world - 1) // world)
    # functional, as in _all_to_all: a result selective checkpointing can keep, a fresh tensor (x is untouched)
    out = torch.ops._c10d_functional.all_reduce(x, "sum", group.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The SUM of ``x`` over the ranks of ``group`` (differentiable; see ``_AllReduceSum`` for the backward)."""
    return _AllReduceSum.apply(x, group)

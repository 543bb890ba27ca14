"""Context-parallel attention and its routing into diffusers' attention processors.

diffusers' CP-aware processors pass ``parallel_config=self._parallel_config`` to
``dispatch_attention_fn`` for attention over split tokens, and ``None`` where the keys are not split
(Wan's text and image cross-attention). cp_lightning sets a :class:`ContextParallelAttention` as that
``_parallel_config`` on each processor of a parallelized model, and wraps the dispatcher that the
processor's module calls so that such a config routes to our attention. Everything else passes
through untouched, so unparallelized models in the same process keep diffusers' behaviour. We do
not call diffusers' ``enable_parallelism``: it fails on CPU-only hosts (DESIGN.md section 6).
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cp_lightning import collectives
from cp_lightning.kernels import pick_kernel
from cp_lightning.mesh import CPGroups
from cp_lightning.plan import SplitState
from cp_lightning.ring import ring_attention


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, lengths: list[int], heads: list[int]) -> torch.Tensor:
    """Ulysses scatter: sequence-sharded, all heads -> full sequence, this rank's heads.

    ``lengths[p]``: rank p's number of tokens; ``heads[p]``: the number of heads rank p attends over
    (``chunk_sizes(H, P)``). Rank p's tokens come back as block p of the full sequence.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    b, s_local, h, d = x.shape
    if len(set(heads)) == 1:
        # B, S_local, H, D -> P, S_local, B, H/P, D: chunk p holds head group p, sent to rank p
        send = x.reshape(b, s_local, world, h // world, d).permute(2, 1, 0, 3, 4).reshape(-1)
    else:  # head groups of different sizes: the same layout, built group by group
        send = torch.cat([part.permute(1, 0, 2, 3).reshape(-1) for part in x.split(heads, dim=2)])
    row = b * d
    out = collectives.all_to_all(
        send, group, send=[s_local * n * row for n in heads], recv=[length * heads[rank] * row for length in lengths]
    )
    # blocks [S_p, B, H_rank, D] in rank order are one contiguous [S, B, H_rank, D]
    return out.view(sum(lengths), b, heads[rank], d).permute(1, 0, 2, 3)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, lengths: list[int], heads: list[int]) -> torch.Tensor:
    """Ulysses gather: full sequence, this rank's heads -> sequence-sharded, all heads (the inverse)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    b, s, h_local, d = x.shape
    s_local, row = lengths[rank], b * d
    # B, S, H_rank, D -> S, B, H_rank, D: dim-0 block p holds rank p's tokens
    send = x.permute(1, 0, 2, 3).reshape(-1)
    out = collectives.all_to_all(
        send, group, send=[length * h_local * row for length in lengths], recv=[s_local * n * row for n in heads]
    )
    if len(set(heads)) == 1:
        # P(head group), S_local, B, H/P, D -> B, S_local, P, H/P, D -> B, S_local, H, D
        out = out.view(world, s_local, b, heads[0], d).permute(2, 1, 0, 3, 4)
        return out.reshape(b, s_local, world * heads[0], d)
    chunks = out.split([s_local * n * row for n in heads])
    parts = [chunk.view(s_local, b, n, d) for chunk, n in zip(chunks, heads, strict=True)]
    return torch.cat(parts, dim=2).permute(1, 0, 2, 3)


def _check_mask(mask: torch.Tensor, heads: int) -> None:
    """Only key-padding masks, broadcastable to (B, H, 1, S_k_local), can follow their keys.

    A mask with one row per query cannot be supported: a rank only sees its own block of such a
    matrix, not the rows and columns the other ranks hold.
    """
    if mask.requires_grad:
        raise ValueError(
            "attention masks that require grad (learned biases) are not supported under context parallelism."
        )
    if mask.dim() > 4 or (mask.dim() >= 2 and mask.shape[-2] != 1):
        raise ValueError(
            f"attention mask of shape {tuple(mask.shape)} has one row per query; under context parallelism only "
            "key-padding masks (size 1 in the query dim, e.g. (B, 1, 1, S_k)) are supported."
        )
    if mask.dim() >= 3 and mask.shape[-3] not in (1, heads):
        raise ValueError(
            f"attention mask of shape {tuple(mask.shape)}: its head dim must be 1 or the head count {heads}."
        )


def _gather_mask(mask: torch.Tensor, group: dist.ProcessGroup, lengths: list[int], heads: list[int]) -> torch.Tensor:
    """(B, H or 1, 1, S_k_local) key-padding mask -> (B, H_rank or 1, 1, S_k) for Ulysses.

    Keys (last dim) are sharded like the keys themselves, so an all-gather in rank order matches the
    key order after the all-to-all. A per-head mask keeps this rank's heads.
    """
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    mask = collectives.all_gather_no_grad(mask, -1, group, None if len(set(lengths)) == 1 else lengths)
    if mask.shape[1] == sum(heads) > 1:
        rank = dist.get_rank(group)
        mask = mask[:, sum(heads[:rank]) : sum(heads[: rank + 1])]
    return mask


def _to_bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A key mask as the additive bias LSE kernels take: (B|1, H|1, 1, S_k), 0 or -inf for booleans."""
    if mask is None:
        return None
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def _check_heads(query: torch.Tensor, key: torch.Tensor, ulysses: int) -> None:
    heads = query.shape[2]
    if key.shape[2] != heads:
        raise ValueError(
            f"queries have {heads} heads but keys {key.shape[2]}; context-parallel attention needs equal head "
            "counts (repeat the key/value heads for grouped-query attention)."
        )
    if heads < ulysses:
        raise ValueError(
            f"Ulysses gives each of its {ulysses} ranks at least one of the {heads} attention heads; use a Ulysses "
            f"degree (cp / ring) of at most {heads}, e.g. a larger ring degree."
        )


def _local_lengths(query, key, group: dist.ProcessGroup, even: bool) -> tuple[list[int], list[int]]:
    """Every rank's query and key lengths: equal when ``even``, else exchanged (one small all-gather)."""
    world = dist.get_world_size(group)
    if even:
        return [query.shape[1]] * world, [key.shape[1]] * world
    rows = collectives.exchange_lengths([query.shape[1], key.shape[1]], group, query.device)
    return [row[0] for row in rows], [row[1] for row in rows]


def cp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    groups: CPGroups,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    kernel: str | None = None,
    even: bool = False,
) -> torch.Tensor:
    """Exact attention over sequence-sharded ``(B, S_local, H, D)`` inputs across the CP group.

    Ulysses (all-to-all) over the inner ``ulysses`` axis, then, when ``ring > 1``, ring attention
    over the outer ``ring`` axis (USP). Each rank holds its own shard of queries and of keys/values;
    shards may differ in length between ranks (a sequence the CP degree does not divide) and queries
    from keys (cross-attention to split text). It gets back its own ``(B, S_local, H, D)`` output.
    ``even=True`` promises that every rank's shards have the same lengths, which skips exchanging
    them. Heads are dealt out as evenly as possible (:func:`collectives.chunk_sizes`): a head count the
    Ulysses degree does not divide leaves some ranks one head more, with no padding.
    Everything that can be refused is checked before communicating.
    """
    heads, ulysses = query.shape[2], groups.ulysses_size
    _check_heads(query, key, ulysses)
    if attn_mask is not None:
        _check_mask(attn_mask, heads)
    ring_kernel = None
    if groups.ring_size > 1:
        ring_kernel = pick_kernel(query.device, query.dtype, attn_mask is not None, kernel, head_dim=query.shape[-1])

    if ulysses > 1:
        q_lengths, k_lengths = _local_lengths(query, key, groups.ulysses, even)
        head_split = collectives.chunk_sizes(heads, ulysses)
        query = _seq_to_heads(query, groups.ulysses, q_lengths, head_split)
        key, value = (_seq_to_heads(t, groups.ulysses, k_lengths, head_split) for t in (key, value))
        if attn_mask is not None:
            attn_mask = _gather_mask(attn_mask, groups.ulysses, k_lengths, head_split)
    # B, S, H/u, D -> B, H/u, S, D for the kernels and back
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if ring_kernel is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    else:
        _, block_lengths = _local_lengths(query, key, groups.ring, even)
        bias = _to_bias(attn_mask, q.dtype)
        out = ring_attention(
            q, k, v, group=groups.ring, kernel=ring_kernel, bias=bias, scale=scale, block_lengths=block_lengths
        )
    out = out.transpose(1, 2)
    return _heads_to_seq(out, groups.ulysses, q_lengths, head_split) if ulysses > 1 else out


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Ulysses attention over every rank of ``group`` (see :func:`cp_attention`)."""
    size = dist.get_world_size(group)
    groups = CPGroups(cp=group, ulysses=group, ring=None, cp_size=size, ring_size=1)
    return cp_attention(query, key, value, groups=groups, attn_mask=attn_mask, scale=scale)


class ContextParallelAttention:
    """The ``_parallel_config`` cp_lightning puts on a processor: attention over the CP group."""

    def __init__(self, groups: CPGroups, kernel: str | None = None, state: SplitState | None = None) -> None:
        self.groups = groups
        self.kernel = kernel
        # the model's split hooks record in it whether every split was even; until one is not,
        # attention skips exchanging its ranks' lengths
        self.state = SplitState() if state is None else state

    def __call__(
        self, query, key, value, *, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ) -> torch.Tensor:
        if dropout_p or is_causal or enable_gqa:
            raise ValueError(
                "context-parallel attention supports neither attention dropout, causal masking nor GQA "
                f"(got dropout_p={dropout_p}, is_causal={is_causal}, enable_gqa={enable_gqa})."
            )
        return cp_attention(
            query,
            key,
            value,
            groups=self.groups,
            attn_mask=attn_mask,
            scale=scale,
            kernel=self.kernel,
            even=self.state.even,
        )

    def __repr__(self) -> str:
        return f"ContextParallelAttention(cp={self.groups.cp_size}, ring={self.groups.ring_size})"


def _routed(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def dispatch_attention_fn(*args, **kwargs):
        config = kwargs.get("parallel_config")
        if not isinstance(config, ContextParallelAttention):
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        return config(
            a["query"],
            a["key"],
            a["value"],
            attn_mask=a["attn_mask"],
            dropout_p=a["dropout_p"],
            is_causal=a["is_causal"],
            scale=a["scale"],
            enable_gqa=a["enable_gqa"],
        )

    dispatch_attention_fn.__cp_lightning_original__ = original
    return dispatch_attention_fn


def attention_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The diffusers attention modules (those with a ``processor``) inside ``module``."""
    return [(name, sub) for name, sub in module.named_modules() if hasattr(sub, "processor")]


def check_processors(module: nn.Module, ulysses_degree: int) -> list[tuple[str, nn.Module]]:
    """Validate every attention module before any communication; returns them."""
    found = attention_modules(module)
    if not found:
        raise ValueError(f"{type(module).__name__} has no diffusers attention module (none with a `processor`).")
    for name, sub in found:
        processor = sub.processor
        if not hasattr(processor, "_parallel_config"):
            raise ValueError(
                f"attention processor {type(processor).__name__} at {name!r} does not support context parallelism "
                "(it has no `_parallel_config`); give the module the model's own *AttnProcessor before "
                "parallelize()."
            )
        module_globals = sys.modules[type(processor).__module__].__dict__
        if "dispatch_attention_fn" not in module_globals:
            raise ValueError(
                f"attention processor {type(processor).__name__} at {name!r} does not call diffusers' "
                "dispatch_attention_fn, so its attention cannot be routed to the CP group."
            )
        heads = getattr(sub, "heads", None)
        if isinstance(heads, int) and heads < ulysses_degree:
            raise ValueError(
                f"{name!r} has {heads} attention heads, fewer than the Ulysses degree {ulysses_degree} (each "
                f"Ulysses rank attends over at least one head); use cp / ring <= {heads}, e.g. a larger ring degree."
            )
    return found


def route_processors(found: list[tuple[str, nn.Module]], config: ContextParallelAttention) -> None:
    for _, sub in found:
        processor = sub.processor
        module_globals = sys.modules[type(processor).__module__].__dict__
        dispatch = module_globals["dispatch_attention_fn"]
        if not hasattr(dispatch, "__cp_lightning_original__"):
            module_globals["dispatch_attention_fn"] = _routed(dispatch)
        processor._parallel_config = config


def unroute_processors(found: list[tuple[str, nn.Module]]) -> None:
    for _, sub in found:
        # Drop the instance attribute so the class default (None: no CP) shows through again.
        sub.processor.__dict__.pop("_parallel_config", None)

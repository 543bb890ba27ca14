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
from cp_lightning.ring import ring_attention


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Ulysses scatter: sequence-sharded, all heads -> full sequence, this rank's heads."""
    world = dist.get_world_size(group)
    b, s_local, h, d = x.shape
    # B, S_local, H, D -> P, S_local, B, H/P, D: chunk p holds head group p, sent to rank p
    x = x.reshape(b, s_local, world, h // world, d).permute(2, 1, 0, 3, 4)
    x = collectives.all_to_all(x, group)
    # P(source rank), S_local, B, H/P, D -> S, B, H/P, D -> B, S, H/P, D (rank p's tokens are block p)
    return x.reshape(world * s_local, b, h // world, d).permute(1, 0, 2, 3)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Ulysses gather: full sequence, this rank's heads -> sequence-sharded, all heads."""
    world = dist.get_world_size(group)
    b, s, h_local, d = x.shape
    # B, S, H/P, D -> S, B, H/P, D -> P, S_local, B, H/P, D: chunk p holds rank p's tokens
    x = x.permute(1, 0, 2, 3).reshape(world, s // world, b, h_local, d)
    x = collectives.all_to_all(x, group)
    # P(head group), S_local, B, H/P, D -> B, S_local, P, H/P, D -> B, S_local, H, D
    return x.permute(2, 1, 0, 3, 4).reshape(b, s // world, world * h_local, d)


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


def _gather_mask(mask: torch.Tensor, group: dist.ProcessGroup, heads: int) -> torch.Tensor:
    """(B, H or 1, 1, S_k_local) key-padding mask -> (B, H/P or 1, 1, S_k) for Ulysses.

    Keys (last dim) are sharded like the keys themselves, so an all-gather in rank order matches the
    key order after the all-to-all. A per-head mask keeps this rank's heads.
    """
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    mask = collectives.all_gather_no_grad(mask, -1, group)
    if mask.shape[1] == heads > 1:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        mask = mask[:, rank * (heads // world) : (rank + 1) * (heads // world)]
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
    if heads % ulysses != 0 or key.shape[2] != heads:
        raise ValueError(
            f"Ulysses needs the head count ({heads}, keys {key.shape[2]}) to be divisible by the Ulysses degree "
            f"{ulysses}; choose cp (or cp/ring) dividing {heads}, or a larger ring degree."
        )


def cp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    groups: CPGroups,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """Exact attention over sequence-sharded ``(B, S_local, H, D)`` inputs across the CP group.

    Ulysses (all-to-all) over the inner ``ulysses`` axis, then, when ``ring > 1``, ring attention
    over the outer ``ring`` axis (USP). Each rank holds its own shard of queries and of keys/values
    (their lengths may differ, as in cross-attention to split text); it gets back its own
    ``(B, S_local, H, D)`` output. Everything that can be refused is checked before communicating.
    """
    heads, ulysses = query.shape[2], groups.ulysses_size
    _check_heads(query, key, ulysses)
    if attn_mask is not None:
        _check_mask(attn_mask, heads)
    ring_kernel = None
    if groups.ring_size > 1:
        ring_kernel = pick_kernel(query.device, query.dtype, attn_mask is not None, kernel)

    if ulysses > 1:
        query, key, value = (_seq_to_heads(t, groups.ulysses) for t in (query, key, value))
        if attn_mask is not None:
            attn_mask = _gather_mask(attn_mask, groups.ulysses, heads)
    # B, S, H/u, D -> B, H/u, S, D for the kernels and back
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if ring_kernel is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    else:
        out = ring_attention(
            q, k, v, group=groups.ring, kernel=ring_kernel, bias=_to_bias(attn_mask, q.dtype), scale=scale
        )
    out = out.transpose(1, 2)
    return _heads_to_seq(out, groups.ulysses) if ulysses > 1 else out


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

    def __init__(self, groups: CPGroups, kernel: str | None = None) -> None:
        self.groups = groups
        self.kernel = kernel

    def __call__(
        self, query, key, value, *, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ) -> torch.Tensor:
        if dropout_p or is_causal or enable_gqa:
            raise ValueError(
                "context-parallel attention supports neither attention dropout, causal masking nor GQA "
                f"(got dropout_p={dropout_p}, is_causal={is_causal}, enable_gqa={enable_gqa})."
            )
        return cp_attention(query, key, value, groups=self.groups, attn_mask=attn_mask, scale=scale, kernel=self.kernel)

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
        if isinstance(heads, int) and heads % ulysses_degree != 0:
            raise ValueError(
                f"{name!r} has {heads} attention heads, not divisible by the Ulysses degree {ulysses_degree}; "
                f"choose cp (or cp/ring) dividing {heads}."
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

"""cp_attention's mask-spec path: the layout check before any communication, then the spec's rectangles.

Ulysses: after the all-to-all a rank holds every token of its heads (in layout order: each rank's runs in
rank order), and runs the spec's pieces between them (cp_lightning.masked): the work is the mask's area on
every rank, whatever the layout. Ring and USP: step s runs the pieces between this ring position's tokens and
those of the block that arrives (position r - s), and a step with none computes nothing; under a causal mask
the ``head_tail`` layout keeps the ranks' areas within a few percent of each other (cp_lightning.mask_layout).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist

from cp_lightning.kernels import grouped, pick_kernel
from cp_lightning.mask_layout import Layout, pieces, ring_idling, ring_positions
from cp_lightning.masked import encode, has_tiles, spec_attention
from cp_lightning.masks import MaskSpec
from cp_lightning.ring import ring_attention

# a ring whose lockstep time exceeds the balanced time by this much is warned about (teacher forcing: 1.6-1.8x)
IDLING_WARNING = 1.25


def resolve_layout(spec: MaskSpec, layout: Layout | None, query, cp_size: int, cp_rank: int, total) -> Layout:
    """The layout the inputs are sharded by (default: contiguous, as the split hooks cut; a model parallelized with
    ``layout="head_tail"`` passes its forward's layout, ``parallelize.set_layout``), checked against the spec and
    the sequence before any communication. ``total``: the sequence length when known without communicating (even
    shards or given lengths), else None."""
    layout = Layout.contiguous(spec.length, cp_size) if layout is None else layout
    if layout.ranks != cp_size:
        raise ValueError(f"the layout has {layout.ranks} ranks but the CP group {cp_size}.")
    if layout.length != spec.length:
        raise ValueError(f"the mask spec covers {spec.length} tokens but the layout {layout.length}.")
    if total is not None and total != spec.length:
        raise ValueError(
            f"the mask spec covers {spec.length} tokens but the sequence has {total} (over {cp_size} CP ranks)."
        )
    if query.shape[1] != layout.lengths[cp_rank]:
        raise ValueError(
            f"CP rank {cp_rank} holds {query.shape[1]} tokens but the {layout.name} layout of the mask spec's "
            f"{spec.length} tokens gives it {layout.lengths[cp_rank]}: the spec's token count differs from the "
            "sequence, or the inputs were not sharded by this layout."
        )
    return layout


def attend(
    q, k, v, spec: MaskSpec, layout: Layout, groups, *, kernel: str | None, scale, kv_heads: list[int] | None = None
) -> torch.Tensor:
    """(B, H, S, D) q, k, v after Ulysses' all-to-all (this Ulysses group's tokens, in layout order) -> output.

    Without a ring: the spec's pieces over the group's tokens. With one: ring attention whose step s runs the
    pieces between this ring position's tokens and those of position r - s. ``kv_heads``: GQA, query head j
    reading K/V head ``kv_heads[j]`` (``kernels.grouped``).
    """
    ulysses, ring = groups.ulysses_size, groups.ring_size
    held = ring_positions(layout, ring)
    position = dist.get_rank(groups.cp) // ulysses
    steps = [pieces(spec, held[position], held[(position - s) % ring]) for s in range(ring)]
    picked = pick_kernel(q.device, q.dtype, has_tiles(steps), kernel, head_dim=q.shape[-1])
    if ring == 1:
        return spec_attention(q, k, v, steps[0], kernel=grouped(picked, kv_heads), scale=scale)
    warn_if_idle(spec, layout, ring)
    block_lengths = [sum(hi - lo for lo, hi in runs) for runs in held]
    return ring_attention(
        q, k, v, group=groups.ring, kernel=picked, scale=scale, block_lengths=block_lengths, plan=encode(steps),
        kv_heads=kv_heads,
    )  # fmt: skip


# ring areas are pure arithmetic over the spec's slices: once per spec, layout and ring, not per layer
_idling = functools.lru_cache(maxsize=256)(ring_idling)


def warn_if_idle(spec: MaskSpec, layout: Layout, ring: int) -> None:
    """Warn when the ring's lockstep steps take more than IDLING_WARNING x the balanced time (Python's warning
    registry shows each message once per call site)."""
    idling = _idling(spec, layout, ring)
    if idling > IDLING_WARNING:
        warnings.warn(
            f"ring attention under this mask ({spec.length} tokens, {layout.name} layout, ring {ring}) idles: its "
            f"steps take {idling:.2f}x the balanced time, since each step waits for the busiest rank. Ulysses "
            "(ring=1) runs any mask balanced; prefer it, or USP with a smaller ring degree (and the head_tail layout "
            "over a contiguous one: Layout.head_tail, or parallelize(..., layout='head_tail') for a whole model).",
            stacklevel=4,
        )

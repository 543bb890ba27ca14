"""Ideogram 4: one packed sequence of text and image tokens per row, per token throughout, with a segment mask.

Every per-token input (latents, text features, (t, h, w) position ids, role indicators, and a per-token timestep
when given) is split at the root; ``forward`` embeds them, builds the MRoPE tables from the local ids, and every
layer outside attention is per token, so the output is gathered after ``final_layer``.

The attention mask is ``segment_ids[:, :, None] == segment_ids[:, None, :]``: block-diagonal, one row per query. The
pipeline lays a row out as [left padding (segment -1)][text][image], so with prompts of different lengths a row
holds two segments, and padding queries see only padding keys. No key mask expresses that, and a rank could not
even tell which segment its keys belong to from its own block of the mask. So ``segment_ids`` is not split: the
model builds the whole (B, 1, S, S) mask on every rank, and :class:`SegmentAttention` stands in for the stock
processor inside the split region (routing.py's ``STAND_INS``). It checks that the mask is a segment mask, then runs
one CP attention per segment ordinal with the keys of that segment (this rank's share, cut by
``routing.local_shard``) and keeps each query's row from its own segment's pass. A row of one segment (equal prompt
lengths, or no padding) costs one attention, as in one process; with padding, two.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning import routing
from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.tiny import _factor


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def segments(mask: torch.Tensor) -> torch.Tensor:
    """A (B, 1, S, S) boolean same-segment mask -> (B, S): each token's segment, numbered 0, 1, ... by first token.

    Raises ValueError (the same on every rank: the mask is whole) when the mask is not a segment mask.
    """
    same = mask[:, 0]
    first = same.to(torch.uint8).argmax(dim=-1)  # B, S: the first token of a query's segment names the segment
    if mask.dtype != torch.bool or not torch.equal(same, first[:, :, None] == first[:, None, :]):
        raise ValueError(
            "Ideogram 4's attention mask is not a segment mask (segment_ids[:, :, None] == segment_ids[:, None, :]): "
            "context parallelism splits it only as one key mask per segment."
        )
    positions = torch.arange(same.shape[-1], device=mask.device)
    ordinal = (first == positions).long().cumsum(dim=-1) - 1  # B, S: segments started up to each token, minus one
    return ordinal.gather(1, first)


class SegmentAttention(routing.StandIn):
    """``Ideogram4AttnProcessor``'s stand-in: its projections, then one key-masked CP attention per segment."""

    def __call__(self, attn, hidden_states, attention_mask, image_rotary_emb):
        if not self.runs_cp():
            return self.original(attn, hidden_states, attention_mask, image_rotary_emb)
        heads = (attn.num_heads, attn.head_dim)
        q, k, v = (proj(hidden_states).unflatten(-1, heads) for proj in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)  # B, S_local, H, D
        cos, sin = (t.unsqueeze(2) for t in image_rotary_emb)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        segment = segments(attention_mask)  # B, S, whole: the same on every rank
        count = int(segment.max()) + 1
        if count == 1:
            out = self.attend(q, k, v)  # one segment per row: every key is visible
        else:
            rows = routing.local_shard(segment, 1)  # B, S_local: this rank's queries' segments
            out = torch.zeros_like(q)
            for index in range(count):
                keys = segment == index
                keys = keys | ~keys.any(dim=-1, keepdim=True)  # a row with fewer segments: its pass is dropped below
                part = self.attend(q, k, v, routing.local_shard(keys, 1)[:, None, None, :])
                out = out + part * (rows == index)[:, :, None, None].to(part.dtype)
        return attn.to_out[0](out.flatten(2, 3))

    def __repr__(self) -> str:
        return f"SegmentAttention({type(self.original).__name__})"


routing.STAND_INS["Ideogram4AttnProcessor"] = SegmentAttention

_TOKENS = In(split_dim=1, expected_dims=3)
IDEOGRAM4 = PlanEntry(
    "Ideogram4Transformer2DModel",
    {
        "": {
            "hidden_states": _TOKENS,
            "encoder_hidden_states": _TOKENS,
            "position_ids": _TOKENS,  # (B, S, 3)
            "indicator": In(split_dim=1, expected_dims=2),
            "timestep": In(split_dim=1, expected_dims=2),  # per token when (B, S); a (B,) one passes whole
            # segment_ids stays whole: forward builds the whole segment mask from it for SegmentAttention
        },
        "final_layer": Out(gather_dim=1, expected_dims=3),
    },
    needs="a stand-in processor (one key-masked attention per segment of the mask)",
)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    text = text_tokens if (tokens + text_tokens) % 2 else text_tokens - 1  # an odd row: no CP degree divides it
    h = _factor(tokens)
    image = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(tokens // h), indexing="ij"), dim=-1)
    image = torch.cat([torch.zeros(tokens, 1, dtype=torch.long), image.reshape(-1, 2)], dim=-1) + 65536
    position_ids = torch.zeros(batch, text + tokens, 3, dtype=torch.long)
    segment_ids = torch.full((batch, text + tokens), -1, dtype=torch.long)
    indicator = torch.zeros(batch, text + tokens, dtype=torch.long)
    for b in range(batch):  # the pipeline's [left padding][text][image] rows; shorter prompts after the first
        length = text - 2 * b
        position_ids[b, text - length : text] = torch.arange(length)[:, None]
        position_ids[b, text:] = image
        indicator[b, text - length : text] = 3
        indicator[b, text:] = 2
        segment_ids[b, text - length :] = 1
    return {
        "hidden_states": torch.randn(batch, text + tokens, cfg.in_channels, generator=g, dtype=dtype),
        "timestep": torch.rand(batch, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text + tokens, cfg.llm_features_dim, generator=g, dtype=dtype),
        "position_ids": position_ids,
        "segment_ids": segment_ids,
        "indicator": indicator,
    }


register(
    IDEOGRAM4,
    TinyCase(
        "ideogram4",
        "Ideogram4Transformer2DModel",
        dict(
            in_channels=8,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            intermediate_size=64,
            adaln_dim=16,
            llm_features_dim=16,
            rope_theta=10000,
            mrope_section=(2, 1, 1),
        ),
        _inputs,
        note="packed [padding, text, image] rows: a two-segment mask (stand-in processor)",
    ),
)

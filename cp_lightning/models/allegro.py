"""Allegro: a PixArt-style video DiT (self-attention, cross-attention to the text), SDPA-direct.

Every block is per token but its self-attention, and ``AllegroAttnProcessor2_0`` calls SDPA itself (routed by
cp_lightning; its cross-attention to the whole text runs locally on each rank's queries). The video tokens
are split at the first block, after the patch embedding, and gathered after ``proj_out`` (``norm_out`` and the
modulation are per token with per-sample parameters). Two inputs follow the tokens into every block:

* the RoPE, ``((cos, sin) per axis, (t, h, w) positions)``: the frequency tables are indexed by position, so
  they stay whole; only the (1, S) position rows are split with their tokens;
* the optional video padding mask, which ``forward`` turns into a (B, 1, S) additive key mask: split along S,
  each rank masks the keys it holds (CP attention gathers them with the keys).
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out
from diffusers.models.embeddings import get_3d_rotary_pos_embed_allegro

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.wan import _video

ALLEGRO = PlanEntry(
    "AllegroTransformer3DModel",
    {
        "transformer_blocks.0": {"hidden_states": In(split_dim=1, expected_dims=3)},
        "transformer_blocks.*": {
            "image_rotary_emb": [None, In(split_dim=1, expected_dims=2)],  # tables whole, (1, S) positions split
            "attention_mask": In(split_dim=2, expected_dims=3),  # (B, 1, S) additive key mask, with the keys
        },
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
    needs="an SDPA-direct processor routed by cp_lightning",
)


def _rope(model, frames: int, h: int, w: int):
    """The Allegro pipeline's RoPE: per-axis (cos, sin) tables and the (1, S) t/h/w positions of every token."""
    cfg = model.config
    freqs_t, freqs_h, freqs_w, grid_t, grid_h, grid_w = get_3d_rotary_pos_embed_allegro(
        embed_dim=cfg.attention_head_dim,
        crops_coords=((0, 0), (h, w)),
        grid_size=(h, w),
        temporal_size=frames,
        interpolation_scale=(cfg.interpolation_scale_t, cfg.interpolation_scale_h, cfg.interpolation_scale_w),
    )
    pos = torch.cartesian_prod(grid_t.long(), grid_h.long(), grid_w.long())
    pos = pos.reshape(-1, 3).transpose(0, 1).reshape(3, 1, -1).contiguous()
    return (freqs_t, freqs_h, freqs_w), tuple(pos)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    frames, h, w = _video(tokens)
    cfg = model.config
    p = cfg.patch_size
    text_mask = torch.ones(batch, text_tokens)
    text_mask[1:, -2:] = 0  # the second sample's last two text tokens are padding
    video_mask = torch.ones(batch, frames, p * h, p * w)
    video_mask[1:, -1, :, -p:] = 0  # and its last frame's right column of patches
    return {
        "hidden_states": torch.randn(batch, cfg.in_channels, frames, p * h, p * w, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.caption_channels, generator=g, dtype=dtype),
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
        "attention_mask": video_mask,
        "encoder_attention_mask": text_mask,
        "image_rotary_emb": _rope(model, frames, h, w),
    }


register(
    ALLEGRO,
    TinyCase(
        "allegro",
        "AllegroTransformer3DModel",
        dict(
            num_attention_heads=4,
            attention_head_dim=12,  # the RoPE takes a third per axis
            in_channels=4,
            out_channels=4,
            num_layers=1,
            cross_attention_dim=48,
            caption_channels=16,
            sample_height=8,
            sample_width=8,
            sample_frames=2,
        ),
        _inputs,
        note="text and video padding masks, RoPE positions split with the tokens",
    ),
)

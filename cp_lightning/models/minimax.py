"""MiniMax-H3: one packed sequence of text, video and audio rows, with per-row modality tags and timesteps.

The text stream first runs through a token refiner outside the split region (whole on every rank).
The packed sequence is split at the first block with the per-row tensors each block reads (AdaLN
indices), the RoPE tables after ``rope``, the per-row timestep indices at ``norm_out``, and both
output heads (video, audio) gathered before their rows are selected.
"""

from __future__ import annotations

import torch

from cp_lightning.models import DIFFUSERS, PlanEntry, TinyCase, register
from cp_lightning.tiny import _factor, _frames

# diffusers' own plan is right for training: both heads are gathered, so every output in the loss is whole.
MINIMAX_H3 = PlanEntry("MiniMaxH3Transformer3DModel", DIFFUSERS)

AUDIO_TOKENS = 5


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    frames = _frames(tokens)
    h = _factor(tokens // frames)
    w = tokens // frames // h
    seq = text_tokens + tokens + AUDIO_TOKENS
    # packed order: text rows, then video rows, then audio rows (any order works; indices say where)
    text_idx = torch.arange(text_tokens)
    video_idx = torch.arange(text_tokens, text_tokens + tokens)
    audio_idx = torch.arange(text_tokens + tokens, seq)
    tags = torch.cat([torch.ones(text_tokens), torch.zeros(tokens), torch.full((AUDIO_TOKENS,), 2.0)]).long()
    t, hh, ww = torch.meshgrid(torch.arange(frames), torch.arange(h), torch.arange(w), indexing="ij")
    video_pos = torch.stack([t, hh, ww], -1).reshape(-1, 3)
    text_pos = torch.arange(text_tokens)[:, None].expand(-1, 3)
    audio_pos = torch.stack([torch.arange(AUDIO_TOKENS), torch.zeros(AUDIO_TOKENS), torch.zeros(AUDIO_TOKENS)], -1)
    position_ids = torch.cat([text_pos.float(), video_pos.float(), audio_pos.float()])
    # two noise levels: text rows use timestep 0 (clean), video and audio rows timestep 1
    timestep_indices = (tags != 1).long()
    patch = cfg.in_channels * cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2]
    return {
        "hidden_states": torch.randn(batch, tokens, patch, generator=g, dtype=dtype),
        "audio_hidden_states": torch.randn(batch, AUDIO_TOKENS, cfg.audio_in_channels, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.text_dim, generator=g, dtype=dtype),
        "timestep": torch.tensor([0.0, 0.7], dtype=dtype),
        "timestep_indices": timestep_indices,
        "token_tags": tags,
        "position_ids": position_ids.to(dtype),
        "video_indices": video_idx,
        "audio_indices": audio_idx,
        "text_indices": text_idx,
    }


register(
    MINIMAX_H3,
    TinyCase(
        "minimax-h3",
        "MiniMaxH3Transformer3DModel",
        dict(
            num_attention_heads=4,
            attention_head_dim=16,
            hidden_size=64,
            num_layers=1,
            num_refiner_layers=1,
            ffn_dim=32,
            in_channels=4,
            audio_in_channels=4,
            text_dim=16,
            freq_dim=16,
            time_embed_hidden_dim=32,
            time_embed_dim=16,
            rope_freq_dim=2,
        ),
        _inputs,
        note="text, video and audio rows packed; video and audio heads both in the loss",
    ),
)

"""LTX-Video and LTX-2 (audio + video).

LTX-Video: video and text tokens split at the root with the text mask, RoPE tables after ``rope``,
gathered after ``proj_out`` (diffusers' plan, kept).

LTX-2 adds an audio stream that cross-attends to the video both ways. The video stream is split as in
LTX-Video; the audio stream (a few hundred tokens) stays whole on every rank, so its output is
replicated and never gathered: the engine's rule for outputs outside a gather (each rank owns 1/cp of
a replicated loss term) makes its gradients exact, for a loss over audio and video together.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import DIFFUSERS, PlanEntry, TinyCase, register
from cp_lightning.tiny import _factor, _frames, _ltx_inputs

LTX = PlanEntry("LTXVideoTransformer3DModel", DIFFUSERS)

_TABLES = {
    0: In(split_dim=1, expected_dims=3, split_output=True),
    1: In(split_dim=1, expected_dims=3, split_output=True),
}
# diffusers' LTX-2 plan misses two per-video-token tensors: the cross-modal RoPE tables (audio-to-video
# attention rotates the video queries by `cross_attn_rope`, (B, S, D)), and a per-token `timestep` (B, S)
# (conditioning frames at t = 0), whose embeddings modulate every block and norm_out token by token.
LTX2 = PlanEntry(
    "LTX2VideoTransformer3DModel",
    {
        "": {
            "hidden_states": In(split_dim=1, expected_dims=3),
            "encoder_hidden_states": In(split_dim=1, expected_dims=3),
            "encoder_attention_mask": In(split_dim=1, expected_dims=2),
            "timestep": In(split_dim=1, expected_dims=2),  # only when per token; a (B,) timestep passes whole
        },
        "rope": _TABLES,
        "cross_attn_rope": _TABLES,
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
    needs="gathers with parameters after them (outputs outside a gather: the audio stream)",
)

AUDIO_TOKENS = 5


def _ltx2_inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    frames = _frames(tokens)
    h = _factor(tokens // frames)
    w = tokens // frames // h
    t = torch.rand(batch, generator=g, dtype=dtype)[:, None].expand(batch, tokens).clone()
    t[:, : h * w] = 0  # the first latent frame is a clean conditioning frame
    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    mask[1:, text_tokens - 2 :] = 0
    return {
        "hidden_states": torch.randn(batch, tokens, cfg.in_channels, generator=g, dtype=dtype),
        "audio_hidden_states": torch.randn(batch, AUDIO_TOKENS, cfg.audio_in_channels, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.caption_channels, generator=g, dtype=dtype),
        "audio_encoder_hidden_states": torch.randn(batch, text_tokens, cfg.caption_channels, generator=g, dtype=dtype),
        "timestep": 1000 * t,
        "audio_timestep": 1000 * torch.rand(batch, generator=g, dtype=dtype),
        "encoder_attention_mask": mask,
        "num_frames": frames,
        "height": h,
        "width": w,
        "audio_num_frames": AUDIO_TOKENS,
    }


# LTX-2's tiny config (video and audio streams), shared with Sana-WM's LTX-2 refiner (sana_wm.py)
LTX2_TINY = dict(
    in_channels=8,
    out_channels=8,
    num_attention_heads=4,
    attention_head_dim=8,
    cross_attention_dim=32,
    audio_in_channels=8,
    audio_out_channels=8,
    audio_num_attention_heads=4,
    audio_attention_head_dim=4,
    audio_cross_attention_dim=16,
    num_layers=1,
    caption_channels=16,
)

register(
    LTX,
    LTX2,
    TinyCase(
        "ltx",
        "LTXVideoTransformer3DModel",
        dict(
            in_channels=8,
            out_channels=8,
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=4,
            attention_head_dim=8,
            cross_attention_dim=32,
            num_layers=1,
            caption_channels=16,
        ),
        _ltx_inputs,
    ),
    TinyCase(
        "ltx2",
        "LTX2VideoTransformer3DModel",
        LTX2_TINY,
        _ltx2_inputs,
        note="audio + video outputs in the loss, per-token video timesteps",
    ),
)

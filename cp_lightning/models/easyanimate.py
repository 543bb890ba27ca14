"""EasyAnimate: MMDiT-style joint [text, video] attention, then single-stream blocks, SDPA-direct.

Each block modulates text and video per sample, runs one joint attention over [text, video]
(``EasyAnimateAttnProcessor2_0`` calls SDPA itself and is routed by cp_lightning) and per-token feed-forwards
(separate text and video ones in the MMDiT blocks, shared ones after ``mmdit_layers``). So video and text are
split apart at the first block and stay sharded; the rank's joint sequence [text_r, video_r] is a permutation
of the keys. ``rope_embedding`` returns (S, D) cos and sin tables for the video tokens, split after it (the
processor rotates the video part of the rank's joint sequence, found by the local text length); the text
(and T5 text, concatenated to it in ``forward`` before the blocks) is split as one stream. The video is
gathered after ``proj_out``; the last block's text output is dropped, as in one process.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.wan import _video

_TABLE = In(split_dim=0, expected_dims=2, split_output=True)  # (S, D), one row per video token

EASYANIMATE = PlanEntry(
    "EasyAnimateTransformer3DModel",
    {
        "rope_embedding": {0: _TABLE, 1: _TABLE},
        "transformer_blocks.0": {
            "hidden_states": In(split_dim=1, expected_dims=3),
            "encoder_hidden_states": In(split_dim=1, expected_dims=3),  # [text, T5 text]: a joint stream
        },
        # norm_final, norm_out (per-sample modulation) and proj_out are per token: gathered after them
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
    needs="an SDPA-direct processor routed by cp_lightning",
)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    frames, h, w = _video(tokens)
    cfg = model.config
    p = cfg.patch_size
    return {
        "hidden_states": torch.randn(batch, cfg.in_channels, frames, p * h, p * w, generator=g, dtype=dtype),
        "timestep": torch.randint(0, 1000, (batch,), generator=g).float(),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.text_embed_dim, generator=g, dtype=dtype),
        "encoder_hidden_states_t5": torch.randn(batch, 3, cfg.text_embed_dim_t5, generator=g, dtype=dtype),
    }


register(
    EASYANIMATE,
    TinyCase(
        "easyanimate",
        "EasyAnimateTransformer3DModel",
        dict(
            num_attention_heads=4,
            attention_head_dim=16,  # the 3-D RoPE takes D/4 for time and 3D/8 for each spatial axis
            in_channels=4,
            out_channels=4,
            patch_size=2,
            num_layers=2,
            mmdit_layers=1,  # one MMDiT block (text weights of its own), one single-stream block
            time_embed_dim=16,
            text_embed_dim=16,
            text_embed_dim_t5=12,
            after_norm=True,
        ),
        _inputs,
        note="MMDiT then single-stream blocks, Qwen + T5 text",
    ),
)

"""Cosmos-Predict2 (``CosmosTransformer3DModel``): Wan-like video blocks with AdaLN-LoRA and 3D RoPE.

The patchified tokens are flattened in ``forward``, so they are split where they enter the first block, and
gathered after ``proj_out``, before the unpatchify reshapes. The RoPE tables (cos, sin of (S, D)) are split
at ``rope``'s output. Each block also takes the timestep embeddings: per sample (B, C) for a (B,) timestep,
passed whole, or per token (B, S, C) for a per-frame (B, 1, T, 1, 1) one, split with the tokens
(``PerTokenInput``; also at ``norm_out``), and Cosmos 1.0's learnable positional embedding (B, S, C),
split likewise. The text stays whole (cross-attention). The stock processor calls ``dispatch_attention_fn`` without a
``parallel_config``: routing.py gives it the CP config by the module it runs in (``BARE_DISPATCH``).
The tiny case leaves ``concat_padding_mask`` off (Predict2 turns it on: one more input channel before the
split, resized with torchvision, which the test environment lacks).
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.wan import _video
from cp_lightning.plan import PerTokenInput

_TABLE = In(split_dim=0, expected_dims=2, split_output=True)
_PER_TOKEN = PerTokenInput(split_dim=1, expected_dims=3)

COSMOS = PlanEntry(
    "CosmosTransformer3DModel",
    {
        "rope": {0: _TABLE, 1: _TABLE},
        "transformer_blocks.0": {"hidden_states": In(split_dim=1, expected_dims=3)},
        "transformer_blocks.*": {
            "embedded_timestep": _PER_TOKEN,
            "temb": _PER_TOKEN,
            "extra_pos_emb": In(split_dim=1, expected_dims=3),
        },
        "norm_out": {"embedded_timestep": _PER_TOKEN, "temb": _PER_TOKEN},  # it modulates the split tokens too
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
    needs="dispatch processors without a parallel_config (BARE_DISPATCH)",
)


def _inputs(model, g, batch, tokens, text_tokens, dtype, per_frame=False):
    frames, h, w = _video(tokens)
    cfg = model.config
    pt, ph, pw = cfg.patch_size
    shape = (batch, cfg.in_channels, pt * frames, ph * h, pw * w)
    t = torch.rand(batch, 1, frames, 1, 1, generator=g, dtype=dtype) if per_frame else torch.rand(batch, generator=g)
    return {
        "hidden_states": torch.randn(shape, generator=g, dtype=dtype),
        "timestep": t.to(dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.text_embed_dim, generator=g, dtype=dtype),
    }


def _per_frame_inputs(model, g, batch, tokens, text_tokens, dtype):
    return _inputs(model, g, batch, tokens, text_tokens, dtype, per_frame=True)


_CONFIG = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=4,
    attention_head_dim=12,
    num_layers=1,
    mlp_ratio=2.0,
    text_embed_dim=16,
    adaln_lora_dim=8,
    max_size=(8, 16, 16),
    patch_size=(1, 2, 2),
    rope_scale=(1.0, 4.0, 4.0),
    concat_padding_mask=False,
    extra_pos_embed_type=None,
)

register(
    COSMOS,
    TinyCase("cosmos-predict2", "CosmosTransformer3DModel", _CONFIG, _inputs),
    TinyCase(
        "cosmos-predict2-frames",
        "CosmosTransformer3DModel",
        _CONFIG,
        _per_frame_inputs,
        note="one timestep per latent frame: per-token block modulation",
    ),
)

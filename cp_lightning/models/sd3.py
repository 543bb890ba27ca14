"""Stable Diffusion 3 / 3.5 (MMDiT): joint attention over [image, text] in every block.

``pos_embed`` patchifies the latent and adds its positional embedding, so its output tokens are split
(each with its own position already added); the text tokens are split at the first block, after
``context_embedder``. Every other layer is per token; the image stream is gathered after ``proj_out``,
before the unpatchify reshape. SD3.5's extra image self-attention (``attn2``) and qk norms change
nothing here. Its processors call SDPA directly: ``parallelize`` installs CP-aware copies.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.tiny import _factor

SD3 = PlanEntry(
    "SD3Transformer2DModel",
    {
        "pos_embed": {0: In(split_dim=1, expected_dims=3, split_output=True)},
        "transformer_blocks.0": {"encoder_hidden_states": In(split_dim=1, expected_dims=3)},
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
    needs="CP-aware processors for SDPA-direct processors (JointAttnProcessor2_0)",
)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    h = _factor(tokens)
    p = cfg.patch_size
    return {
        "hidden_states": torch.randn(batch, cfg.in_channels, p * h, p * (tokens // h), generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.joint_attention_dim, generator=g, dtype=dtype),
        "pooled_projections": torch.randn(batch, cfg.pooled_projection_dim, generator=g, dtype=dtype),
        "timestep": 1000 * torch.rand(batch, generator=g, dtype=dtype),
    }


_CONFIG = dict(
    sample_size=16,
    patch_size=2,
    in_channels=4,
    num_layers=1,
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=16,
    caption_projection_dim=32,
    pooled_projection_dim=8,
    out_channels=4,
    pos_embed_max_size=24,
)

# the last block is context_pre_only: text gives keys and values but no output, so its text queries are unused
_UNUSED = ("transformer_blocks.0.attn.add_q_proj", "transformer_blocks.0.attn.norm_added_q")

register(
    SD3,
    TinyCase("sd3", "SD3Transformer2DModel", _CONFIG, _inputs, unused=_UNUSED),
    TinyCase(
        "sd3.5",
        "SD3Transformer2DModel",
        dict(_CONFIG, qk_norm="rms_norm", dual_attention_layers=(0,)),
        _inputs,
        unused=_UNUSED,
        note="dual attention (attn2) and qk norm",
    ),
)

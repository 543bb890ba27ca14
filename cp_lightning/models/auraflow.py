"""AuraFlow: MMDiT blocks over [registers + text, image], then single blocks over the one joint sequence.

``pos_embed`` patchifies the latent and adds each patch's learned position embedding, so its output tokens are
split (each with its own position already added). ``forward`` prepends 8 learned register tokens to the projected
text, so the text is split where the joint blocks get it, at the first MMDiT block (split before the concatenation,
every rank would hold all 8 registers). The single blocks concatenate [text_r, image_r] on each rank and cut it back
by the local text length; attention has no mask and no RoPE (positions were added to the image tokens), so the
order of the ranks' pieces in the joint sequence does not matter. Everything else is per token; the image stream
is gathered after ``proj_out``, before the unpatchify reshape. The stock ``AuraFlowAttnProcessor2_0`` calls SDPA
directly: ``parallelize`` routes it.

Without MMDiT blocks (``num_mmdit_layers=0``; the released models have 4) there is no split point for the text apart
from the image, and ``forward`` cuts the image tokens out of the joint sequence by full lengths: refused.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.tiny import _factor

_TOKENS = In(split_dim=1, expected_dims=3)

AURAFLOW = PlanEntry(
    "AuraFlowTransformer2DModel",
    {
        "pos_embed": {0: In(split_dim=1, expected_dims=3, split_output=True)},  # image tokens, positions added
        "joint_transformer_blocks.0": {"encoder_hidden_states": _TOKENS},  # [registers, text], after the concat
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
    refuse=lambda model: (
        "with num_mmdit_layers=0 forward joins text and image into one sequence before any block and cuts the image "
        "tokens back out by full lengths after the last one; the library plans AuraFlow with MMDiT blocks, as released "
        "(pass plan= splitting the single blocks' sequence, gathered after the last block, without loss_parallel)"
        if model.config.num_mmdit_layers == 0
        else None
    ),
    needs="CP-aware processors for SDPA-direct processors (AuraFlowAttnProcessor2_0)",
)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    h, p = _factor(tokens), cfg.patch_size
    return {
        "hidden_states": torch.randn(batch, cfg.in_channels, p * h, p * (tokens // h), generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.joint_attention_dim, generator=g, dtype=dtype),
        "timestep": torch.rand(batch, generator=g, dtype=dtype),
    }


register(
    AURAFLOW,
    TinyCase(
        "auraflow",
        "AuraFlowTransformer2DModel",
        dict(
            sample_size=16,
            patch_size=2,
            in_channels=4,
            num_mmdit_layers=1,
            num_single_dit_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=16,
            caption_projection_dim=32,
            out_channels=4,
            pos_embed_max_size=64,  # an 8 x 8 grid of learned positions
        ),
        _inputs,
        note="8 register tokens prepended to the text",
    ),
)

"""CogView4: joint attention over [text, image] in every block, image RoPE on the image part only.

``patch_embed`` returns the patchified image tokens and the projected text tokens: both outputs are split
(text with text, image with image), so each rank's joint sequence is [text_r, image_r]. The RoPE table
(cos, sin of (S, D), image tokens only) is split like the image tokens it rotates; the processor rotates
the part of its joint sequence after its local text. All other layers are per token; the image stream is
gathered after ``proj_out``, before the unpatchify reshape. The stock ``CogView4AttnProcessor`` calls SDPA
directly: ``parallelize`` routes it. Its text padding mask is refused: the processor turns it into a float
(B, 1, S, S) outer product (added to the scores), one row per query, which CP attention cannot split.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.tiny import _factor

_TOKENS = In(split_dim=1, expected_dims=3, split_output=True)
_TABLE = In(split_dim=0, expected_dims=2, split_output=True)

COGVIEW4 = PlanEntry(
    "CogView4Transformer2DModel",
    {
        "rope": {0: _TABLE, 1: _TABLE},  # (cos, sin) of the image tokens
        "patch_embed": {0: _TOKENS, 1: _TOKENS},  # (image, text) tokens
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
    needs="CP-aware processors for SDPA-direct processors (CogView4AttnProcessor)",
)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    h, p = _factor(tokens), cfg.patch_size
    sizes = torch.tensor([[64.0, 64.0]] * batch, dtype=dtype)
    return {
        "hidden_states": torch.randn(batch, cfg.in_channels, p * h, p * (tokens // h), generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.text_embed_dim, generator=g, dtype=dtype),
        "timestep": 1000 * torch.rand(batch, generator=g, dtype=dtype),
        "original_size": sizes,
        "target_size": sizes,
        "crop_coords": torch.zeros(batch, 2, dtype=dtype),
    }


register(
    COGVIEW4,
    TinyCase(
        "cogview4",
        "CogView4Transformer2DModel",
        dict(
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            text_embed_dim=16,
            time_embed_dim=16,
            condition_dim=8,
            rope_axes_dim=(8, 8),
        ),
        _inputs,
    ),
)


# CogView3-Plus: ``patch_embed`` returns one [text, image] tensor (the image with its sin-cos positions added), which
# ``forward`` cuts at the full text length; so text and image are split apart at the first block. Its blocks run
# ``CogVideoXAttnProcessor2_0`` (SDPA-direct, routed) over [text_r, image_r] and a feed-forward over the same
# concatenation, cut back by the local text length. No RoPE, no mask; the image stream is gathered after ``proj_out``.
COGVIEW3PLUS = PlanEntry(
    "CogView3PlusTransformer2DModel",
    {
        "transformer_blocks.0": {
            "hidden_states": In(split_dim=1, expected_dims=3),
            "encoder_hidden_states": In(split_dim=1, expected_dims=3),
        },
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
    needs="CP-aware processors for SDPA-direct processors (CogVideoXAttnProcessor2_0)",
)

# GLM-Image: CogView4's layout (joint attention over [text, image], RoPE on the image part). ``forward`` adds the
# prior-token embeddings to the whole image tokens and builds the (cos, sin) image RoPE table (or takes it as an
# input), so text and image are split at the first block and the table, handed whole to every block, at each block.
# A text ``attention_mask`` is refused by CP attention: the processor turns it into a float (B, 1, S, S) matrix (one
# row per query). The KV caches of image-conditioned inference are not part of training and are not checked here.
GLM_IMAGE = PlanEntry(
    "GlmImageTransformer2DModel",
    {
        "transformer_blocks.0": {
            "hidden_states": In(split_dim=1, expected_dims=3),
            "encoder_hidden_states": In(split_dim=1, expected_dims=3),
        },
        "transformer_blocks.*": {"image_rotary_emb": In(split_dim=0, expected_dims=2)},  # (cos, sin), (S, D) each
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
)


def _cogview3plus_inputs(model, g, batch, tokens, text_tokens, dtype):
    inputs = _inputs(model, g, batch, tokens, text_tokens, dtype)
    inputs["original_size"] = inputs["target_size"]
    return inputs


def _glm_inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    h, p = _factor(tokens), cfg.patch_size
    drop = torch.zeros(batch, tokens, dtype=torch.bool)
    drop[1:] = True  # the second sample's prior tokens are dropped (zeroed), as for the unconditional branch
    return {
        "hidden_states": torch.randn(batch, cfg.in_channels, p * h, p * (tokens // h), generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.text_embed_dim, generator=g, dtype=dtype),
        "prior_token_id": torch.randint(0, cfg.prior_vq_quantizer_codebook_size, (batch, tokens), generator=g),
        "prior_token_drop": drop,
        "timestep": 1000 * torch.rand(batch, generator=g, dtype=dtype),
        "target_size": torch.tensor([[64.0, 64.0]] * batch, dtype=dtype),
        "crop_coords": torch.zeros(batch, 2, dtype=dtype),
    }


register(
    COGVIEW3PLUS,
    GLM_IMAGE,
    TinyCase(
        "cogview3plus",
        "CogView3PlusTransformer2DModel",
        dict(
            patch_size=2,
            in_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            out_channels=4,
            text_embed_dim=16,
            time_embed_dim=16,
            condition_dim=8,
            pos_embed_max_size=16,
        ),
        _cogview3plus_inputs,
    ),
    TinyCase(
        "glm-image",
        "GlmImageTransformer2DModel",
        dict(
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            text_embed_dim=16,
            time_embed_dim=16,
            condition_dim=8,
            prior_vq_quantizer_codebook_size=64,
        ),
        _glm_inputs,
        note="prior-token embeddings added to the image tokens",
    ),
)

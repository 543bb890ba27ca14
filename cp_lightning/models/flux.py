"""Flux-architecture image transformers: Flux.1 (and Kontext), Flux.2, Bria and Chroma (chroma.py).

Text and image tokens form one joint sequence in every block (double-stream blocks concatenate them
inside attention, single-stream blocks outright), and all layers outside attention are per token. So
both streams are split along the sequence (text with text, image with image), the position ids with
the tokens they describe, and the image stream is gathered after ``proj_out``.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import DIFFUSERS, PlanEntry, TinyCase, register
from cp_lightning.tiny import _factor, _flux_inputs

# Flux.1's own plan: hidden_states, encoder_hidden_states, img_ids and txt_ids split at the root; the RoPE
# tables are built from the split ids, so they match the local tokens; proj_out gathered.
FLUX = PlanEntry("FluxTransformer2DModel", DIFFUSERS)

# Flux.2 (diffusers' own plan, the same shape with batched (B, S, 4) ids, and its KV mode): flux2_kv.py

# Bria 3.x: Flux.1's layout without pooled text or guidance, and no diffusers plan; Flux.1's plan fits it as
# it is. Its forward takes (S, 3) ids (a (B, S, 3) id tensor is cut to its first sample there, so the plan
# asks for the 2-d form, which names the same positions).
BRIA = PlanEntry(
    "BriaTransformer2DModel",
    {
        "": {
            "hidden_states": In(split_dim=1, expected_dims=3),
            "encoder_hidden_states": In(split_dim=1, expected_dims=3),
            "img_ids": In(split_dim=0, expected_dims=2),
            "txt_ids": In(split_dim=0, expected_dims=2),
        },
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
)


def _bria_inputs(model, g, batch, tokens, text_tokens, dtype):
    inputs = _flux_inputs(model, g, batch, tokens, text_tokens, dtype)
    del inputs["pooled_projections"]  # Bria has no pooled text embedding
    return inputs


def _flux2_inputs(model, g, batch, tokens, text_tokens, dtype):
    side_h = _factor(tokens)
    rows, cols = torch.meshgrid(torch.arange(side_h), torch.arange(tokens // side_h), indexing="ij")
    zeros = torch.zeros_like(rows)
    img_ids = torch.stack([zeros, rows, cols, zeros], dim=-1).reshape(1, -1, 4).expand(batch, -1, -1)
    txt_ids = torch.zeros(batch, text_tokens, 4)
    txt_ids[..., 3] = torch.arange(text_tokens)
    cfg = model.config
    return {
        "hidden_states": torch.randn(batch, tokens, cfg.in_channels, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.joint_attention_dim, generator=g, dtype=dtype),
        "timestep": torch.rand(batch, generator=g, dtype=dtype),
        "img_ids": img_ids.to(dtype),
        "txt_ids": txt_ids.to(dtype),
        "guidance": torch.full((batch,), 3.5, dtype=dtype),
    }


# Bria's tiny config (Flux.1's layout without pooled text or guidance), shared with LongCat and Ovis (fluxlike.py)
BRIA_TINY = dict(
    patch_size=1,
    in_channels=16,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=32,
    axes_dims_rope=(4, 6, 6),
)

register(
    FLUX,
    BRIA,
    TinyCase(
        "flux",
        "FluxTransformer2DModel",
        dict(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            axes_dims_rope=(4, 6, 6),
        ),
        _flux_inputs,
    ),
    TinyCase(
        "flux2",
        "Flux2Transformer2DModel",
        dict(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=32,
            timestep_guidance_channels=16,
            axes_dims_rope=(4, 4, 4, 4),
        ),
        _flux2_inputs,
    ),
    TinyCase(
        "bria",
        "BriaTransformer2DModel",
        BRIA_TINY,
        _bria_inputs,
    ),
)

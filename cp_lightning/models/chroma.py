"""Chroma: Flux's architecture with a text padding mask over the joint [text, image] sequence.

As for Flux, text and image tokens are split apart at the root with their position ids (Chroma takes
them unbatched, (S, 3)), and the image stream is gathered after ``proj_out``. The ``attention_mask``
argument is the pipeline's (B, T + S) key mask over [text, image]; each block expands it to the outer
product (B, 1, S, S) of that vector, which the engine collapses back to the key mask (checked).
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.plan import JointInput
from cp_lightning.tiny import _factor

CHROMA = PlanEntry(
    "ChromaTransformer2DModel",
    {
        "": {
            "hidden_states": In(split_dim=1, expected_dims=3),
            "encoder_hidden_states": In(split_dim=1, expected_dims=3),
            "img_ids": In(split_dim=0, expected_dims=2),
            "txt_ids": In(split_dim=0, expected_dims=2),
            # [text, image] as one tensor: rank r keeps [text_r, image_r], the order of its joint sequence
            "attention_mask": JointInput(
                split_dim=1, expected_dims=2, segments=("encoder_hidden_states", "hidden_states")
            ),
        },
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
    needs="outer-product masks collapsed to key masks",
)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    side = _factor(tokens)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(tokens // side), indexing="ij")
    text = torch.ones(batch, text_tokens, dtype=torch.bool)
    for i in range(1, batch):  # padding differs per sample; Chroma keeps one pad token visible
        text[i, max(2, text_tokens - 2 * i) :] = False
    return {
        "hidden_states": torch.randn(batch, tokens, cfg.in_channels, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.joint_attention_dim, generator=g, dtype=dtype),
        "timestep": torch.rand(batch, generator=g, dtype=dtype),
        "img_ids": torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).to(dtype),
        "txt_ids": torch.zeros(text_tokens, 3, dtype=dtype),
        "attention_mask": torch.cat([text, torch.ones(batch, tokens, dtype=torch.bool)], dim=1),
    }


register(
    CHROMA,
    TinyCase(
        "chroma",
        "ChromaTransformer2DModel",
        dict(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=32,
            axes_dims_rope=(4, 6, 6),
            approximator_num_channels=8,
            approximator_hidden_dim=32,
            approximator_layers=1,
        ),
        _inputs,
        note="text padded differently per sample (outer-product mask)",
    ),
)

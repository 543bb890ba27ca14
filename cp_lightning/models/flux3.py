"""Flux.3: per-mode blocks (text, image, reference images) then joint single blocks over [text, image, reference].

Three token modes each first pass their own blocks, whose self-attention stays inside the mode, then meet in the
single blocks' joint attention. Everything else is per token: the modulation is per token too, but ``forward``
builds it by expanding a per-sample embedding to each mode's length, which it reads from the (already split) tokens.
So every mode is split at the root, each with its (L, 4) position ids (the RoPE tables are built from them on each
rank); each mode's blocks then attend over that mode across the CP group, and the single blocks over each rank's
[text_r, image_r, reference_r], the same order as the table ``forward`` concatenates from the local pieces (joint
attention has no mask, so the ranks' order of pieces does not matter). ``forward`` cuts the image tokens out of the
content stream by the local image length, and the image stream is gathered after ``proj_out``.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.tiny import _factor

_TOKENS = In(split_dim=1, expected_dims=3)
_IDS = In(split_dim=0, expected_dims=2)  # (L, 4) (t, h, w, l) position ids, shared by the batch

FLUX3 = PlanEntry(
    "Flux3Transformer2DModel",
    {
        "": {
            "hidden_states": _TOKENS,
            "img_ids": _IDS,
            "encoder_hidden_states": _TOKENS,
            "txt_ids": _IDS,
            "image_cond_hidden_states": _TOKENS,  # reference images, when given
            "image_cond_ids": _IDS,
        },
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
)


def _grid_ids(tokens: int, t: int) -> torch.Tensor:
    h = _factor(tokens)
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(tokens // h), indexing="ij")
    return torch.stack([torch.full_like(rows, t), rows, cols, torch.zeros_like(rows)], dim=-1).reshape(-1, 4)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    txt_ids = torch.zeros(text_tokens, 4)
    txt_ids[:, 3] = torch.arange(text_tokens)
    return {
        "hidden_states": torch.randn(batch, tokens, cfg.in_channels, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.joint_attention_dim, generator=g, dtype=dtype),
        "timestep": torch.rand(batch, generator=g, dtype=dtype),
        "img_ids": _grid_ids(tokens, 0).to(dtype),
        "txt_ids": txt_ids.to(dtype),
    }


def _edit_inputs(model, g, batch, tokens, text_tokens, dtype):
    inputs = _inputs(model, g, batch, tokens, text_tokens, dtype)
    cond = tokens - 4  # a reference image of another size, on its own time plane
    inputs["image_cond_hidden_states"] = torch.randn(
        batch, cond, model.config.cond_in_channels, generator=g, dtype=dtype
    )
    inputs["image_cond_ids"] = _grid_ids(cond, 1).to(dtype)
    inputs["target_timestep"] = 0.5 * inputs["timestep"]  # a flow-map (step-distilled) model
    return inputs


_CONFIG = dict(
    in_channels=16,
    cond_in_channels=8,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=16,
    timestep_channels=16,
    axes_dims_rope=(2, 2, 2, 2),
)

register(
    FLUX3,
    # text to image: the reference-image mode's embedder and blocks get no input
    TinyCase(
        "flux3",
        "Flux3Transformer2DModel",
        _CONFIG,
        _inputs,
        unused=(
            "x_embedders.image_cond",
            "mode_blocks.image_cond",
            "early_stream_modulations.image_cond",
            "single_stream_modulations.image_cond",
        ),
        note="text and image modes",
    ),
    TinyCase(
        "flux3-edit",
        "Flux3Transformer2DModel",
        dict(_CONFIG, flow_map=True),
        _edit_inputs,
        note="text, image and reference-image modes (a flow-map model)",
    ),
)

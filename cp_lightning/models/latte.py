"""Latte: factorised video attention, a spatial block over each frame's tokens then a temporal one over frames.

No attention ever spans the whole video: a spatial block attends over the H x W tokens of one frame (a batch
of B x F frames) and a temporal block over the F frames of one position (a batch of B x H x W positions),
and ``forward`` transposes the tokens between the two with reshapes of the whole tensor. So the plan splits
and gathers around every block:

* spatial blocks: each frame's tokens are split (dim 1 of (B x F, H x W, C)); their self-attention runs over
  the CP group, their cross-attention to the whole text locally. Gathered at the block's output.
* temporal blocks: the B x H x W position rows are split (dim 0 of (B x H x W, F, C)), with the per-row
  timestep embedding ``forward`` repeats for them; each row holds all its frames, so their attention stays
  local (``Unsplit``: no CP communication). Gathered at the block's output.

Between blocks only ``forward``'s transposes and the temporal position embedding run, on whole tokens.
Each block costs one all-gather of its output (and, in backward, one all-reduce of its gradient), not the
Ulysses all-to-alls, and the per-frame or per-position attention costs cp times less on each rank.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.plan import Unsplit
from cp_lightning.tiny import _factor


def _plan(config) -> dict:
    layers = range(config.num_layers)
    return {
        "transformer_blocks.*": {"hidden_states": In(split_dim=1, expected_dims=3)},  # tokens within a frame
        **{f"transformer_blocks.{i}": Out(gather_dim=1, expected_dims=3) for i in layers},
        "temporal_transformer_blocks.*": {
            "hidden_states": In(split_dim=0, expected_dims=3),  # position rows, each with all its frames
            "timestep": In(split_dim=0, expected_dims=2),  # (B x H x W, 6C): one row per position row
        },
        "temporal_transformer_blocks.*.attn1": Unsplit(),  # attention over one row's own frames: local
        **{f"temporal_transformer_blocks.{i}": Out(gather_dim=0, expected_dims=3) for i in layers},
    }


LATTE = PlanEntry(
    "LatteTransformer3DModel",
    _plan,
    needs="gathers that are split again (along another dim), parameters after them",
    loss_parallel="its last gather is over position rows (B x H x W), which forward regroups by the batch size",
)

_FRAMES = 3  # the config's video_length: the temporal position embedding is added when frames > 1


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    frames = _FRAMES if tokens % _FRAMES == 0 else 1
    h = _factor(tokens // frames)
    w = tokens // frames // h
    cfg = model.config
    p = cfg.patch_size
    return {
        "hidden_states": torch.randn(batch, cfg.in_channels, frames, p * h, p * w, generator=g, dtype=dtype),
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.caption_channels, generator=g, dtype=dtype),
    }


register(
    LATTE,
    TinyCase(
        "latte",
        "LatteTransformer3DModel",
        dict(
            num_attention_heads=4,
            attention_head_dim=8,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            cross_attention_dim=32,
            sample_size=8,
            patch_size=2,
            activation_fn="gelu-approximate",
            num_embeds_ada_norm=1000,
            norm_type="ada_norm_single",
            norm_elementwise_affine=False,
            norm_eps=1e-6,
            caption_channels=16,
            video_length=_FRAMES,
        ),
        _inputs,
        note="spatial blocks split per frame, temporal blocks per position row",
    ),
)

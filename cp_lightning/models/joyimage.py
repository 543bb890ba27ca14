"""JoyImage-Edit and JoyImage-Edit-Plus: dual-stream blocks with joint attention over [image, text].

Every layer outside the joint attention is per token (Wan-style modulation tables, per sample), so image and text
tokens are split apart at the first block, where ``forward`` hands them over (after patch-embedding the image, and
for Edit-Plus after embedding each padded patch), and the image stream is gathered after ``proj_out``.

JoyImage-Edit: ``forward`` builds the RoPE tables as ((cos, sin) of the image tokens, (cos, sin) of the text tokens
or None), each (L, D), from the full grid and text length, and hands them to every block: split at every block,
each table like the tokens it rotates (the nested tuple is split item by item). Edit inputs (several images
concatenated along frames) change nothing: they are more image tokens.

JoyImage-Edit-Plus: each sample's target and reference images are patchified into one padded list of patches; the
per-sample RoPE tables (B, N, D) are split with the patches, and the (B, 1, 1, N + T) key mask over [patches, text]
(padding patches and padded text masked out), built in ``forward`` from full lengths, is split as a ``JointInput``.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.hunyuan import _text_mask
from cp_lightning.plan import JointInput

_STREAMS = {
    "hidden_states": In(split_dim=1, expected_dims=3),
    "encoder_hidden_states": In(split_dim=1, expected_dims=3),
}

JOYIMAGE = PlanEntry(
    "JoyImageEditTransformer3DModel",
    {
        "double_blocks.0": _STREAMS,
        # ((cos, sin) image, (cos, sin) text or None), each (L, D): split like the tokens each rotates
        "double_blocks.*": {"image_rotary_emb": In(split_dim=0, expected_dims=2)},
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
)

JOYIMAGE_PLUS = PlanEntry(
    "JoyImageEditPlusTransformer3DModel",
    {
        "double_blocks.0": _STREAMS,
        "double_blocks.*": {
            "image_rotary_emb": In(split_dim=1, expected_dims=3),  # (cos, sin), (B, N, D) each
            "attention_mask": JointInput(split_dim=3, expected_dims=4, segments=tuple(_STREAMS)),
        },
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    items = 3 if tokens % 3 == 0 else 1  # an edit: the target and two reference images, one frame each
    per_item = tokens // items
    latent = torch.randn(batch, items, cfg.in_channels, 1, 2, 2 * per_item, generator=g, dtype=dtype)
    return {
        "hidden_states": latent if items > 1 else latent[:, 0],
        "timestep": 1000 * torch.rand(batch, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.text_dim, generator=g, dtype=dtype),
    }


def _plus_inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    pt, ph, pw = cfg.patch_size
    # per sample: the target image and one reference of its own size (the second sample's is smaller: padded)
    shapes = [[(1, 1, tokens - 3), (1, 1, 3 - min(b, 1))] for b in range(batch)]
    return {
        "hidden_states": torch.randn(batch, tokens, cfg.in_channels, pt, ph, pw, generator=g, dtype=dtype),
        "timestep": 1000 * torch.rand(batch, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.text_dim, generator=g, dtype=dtype),
        "encoder_hidden_states_mask": _text_mask(batch, text_tokens),
        "shape_list": shapes,
    }


_CONFIG = dict(
    in_channels=4,
    hidden_size=32,
    num_attention_heads=4,
    text_dim=16,
    mlp_width_ratio=2.0,
    num_layers=1,
    rope_dim_list=[2, 2, 4],
)


# the last block's text output is dropped, so the text-only layers that make it get no gradient (in one process too)
def _last_text(block: int) -> tuple[str, ...]:
    return tuple(f"double_blocks.{block}.{name}" for name in ("attn.txt_attn_proj", "attn.txt_attn_q_norm", "txt_mlp"))


register(
    JOYIMAGE,
    JOYIMAGE_PLUS,
    TinyCase(
        "joyimage-edit",
        "JoyImageEditTransformer3DModel",
        dict(_CONFIG, rope_type="mrope", num_layers=2),  # the first block's text output (rotated text) is used
        _inputs,
        unused=_last_text(1),
        note="three images (target and references) along frames; text RoPE (mrope)",
    ),
    TinyCase(
        "joyimage-edit-plus",
        "JoyImageEditPlusTransformer3DModel",
        _CONFIG,
        _plus_inputs,
        unused=_last_text(0),
        note="padded per-sample patch lists with per-sample RoPE; text padded per sample",
    ),
)

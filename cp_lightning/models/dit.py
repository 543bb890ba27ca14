"""DiTs built from diffusers' ``BasicTransformerBlock``: DiT (class-conditional), PixArt-alpha/sigma, DreamLite.

Their blocks are per token around stock ``AttnProcessor2_0`` attention (SDPA-direct, routed by ``parallelize``):
self-attention over the image tokens runs over the CP group, cross-attention to the text (PixArt, DreamLite) runs
locally against the whole text on every rank. Conditioning (timestep, class label, PixArt's size conditions) is
per sample.

DiT and PixArt: ``pos_embed`` patchifies the latent and adds its sin-cos positions, so its output tokens are split
(each with its own position added); PixArt's optional image key mask ((B, S), which ``forward`` turns into a
(B, 1, S) additive bias) is split with them at every block. The output is gathered after the last per-token layer
(``proj_out_2`` / ``proj_out``), before the unpatchify reshape. DiT draws its class-label dropout (p = 0.1 in
training mode) from the global RNG: CP peers seeded alike (the strategy seeds per dp rank) draw alike.

DreamLite's transformer sits inside a U-Net: it group-normalises the whole (B, C, H, W) feature map and projects it
(a 1x1 convolution by default) before flattening it to tokens, and after the blocks reshapes the tokens back to a map,
projects it and adds the input. So the tokens are split where they enter the first block, and gathered after the
last block; its (B, S) self-attention key mask is split with them at every block.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.tiny import _factor

_PATCHES = {0: In(split_dim=1, expected_dims=3, split_output=True)}  # patch tokens, positions already added
_SDPA = "CP-aware processors for SDPA-direct processors (AttnProcessor2_0)"

DIT = PlanEntry(
    "DiTTransformer2DModel",
    {"pos_embed": _PATCHES, "proj_out_2": Out(gather_dim=1, expected_dims=3)},
    needs=_SDPA,
)

PIXART = PlanEntry(
    "PixArtTransformer2DModel",
    {
        "pos_embed": _PATCHES,
        "transformer_blocks.*": {"attention_mask": In(split_dim=2, expected_dims=3)},  # (B, 1, S) key bias, if any
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
    needs=_SDPA,
)


def _dreamlite_plan(config) -> dict:
    last = config.num_layers - 1
    mask = {"attention_mask": In(split_dim=1, expected_dims=2)}  # (B, S) self-attention key mask, if any
    tokens = {"hidden_states": In(split_dim=1, expected_dims=3)}
    if not last:  # one key cannot both split and gather the only block: its "*" entry splits the tokens too
        return {"transformer_blocks.*": {**tokens, **mask}, "transformer_blocks.0": Out(gather_dim=1, expected_dims=3)}
    return {
        "transformer_blocks.0": tokens,
        "transformer_blocks.*": mask,
        f"transformer_blocks.{last}": Out(gather_dim=1, expected_dims=3),
    }


DREAMLITE = PlanEntry("DreamLiteTransformer2DModel", _dreamlite_plan, needs=_SDPA + "; gathers with parameters after")


def _latent(model, g, batch, tokens, dtype, side=None):
    cfg = model.config
    h = side or _factor(tokens)
    p = getattr(cfg, "patch_size", None) or 1
    return torch.randn(batch, cfg.in_channels, p * h, p * (tokens // h), generator=g, dtype=dtype)


def _image_mask(batch, tokens):
    mask = torch.ones(batch, tokens, dtype=torch.long)
    mask[1:, -3:] = 0  # the second sample's last three image tokens are masked out as keys
    return mask


def _dit_inputs(model, g, batch, tokens, text_tokens, dtype):
    side = max(2, round(tokens**0.5))  # DiT unpatchifies square grids only: 21 tokens -> 5 x 5
    return {
        "hidden_states": _latent(model, g, batch, side * side, dtype, side=side),
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
        # the null class (index num_classes): its embedding is the same with and without the random label dropout
        "class_labels": torch.full((batch,), model.config.num_embeds_ada_norm, dtype=torch.long),
    }


def _pixart_inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    text_mask = torch.ones(batch, text_tokens, dtype=torch.long)
    text_mask[1:, -2:] = 0
    return {
        "hidden_states": _latent(model, g, batch, tokens, dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.caption_channels, generator=g, dtype=dtype),
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
        "attention_mask": _image_mask(batch, tokens),
        "encoder_attention_mask": text_mask,
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
    }


def _dreamlite_inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    return {
        "hidden_states": _latent(model, g, batch, tokens, dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.cross_attention_dim, generator=g, dtype=dtype),
        "attention_mask": _image_mask(batch, tokens),
    }


_BLOCKS = dict(num_attention_heads=4, attention_head_dim=8, in_channels=4, num_layers=1)

register(
    DIT,
    PIXART,
    DREAMLITE,
    TinyCase(
        "dit",
        "DiTTransformer2DModel",
        dict(_BLOCKS, out_channels=4, sample_size=8, patch_size=1, num_embeds_ada_norm=10),
        _dit_inputs,
        note="class-conditional; square grid (25 tokens)",
    ),
    TinyCase(
        "pixart",
        "PixArtTransformer2DModel",
        dict(_BLOCKS, out_channels=4, sample_size=8, patch_size=1, cross_attention_dim=32, caption_channels=16),
        _pixart_inputs,
        note="image key mask and text mask",
    ),
    TinyCase(
        "dreamlite",
        "DreamLiteTransformer2DModel",
        dict(_BLOCKS, out_channels=4, norm_num_groups=2, cross_attention_dim=16, qk_norm="rms_norm"),
        _dreamlite_inputs,
        note="U-Net transformer: group norm and 1x1 convolutions around the blocks; image key mask",
    ),
)

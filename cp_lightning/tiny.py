"""Tiny random-init diffusers transformers and matching inputs, for tests, the demo and benchmarks.

Each entry builds the real diffusers architecture from a small config (no download) and makes a
full, deterministic batch of inputs: the same seed gives the same tensors on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = ["MODELS", "tiny_model", "tiny_inputs"]


def _flux(heads: int) -> nn.Module:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=heads,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    )


def _flux_inputs(model, g, batch, tokens, text_tokens, dtype):
    side_h = _factor(tokens)
    side_w = tokens // side_h
    rows, cols = torch.meshgrid(torch.arange(side_h), torch.arange(side_w), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).to(dtype)
    return {
        "hidden_states": torch.randn(batch, tokens, 16, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, 32, generator=g, dtype=dtype),
        "pooled_projections": torch.randn(batch, 32, generator=g, dtype=dtype),
        "timestep": torch.rand(batch, generator=g, dtype=dtype),
        "img_ids": img_ids,
        "txt_ids": torch.zeros(text_tokens, 3, dtype=dtype),
    }


def _wan(heads: int) -> nn.Module:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=64,
    )


def _wan_inputs(model, g, batch, tokens, text_tokens, dtype):
    # tokens = frames * (H/2) * (W/2)
    frames = _frames(tokens)
    side_h = _factor(tokens // frames)
    side_w = tokens // frames // side_h
    return {
        "hidden_states": torch.randn(batch, 4, frames, 2 * side_h, 2 * side_w, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, 16, generator=g, dtype=dtype),
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
    }


def _qwenimage(heads: int) -> nn.Module:
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=heads,
        joint_attention_dim=16,
        axes_dims_rope=(8, 4, 4),
    )


def _qwenimage_inputs(model, g, batch, tokens, text_tokens, dtype):
    side_h = _factor(tokens)
    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    for i in range(1, batch):  # every sample after the first has a different amount of text padding
        mask[i, max(1, text_tokens - 2 * i - 1) :] = 0
    return {
        "hidden_states": torch.randn(batch, tokens, 16, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, 16, generator=g, dtype=dtype),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.rand(batch, generator=g, dtype=dtype),
        "img_shapes": [(1, side_h, tokens // side_h)] * batch,
    }


def _ltx(heads: int) -> nn.Module:
    from diffusers import LTXVideoTransformer3DModel

    return LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=heads,
        attention_head_dim=8,
        cross_attention_dim=8 * heads,
        num_layers=1,
        caption_channels=16,
    )


def _ltx_inputs(model, g, batch, tokens, text_tokens, dtype):
    frames = _frames(tokens)
    side_h = _factor(tokens // frames)
    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    for i in range(1, batch):
        mask[i, max(1, text_tokens - 2 * i - 1) :] = 0
    return {
        "hidden_states": torch.randn(batch, tokens, 8, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, 16, generator=g, dtype=dtype),
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
        "encoder_attention_mask": mask,
        "num_frames": frames,
        "height": side_h,
        "width": tokens // frames // side_h,
        "rope_interpolation_scale": (1.0, 1.0, 1.0),
    }


def construct(cls: type, config: dict) -> nn.Module:
    """``cls(**config)`` with ``torch.empty`` zero-filled while it runs. diffusers leaves a few parameters uninitialised
    (NucleusMoE's experts, Lumina-Next's pad token): built zero, the checker's ``_wake`` gives them seeded values, the
    same on every rank, where uninitialised memory would differ from rank to rank."""
    empty = torch.empty
    torch.empty = lambda *args, **kwargs: empty(*args, **kwargs).zero_()
    try:
        return cls(**config)
    finally:
        torch.empty = empty


def checkpoint(module: nn.Module, *args, **kwargs):
    """diffusers' default gradient-checkpointing function, also taking keyword arguments: diffusers 0.42.1's
    HunyuanImage passes some, and its default function (positional only) raises TypeError, in one process too."""
    return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False, **kwargs)


def _frames(tokens: int) -> int:
    """Latent frames of a tiny video: 2 when the token count is even, else 1 (any count works)."""
    return 2 if tokens % 2 == 0 else 1


def _factor(n: int) -> int:
    """The largest divisor of n not above sqrt(n): a near-square latent grid with n cells."""
    best = 1
    for d in range(1, int(n**0.5) + 1):
        if n % d == 0:
            best = d
    return best


MODELS: dict[str, tuple[Callable[[int], nn.Module], Callable]] = {
    "flux": (_flux, _flux_inputs),
    "wan": (_wan, _wan_inputs),
    "qwenimage": (_qwenimage, _qwenimage_inputs),
    "ltx": (_ltx, _ltx_inputs),
}


def tiny_model(name: str, *, heads: int = 4, seed: int = 0) -> nn.Module:
    """A tiny random-init diffusers transformer of the named family (identical for the same seed)."""
    if name not in MODELS:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {sorted(MODELS)}.")
    torch.manual_seed(seed)
    return MODELS[name][0](heads)


def tiny_inputs(
    name: str,
    model: nn.Module,
    *,
    batch: int = 2,
    tokens: int = 32,
    text_tokens: int = 8,
    seed: int = 1,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Full inputs for ``tiny_model(name)``: ``tokens`` image/video tokens and ``text_tokens`` text tokens."""
    g = torch.Generator().manual_seed(seed)
    return MODELS[name][1](model, g, batch, tokens, text_tokens, dtype)

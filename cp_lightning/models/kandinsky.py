"""Kandinsky 5: text blocks (self-attention over text), then visual blocks (self-attention over video
tokens, cross-attention to the text), then an output layer on the video grid.

The text blocks run outside the split region, whole on every rank. The video tokens are split at the
first visual block, their RoPE table (B, S, 1, D/2, 2, 2) at every visual block (each gets the root's
full table), and gathered after the *last visual block*: ``fractal_unflatten`` reshapes the full token
sequence back to the (T, H, W) grid before ``out_layer``, so the output layer runs on gathered, replicated
tokens. That needs the engine's gather rule for parameters after a gather.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.wan import _video


def _plan(config) -> dict:
    last = config.num_visual_blocks - 1
    if last == 0:
        # one plan key cannot both split block 0's input and gather its output
        raise ValueError("the Kandinsky 5 plan needs at least 2 visual blocks (num_visual_blocks).")
    return {
        "visual_transformer_blocks.0": {"visual_embed": In(split_dim=1, expected_dims=3)},
        "visual_transformer_blocks.*": {"rope": In(split_dim=1, expected_dims=6)},
        f"visual_transformer_blocks.{last}": Out(gather_dim=1, expected_dims=3),
    }


KANDINSKY5 = PlanEntry(
    "Kandinsky5Transformer3DModel",
    _plan,
    refuse=lambda m: (
        f"attention_type={m.config.attention_type!r} (sparse attention over a local block mask) cannot be split "
        "exactly; use attention_type='regular'."
        if m.config.attention_type != "regular"
        else None
    ),
    needs="gathers with parameters after them",
)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    frames, h, w = _video(tokens)
    cfg = model.config
    p = cfg.patch_size
    return {
        "hidden_states": torch.randn(
            batch, frames * p[0], h * p[1], w * p[2], cfg.in_visual_dim, generator=g, dtype=dtype
        ),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.in_text_dim, generator=g, dtype=dtype),
        "timestep": 1000 * torch.rand(batch, generator=g, dtype=dtype),
        "pooled_projections": torch.randn(batch, cfg.in_text_dim2, generator=g, dtype=dtype),
        "visual_rope_pos": [torch.arange(frames), torch.arange(h), torch.arange(w)],
        "text_rope_pos": torch.arange(text_tokens),
    }


register(
    KANDINSKY5,
    TinyCase(
        "kandinsky5",
        "Kandinsky5Transformer3DModel",
        dict(
            in_visual_dim=4,
            in_text_dim=16,
            in_text_dim2=8,
            time_dim=16,
            out_visual_dim=4,
            patch_size=(1, 2, 2),
            model_dim=32,
            ff_dim=32,
            num_text_blocks=1,
            num_visual_blocks=2,
            axes_dims=(4, 2, 2),
        ),
        _inputs,
        note="output layer after the gather",
    ),
)

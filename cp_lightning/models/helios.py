"""Helios: a Wan-like video transformer with history latents and blocks that need the whole sequence.

Each block splits its tokens into history and current frames by ``original_context_length`` (an int
over the full sequence), so the sequence cannot flow sharded from block to block. diffusers' plan
therefore splits at the input of each block's self-attention, cross-attention and feed-forward, and
gathers right after each: the parameter-free glue between them runs on whole, replicated tokens, as do
``norm_out`` and ``proj_out``. That needs the engine's rule for gathers that are split again and have
parameters after them. diffusers writes the gathers out for ``range(40)`` blocks; here they follow
the config's ``num_layers``.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.wan import _video


def _plan(config) -> dict:
    gather = Out(gather_dim=1, expected_dims=3)
    return {
        "blocks.*.attn1": {
            "hidden_states": In(split_dim=1, expected_dims=3),
            "rotary_emb": In(split_dim=1, expected_dims=3),  # (B, S, D) table of the tokens it rotates
        },
        "blocks.*.attn2": {"hidden_states": In(split_dim=1, expected_dims=3)},  # text keys stay whole
        "blocks.*.ffn": {"hidden_states": In(split_dim=1, expected_dims=3)},
        **{f"blocks.{i}.{part}": gather for i in range(config.num_layers) for part in ("attn1", "attn2", "ffn")},
    }


HELIOS = PlanEntry("HeliosTransformer3DModel", _plan, needs="gathers that are split again, parameters after them")


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    frames, h, w = _video(tokens)
    cfg = model.config
    return {
        "hidden_states": torch.randn(batch, cfg.in_channels, frames, 2 * h, 2 * w, generator=g, dtype=dtype),
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.text_dim, generator=g, dtype=dtype),
    }


register(
    HELIOS,
    TinyCase(
        "helios",
        "HeliosTransformer3DModel",
        dict(
            patch_size=(1, 2, 2),
            num_attention_heads=4,
            attention_head_dim=12,
            in_channels=4,
            out_channels=4,
            text_dim=16,
            freq_dim=16,
            ffn_dim=32,
            num_layers=1,
            rope_dim=(4, 4, 4),
            has_multi_term_memory_patch=False,
        ),
        _inputs,
    ),
)

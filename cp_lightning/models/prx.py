"""PRX (Photoroom): image queries attend to [text, image] keys; the text has no queries and is never updated.

Every block projects keys and values from the same text tensor, which ``forward`` hands to every block. Under CP
the keys must be every text and image token exactly once over the CP group (a text token on every rank would count
cp times in the softmax), so the text is split at every block, with its (B, T) padding mask, from which the
processor builds the [text_r, image_r] key mask from the local lengths. The image tokens are split once, at the
first block, with their RoPE table ((B, 1, S, D/2, 2, 2), built in ``forward`` from the full grid) at every block.
The modulation is per sample; ``final_layer`` is per token and gathered, before the unpatchify reshape.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.hunyuan import _text_mask
from cp_lightning.tiny import _factor

PRX = PlanEntry(
    "PRXTransformer2DModel",
    {
        "blocks.0": {"hidden_states": In(split_dim=1, expected_dims=3)},
        "blocks.*": {
            "encoder_hidden_states": In(split_dim=1, expected_dims=3),  # keys and values only, split at every block
            "attention_mask": In(split_dim=1, expected_dims=2),  # (B, T) text padding, split with the text
            "image_rotary_emb": In(split_dim=2, expected_dims=6),
        },
        "final_layer": Out(gather_dim=1, expected_dims=3),
    },
)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    h, p = _factor(tokens), cfg.patch_size
    return {
        "hidden_states": torch.randn(batch, cfg.in_channels, p * h, p * (tokens // h), generator=g, dtype=dtype),
        "timestep": torch.rand(batch, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.context_in_dim, generator=g, dtype=dtype),
        "attention_mask": _text_mask(batch, text_tokens).bool(),
    }


register(
    PRX,
    TinyCase(
        "prx",
        "PRXTransformer2DModel",
        dict(
            in_channels=4,
            patch_size=2,
            context_in_dim=16,
            hidden_size=32,
            mlp_ratio=2.0,
            num_heads=4,
            depth=1,
            axes_dim=[4, 4],
            resolution_embeds=True,  # PRX-7B's resolution conditioning
        ),
        _inputs,
        note="text as keys and values only, split at every block; text padded per sample",
    ),
)

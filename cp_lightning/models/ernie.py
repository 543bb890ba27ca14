"""ERNIE-Image: one single-stream sequence [image, text], sequence-first (S, B, C), with per-token modulation.

``forward`` concatenates the image and text tokens into one (S, B, C) sequence and builds, over that whole
sequence, the RoPE table (B, S, 1, D) (text positions shifted by each sample's text length), the (B, 1, 1, S) key
mask of the padded text, and the six modulation tensors, which it expands per token to (S, B, C). All of them are
handed to every layer. So the sequence is split once, along dim 0, where it enters the first layer, and the RoPE
table, the mask and the six modulation tensors (whose gradient flows back through the split into
``adaLN_modulation``) at every layer. ``final_norm``/``final_linear`` are per token; the output is gathered after
``final_linear``, before ``forward`` cuts the image tokens out of it by full lengths (``loss_parallel`` is refused
for that reason). The stock processor calls diffusers' dispatcher with its ``_parallel_config``.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.tiny import _factor

_SEQUENCE = In(split_dim=0, expected_dims=3)  # (S, B, C): the sequence leads


ERNIE_PLAN = {
    "layers.0": {"x": _SEQUENCE},  # the [image, text] sequence, then sharded from layer to layer
    "layers.*": {
        "rotary_pos_emb": In(split_dim=1, expected_dims=4),  # (B, S, 1, D)
        "temb": _SEQUENCE,  # a list of six (S, B, C) modulation tensors
        "attention_mask": In(split_dim=3, expected_dims=4),  # (B, 1, 1, S) key mask of the padded text
    },
    "final_linear": Out(gather_dim=0, expected_dims=3),
}


ERNIE = PlanEntry(
    "ErnieImageTransformer2DModel",
    ERNIE_PLAN,
    loss_parallel="its forward cuts the image tokens out of the gathered [image, text] sequence by full lengths",
)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    h, p = _factor(tokens), cfg.patch_size
    lengths = torch.tensor([text_tokens - 2 * i for i in range(batch)])  # padded text: shorter prompts after the first
    return {
        "hidden_states": torch.randn(batch, cfg.in_channels, p * h, p * (tokens // h), generator=g, dtype=dtype),
        "timestep": 1000 * torch.rand(batch, generator=g, dtype=dtype),
        "text_bth": torch.randn(batch, text_tokens, cfg.text_in_dim, generator=g, dtype=dtype),
        "text_lens": lengths,
    }


register(
    ERNIE,
    TinyCase(
        "ernie-image",
        "ErnieImageTransformer2DModel",
        dict(
            hidden_size=32,
            num_attention_heads=4,
            num_layers=1,
            ffn_hidden_size=64,
            in_channels=4,
            out_channels=4,
            patch_size=2,
            text_in_dim=16,
            rope_axes_dim=(2, 2, 4),
        ),
        _inputs,
        note="sequence-first layout, per-token modulation, text padded per sample",
    ),
)

"""Sana and Sana-Video: linear self-attention, softmax cross-attention to the text, a convolutional feed-forward.

Self-attention (``attn1``) is ReLU linear attention: split at its input and gathered at its output, it runs
as cp_lightning.linear_attention (each rank's key sums, one all-reduce of the state, its own queries). The
cross-attention (``attn2``) is softmax attention to the text: its queries are split, the text stays whole on
every rank (routing.py runs it locally, no communication), and its output is gathered. The feed-forward
(``GLUMBConv``, Sana-Video's ``GLUMBTempConv``) is not per token: a 3x3 depthwise convolution over the
(H, W) grid (and, for Sana-Video, a 3-tap one over frames) reads neighbouring rows, and the block reshapes
the whole sequence to the grid first. So the sequence cannot stay sharded from block to block: the glue,
the feed-forward, ``norm_out`` and ``proj_out`` run on whole, replicated tokens, as in Helios's plan. That
needs the engine's rule for gathers that are split again and have parameters after them. Sana-Video's RoPE
tables, (1, S, 1, D) cos and sin passed to each block, are split at the block with the tokens they rotate.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.wan import _video
from cp_lightning.tiny import _factor


def _plan(config, rope: bool = False) -> dict:
    gather = Out(gather_dim=1, expected_dims=3)
    parts = ("attn1", "attn2") if config.cross_attention_dim is not None else ("attn1",)
    plan = {f"transformer_blocks.*.{part}": {"hidden_states": In(split_dim=1, expected_dims=3)} for part in parts}
    if rope:
        plan["transformer_blocks.*"] = {"rotary_emb": In(split_dim=1, expected_dims=4)}  # both (cos, sin)
    plan.update({f"transformer_blocks.{i}.{part}": gather for i in range(config.num_layers) for part in parts})
    return plan


_NEEDS = "linear attention (all-reduced key state); gathers that are split again, parameters after them"
SANA = PlanEntry("SanaTransformer2DModel", _plan, needs=_NEEDS)
SANA_VIDEO = PlanEntry("SanaVideoTransformer3DModel", lambda config: _plan(config, rope=True), needs=_NEEDS)


def _text(model, g, batch, text_tokens, dtype):
    # the second sample's last two text tokens are padding: the cross-attention's key mask
    mask = torch.ones(batch, text_tokens)
    mask[1:, -2:] = 0
    text = (batch, text_tokens, model.config.caption_channels)
    return {
        "encoder_hidden_states": torch.randn(text, generator=g, dtype=dtype),
        "encoder_attention_mask": mask.to(dtype),
        "timestep": 1000 * torch.rand(batch, generator=g, dtype=dtype),
    }


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    h, p = _factor(tokens), model.config.patch_size
    shape = (batch, model.config.in_channels, p * h, p * (tokens // h))
    return {"hidden_states": torch.randn(shape, generator=g, dtype=dtype), **_text(model, g, batch, text_tokens, dtype)}


def _video_inputs(model, g, batch, tokens, text_tokens, dtype):
    frames, h, w = _video(tokens)
    pt, ph, pw = model.config.patch_size
    shape = (batch, model.config.in_channels, pt * frames, ph * h, pw * w)
    return {"hidden_states": torch.randn(shape, generator=g, dtype=dtype), **_text(model, g, batch, text_tokens, dtype)}


_CONFIG = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=8,
    num_layers=2,
    num_cross_attention_heads=4,  # the softmax cross-attention: at least the Ulysses degree (4)
    cross_attention_head_dim=4,
    cross_attention_dim=16,  # the caption projection's width, = heads x head dim
    caption_channels=12,
    mlp_ratio=2.0,
    sample_size=8,
)

register(
    SANA,
    SANA_VIDEO,
    TinyCase("sana", "SanaTransformer2DModel", _CONFIG, _inputs, note="linear attention, text key mask"),
    TinyCase(
        "sana-video",
        "SanaVideoTransformer3DModel",
        dict(_CONFIG, attention_head_dim=12, cross_attention_head_dim=6, cross_attention_dim=24),
        _video_inputs,
        note="linear attention with RoPE, text key mask",
    ),
)

"""HunyuanVideo and HunyuanVideo-1.5: dual-stream then single-stream blocks over [video, text] tokens.

The text first runs through a token refiner, outside the split region and whole on every rank (its
attention keeps its own processor, with no CP communication). Video and text tokens are then split
apart at the first block and meet in every block's joint attention, so both streams carry their
shard, the RoPE tables (video only) are split after ``rope``, and the video stream is gathered after
``proj_out`` (the last block's text output is dropped, as in one process).
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.wan import _video
from cp_lightning.plan import JointInput

_STREAMS = {
    "hidden_states": In(split_dim=1, expected_dims=3),
    "encoder_hidden_states": In(split_dim=1, expected_dims=3),
}
# rope returns (S, D) cos/sin tables for the video tokens: split with them
_ROPE = {0: In(split_dim=0, expected_dims=2, split_output=True), 1: In(split_dim=0, expected_dims=2, split_output=True)}

# HunyuanVideo builds one (B, 1, 1, S + T) key mask over [video, text] in forward, from the full lengths
# (text padding differs per sample), and hands it to every block. Split as one tensor, rank r would get
# the r-th chunk of [video, text]; as a JointInput each rank gets [video_r, text_r], the keys it holds.
_JOINT_MASK = {"attention_mask": JointInput(split_dim=3, expected_dims=4, segments=tuple(_STREAMS))}
HUNYUAN_VIDEO = PlanEntry(
    "HunyuanVideoTransformer3DModel",
    {
        "rope": _ROPE,
        "transformer_blocks.0": _STREAMS,  # before the mask entry: it records the streams' full lengths
        "transformer_blocks.*": _JOINT_MASK,
        "single_transformer_blocks.*": _JOINT_MASK,
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
    needs="unsplit modules keep their own processors (the token refiner)",
)

# HunyuanVideo-1.5 passes every block the (B, T) text mask and builds the joint mask inside attention from
# the local lengths: [ones for local video, local text mask], as an outer product (B, 1, S, S) of that key
# vector. So the text mask is split with the text, and the outer product is collapsed to the key mask by
# the engine (checked, not assumed).
HUNYUAN_VIDEO_15 = PlanEntry(
    "HunyuanVideo15Transformer3DModel",
    {
        "rope": _ROPE,
        "transformer_blocks.0": _STREAMS,
        "transformer_blocks.*": {"attention_mask": In(split_dim=1, expected_dims=2)},
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
    needs="unsplit modules keep their own processors; outer-product masks collapsed to key masks",
)


def _text_mask(batch: int, text_tokens: int) -> torch.Tensor:
    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    for i in range(1, batch):  # each sample after the first has more text padding
        mask[i, max(1, text_tokens - 2 * i - 1) :] = 0
    return mask


def _hv_inputs(model, g, batch, tokens, text_tokens, dtype):
    frames, h, w = _video(tokens)
    cfg = model.config
    return {
        "hidden_states": torch.randn(batch, cfg.in_channels, frames, 2 * h, 2 * w, generator=g, dtype=dtype),
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.text_embed_dim, generator=g, dtype=dtype),
        "encoder_attention_mask": _text_mask(batch, text_tokens),
        "pooled_projections": torch.randn(batch, cfg.pooled_projection_dim, generator=g, dtype=dtype),
        "guidance": torch.full((batch,), 6000.0, dtype=dtype),
    }


def _hv15_inputs(model, g, batch, tokens, text_tokens, dtype):
    frames, h, w = _video(tokens)
    cfg = model.config
    return {
        "hidden_states": torch.randn(batch, cfg.in_channels, frames, h, w, generator=g, dtype=dtype),
        "timestep": 1000 * torch.rand(batch, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.text_embed_dim, generator=g, dtype=dtype),
        "encoder_attention_mask": _text_mask(batch, text_tokens),
        "encoder_hidden_states_2": torch.randn(batch, 3, cfg.text_embed_2_dim, generator=g, dtype=dtype),
        "encoder_attention_mask_2": _text_mask(batch, 3),
        "image_embeds": torch.zeros(batch, 2, cfg.image_embed_dim, dtype=dtype),  # T2V: zero image tokens
    }


# HunyuanVideo's tiny config, shared with HunyuanVideo-Framepack's (framepack.py)
HUNYUAN_TINY = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=4,
    attention_head_dim=16,
    num_layers=1,
    num_single_layers=1,
    num_refiner_layers=1,
    text_embed_dim=16,
    pooled_projection_dim=8,
    rope_axes_dim=(4, 6, 6),
)

register(
    HUNYUAN_VIDEO,
    HUNYUAN_VIDEO_15,
    TinyCase(
        "hunyuanvideo",
        "HunyuanVideoTransformer3DModel",
        HUNYUAN_TINY,
        _hv_inputs,
        note="T2V, text padded differently per sample",
    ),
    TinyCase(
        "hunyuanvideo-1.5",
        "HunyuanVideo15Transformer3DModel",
        dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=4,
            attention_head_dim=16,
            num_layers=1,
            num_refiner_layers=1,
            text_embed_dim=16,
            text_embed_2_dim=8,
            image_embed_dim=8,
            rope_axes_dim=(4, 6, 6),
            task_type="t2v",
        ),
        _hv15_inputs,
        # T2V multiplies the image tokens by 0; with one block, its text output (and the text-only layers
        # that make it) is dropped
        unused=(
            "image_embedder",
            "transformer_blocks.0.attn.add_q_proj",
            "transformer_blocks.0.attn.norm_added_q",
            "transformer_blocks.0.attn.to_add_out",
            "transformer_blocks.0.ff_context",
        ),
        note="T2V, text padded differently per sample (outer-product mask)",
    ),
)

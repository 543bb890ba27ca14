"""Kandinsky 6 (text + image to video and audio) and its super-resolution model.

Kandinsky 6 encodes the text with its own blocks first (video and audio text towers), before any split: they
attend locally on every rank. The fused visual blocks then run video self-attention, video-to-text
cross-attention, audio self-attention, audio-to-text cross-attention and the two audio-video cross-attentions.
The video tokens are split at the first visual block and their RoPE table ((S, 1, D, 2, 2), computed in
``forward`` from the whole grid) at every block; the text and the audio (a few hundred tokens) stay whole on
every rank, as LTX-2's audio: attention with whole keys runs over the cp copies of them (exact: each rank's
copy gets its share of the gradient), and the audio output, replicated, is never gathered (the engine's rule
for outputs outside a gather). ``forward`` reshapes the video back to its (T, H, W) grid after the blocks,
so the video is gathered at the last visual block's output and ``out_layer`` runs on whole tokens.

Kandinsky 6 SR is refused: its NABLA attention builds a FlexAttention block mask from the whole sequence's
block-mean attention map (top-p blocks per query block) plus a sliding-tile window, a data-dependent mask with
one row per query block.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.hunyuan import _text_mask
from cp_lightning.models.wan import _video

_VIDEO = {"vis": In(split_dim=1, expected_dims=3)}
_ROPE = {"vis_rope": In(split_dim=0, expected_dims=5)}  # (S, 1, D, 2, 2) rotation matrices, one per video token


def _plan(config) -> dict:
    last = config.num_visual_blocks - 1
    # a last block that is also the first takes its split through '*' (one key cannot both split and gather)
    blocks = {"visual_transformer_blocks.0": _VIDEO, "visual_transformer_blocks.*": _ROPE}
    if last == 0:
        blocks = {"visual_transformer_blocks.*": {**_VIDEO, **_ROPE}}
    # (video, audio) out of the last block: the video gathered, the whole audio passed on as it is
    return {**blocks, f"visual_transformer_blocks.{last}": [Out(gather_dim=1, expected_dims=3), None]}


KANDINSKY6 = PlanEntry(
    "Kandinsky6Transformer3DModel",
    _plan,
    needs="gathers with parameters after them (outputs outside a gather: the audio stream)",
    loss_parallel="its forward reshapes the last block's video output to the whole (T, H, W) grid",
)

SR_REASON = (
    "Kandinsky 6 SR's NABLA sparse attention builds a FlexAttention block mask from the whole sequence's "
    "block-mean attention map (the top-p key blocks of each query block) and a sliding-tile window: a "
    "data-dependent mask with one row per query block, which context parallelism cannot split yet (masks under "
    "CP are being built). Train it without CP for now."
)
KANDINSKY6_SR = PlanEntry("Kandinsky6SRTransformer3DModel", None, refuse=lambda _model: SR_REASON)

AUDIO_TOKENS = 5


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    frames, h, w = _video(tokens)
    cfg = model.config
    _, ph, pw = cfg.patch_size
    channels = 2 * cfg.in_visual_dim + 1 if cfg.visual_cond else cfg.in_visual_dim
    return {
        "hidden_states": torch.randn(batch, frames, ph * h, pw * w, channels, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.in_text_dim, generator=g, dtype=dtype),
        "pooled_projections": torch.randn(batch, cfg.in_text_dim2, generator=g, dtype=dtype),
        "timestep": 1000 * torch.rand(batch, generator=g, dtype=dtype),
        "audio_hidden_states": torch.randn(batch, AUDIO_TOKENS, cfg.in_audio_dim, generator=g, dtype=dtype),
        "encoder_attention_mask": _text_mask(batch, text_tokens).bool(),
    }


register(
    KANDINSKY6,
    KANDINSKY6_SR,
    TinyCase(
        "kandinsky6",
        "Kandinsky6Transformer3DModel",
        dict(
            in_visual_dim=4,
            out_visual_dim=4,
            in_text_dim=16,
            in_text_dim2=8,
            time_dim=16,
            model_dim=48,  # 4 heads of sum(axes_dims) = 12
            ff_dim=32,
            num_text_blocks=1,
            num_visual_blocks=2,
            axes_dims=(4, 4, 4),
            in_audio_dim=4,
            out_audio_dim=4,
            ca_rope=True,  # the audio-video cross-attentions rotate with both streams' RoPE
        ),
        _inputs,
        note="audio + video outputs in the loss, text padded per sample",
    ),
)

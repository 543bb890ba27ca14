"""Sana-WM (a camera-controlled world model) and its LTX-2 refiner.

Sana-WM is refused: its linear-attention blocks are Gated DeltaNet (``torch_chunk_sana_gdn``): bidirectional
chunked delta-rule scans over the frames, whose state after each token is a sequential, non-additive function
of the tokens before it (the delta rule subtracts the state's own prediction, and decays gate it frame by
frame). Unlike Sana's ReLU linear attention, whose key sums add up over the ranks, it would need a scan that
passes the state from rank to rank, which cp_lightning lacks.

The refiner (``SanaWMLTX2RefinerTransformer3DModel``) is an LTX-2-style video DiT (its audio modules are built
but never run by its ``forward``). Everything outside attention is per token, with per-token timestep
embeddings when ``timestep`` is (B, S) (conditioning frames at t = 0) and a per-token RoPE (cos, sin) passed in
by the pipeline, so video tokens, timesteps and RoPE are split at the model's input and the output is gathered
after ``proj_out``; the text stays whole on every rank. Its key-value cache modes (inference: cached sink and
history keys prepended to every rank's keys) are not for training and are not supported under CP. The class
has no gradient checkpointing, so its checkpointed parity rows run without it.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.ltx import LTX2_TINY
from cp_lightning.models.wan import _video

SANA_WM_REASON = (
    "Sana-WM's linear attention is Gated DeltaNet: bidirectional delta-rule scans over the frames, whose state is a "
    "sequential, non-additive function of the earlier (and, backwards, later) tokens, so no rank can compute its "
    "tokens' outputs from its own keys and a summed state (as for Sana's linear attention); exact context "
    "parallelism would need a state-passing scan across ranks, which cp_lightning does not have. Train it without CP."
)
SANA_WM = PlanEntry("SanaWMTransformer3DModel", None, refuse=lambda _model: SANA_WM_REASON)


def _refiner_plan(config) -> dict:
    # interleaved RoPE: (B, S, C) cos and sin; split RoPE: (B, H, S, D / 2)
    rope = In(split_dim=1, expected_dims=3) if config.rope_type == "interleaved" else In(split_dim=2, expected_dims=4)
    return {
        "": {
            "hidden_states": In(split_dim=1, expected_dims=3),
            "timestep": In(split_dim=1, expected_dims=2),  # per token when (B, S); a (B,) timestep passes whole
            "video_rotary_emb": rope,  # both tables
        },
        "proj_out": Out(gather_dim=1, expected_dims=3),
    }


REFINER = PlanEntry("SanaWMLTX2RefinerTransformer3DModel", _refiner_plan)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    frames, h, w = _video(tokens)
    cfg = model.config
    t = torch.rand(batch, generator=g, dtype=dtype)[:, None].expand(batch, tokens).clone()
    t[:, : h * w] = 0  # the first latent frame is a clean conditioning frame
    mask = torch.ones(batch, text_tokens)
    mask[1:, -2:] = 0
    rope = model.build_rotary_emb_for_absolute_positions(batch, list(range(frames)), h, w, torch.device("cpu"), 24.0)
    return {
        "hidden_states": torch.randn(batch, tokens, cfg.in_channels, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.caption_channels, generator=g, dtype=dtype),
        "timestep": t,
        "video_rotary_emb": tuple(table.to(dtype) for table in rope),
        "encoder_attention_mask": mask,
    }


# built by the class, never run by its forward (the audio stream of the LTX-2 block it reuses)
_AUDIO = ("audio_", "av_cross_attn_", "transformer_blocks.0.audio_", "transformer_blocks.0.video_")

register(
    SANA_WM,
    REFINER,
    TinyCase(
        "sana-wm-refiner",
        "SanaWMLTX2RefinerTransformer3DModel",
        LTX2_TINY,
        _inputs,
        unused=_AUDIO,
        note="per-token timesteps (first frame clean), text padded per sample",
    ),
)

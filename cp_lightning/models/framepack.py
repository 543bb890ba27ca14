"""HunyuanVideo-Framepack: HunyuanVideo's blocks over [history + video, image + text] tokens.

``forward`` patch-embeds the noisy window and the clean, 2x and 4x history latents (each with its own
convolution), computes a RoPE table for each from its frame indices (``rope`` runs once per part, so its
outputs cannot be split as they leave it) and concatenates [4x, 2x, clean, noisy] tokens and tables. The
image (SigLIP) tokens are concatenated to the refined text, and one (B, 1, 1, S + T) key mask is built from
the full lengths. So, as for HunyuanVideo, the two streams are split at the first block, the joint mask as a
``JointInput`` (rank r holds [video_r, text_r]) and the (S, D) RoPE tables at every block with the tokens they
rotate. After the last block ``forward`` keeps the last ``original_context_length`` tokens (the noisy window)
of the whole sequence: the video stream is gathered at the last block's output (its text output is dropped)
and ``norm_out`` / ``proj_out`` run on whole tokens. The token refiner runs before the split, locally.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.hunyuan import HUNYUAN_TINY, _text_mask
from cp_lightning.models.wan import _video
from cp_lightning.plan import JointInput

_STREAMS = {
    "hidden_states": In(split_dim=1, expected_dims=3),
    "encoder_hidden_states": In(split_dim=1, expected_dims=3),
}
_MASK = JointInput(split_dim=3, expected_dims=4, segments=tuple(_STREAMS))
_ROPE = In(split_dim=0, expected_dims=2)  # (S, D) cos and sin over [history, video]; the blocks name it differently


def _plan(config) -> dict:
    if config.num_single_layers:
        last = f"single_transformer_blocks.{config.num_single_layers - 1}"
    else:
        last = f"transformer_blocks.{config.num_layers - 1}"
    return {
        "transformer_blocks.0": _STREAMS,  # before the mask entries: it records the streams' full lengths
        "transformer_blocks.*": {"attention_mask": _MASK, "freqs_cis": _ROPE},
        "single_transformer_blocks.*": {"attention_mask": _MASK, "image_rotary_emb": _ROPE},
        last: [Out(gather_dim=1, expected_dims=3), None],  # forward slices the noisy window off whole tokens
    }


FRAMEPACK = PlanEntry(
    "HunyuanVideoFramepackTransformer3DModel",
    _plan,
    needs="unsplit modules keep their own processors (the token refiner); gathers with parameters after them",
    loss_parallel="its forward keeps the last tokens of the gathered sequence (the noisy window) by the full length",
)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    frames, h, w = _video(tokens)
    cfg = model.config
    shape = (cfg.in_channels, 2 * h, 2 * w)

    def latents(n):
        return torch.randn(batch, shape[0], n, *shape[1:], generator=g, dtype=dtype)

    # frame indices as the pipeline lays them out: [prefix, 4x history, 2x history, 1x history, window]
    index = torch.arange(1 + 4 + 1 + 1 + frames)
    prefix, four, two, one, window = index.split([1, 4, 1, 1, frames])
    return {
        "hidden_states": latents(frames),
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.text_embed_dim, generator=g, dtype=dtype),
        "encoder_attention_mask": _text_mask(batch, text_tokens),
        "pooled_projections": torch.randn(batch, cfg.pooled_projection_dim, generator=g, dtype=dtype),
        "image_embeds": torch.randn(batch, 2, cfg.image_proj_dim, generator=g, dtype=dtype),
        "indices_latents": window,
        "guidance": torch.full((batch,), 6000.0, dtype=dtype),
        "latents_clean": latents(2),  # the start image and the last clean frame
        "indices_latents_clean": torch.cat([prefix, one]),
        "latents_history_2x": latents(1),
        "indices_latents_history_2x": two,
        "latents_history_4x": latents(4),
        "indices_latents_history_4x": four,
    }


register(
    FRAMEPACK,
    TinyCase(
        "hunyuanvideo-framepack",
        "HunyuanVideoFramepackTransformer3DModel",
        dict(
            HUNYUAN_TINY,
            image_proj_dim=8,
            has_image_proj=True,
            has_clean_x_embedder=True,
        ),
        _inputs,
        note="clean, 2x and 4x history tokens, image tokens, text padded per sample",
    ),
)

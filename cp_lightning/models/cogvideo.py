"""CogVideoX and ConsisID: joint [text, video] attention whose stock processor calls SDPA itself.

Both embed text and video together (``patch_embed``, with any sin-cos positions added to the whole joint
sequence), then cut them apart in ``forward``; every block runs one joint attention over [text, video]
(``CogVideoXAttnProcessor2_0``, SDPA-direct, routed by cp_lightning) and a feed-forward over the same
concatenation, per token. So text and video are split apart at the first block and both stay sharded: the
joint attention sees [text_r, video_r] on rank r, a permutation of the keys that softmax does not notice.
The RoPE tables (one row per video token, an input of ``forward`` computed by the pipeline) are split at every
block with the video tokens they rotate; the processor rotates the video part of the rank's joint sequence,
found by the local text length.

ConsisID adds a face path: ``local_facial_extractor`` runs before the split on whole inputs, and a
``perceiver_cross_attention`` after every ``cross_attn_interval``-th block lets each video token attend to the
face tokens (whole on every rank, plain matmuls with no processor), per token. After the blocks its
``forward`` concatenates [text, video], normalises and cuts the text off by the *full* text length, so both
streams are gathered at the last block's output and ``norm_final`` / ``norm_out`` / ``proj_out`` run on
whole tokens (the engine's gather rule keeps their gradients exact).
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out
from diffusers.models.embeddings import get_3d_rotary_pos_embed

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.wan import _video

_STREAMS = {
    "hidden_states": In(split_dim=1, expected_dims=3),
    "encoder_hidden_states": In(split_dim=1, expected_dims=3),  # text: a joint-attention stream, split too
}
# (S, D) cos and sin, one row per video token: split at every block (each gets the root's whole tables)
_ROPE = {"image_rotary_emb": In(split_dim=0, expected_dims=2)}

COGVIDEOX = PlanEntry(
    "CogVideoXTransformer3DModel",
    {
        "transformer_blocks.0": _STREAMS,
        "transformer_blocks.*": _ROPE,
        # norm_final, norm_out (per-sample modulation) and proj_out are per token: gathered after them, before
        # the unpatchify reshape; the last block's text output is dropped, as in one process
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
    needs="an SDPA-direct processor routed by cp_lightning",
)


def _consisid_plan(config) -> dict:
    last = config.num_layers - 1
    plan = {
        "transformer_blocks.*": _ROPE,
        # video and text gathered where the blocks end: forward cuts the text off by its full length after
        # norm_final; a last block that is also the first splits through '*' (one key cannot split and gather)
        f"transformer_blocks.{last}": [Out(gather_dim=1, expected_dims=3), Out(gather_dim=1, expected_dims=3)],
    }
    if last == 0:
        plan["transformer_blocks.*"] = {**_STREAMS, **_ROPE}
    else:
        plan = {"transformer_blocks.0": _STREAMS, **plan}
    return plan


CONSISID = PlanEntry(
    "ConsisIDTransformer3DModel",
    _consisid_plan,
    needs="an SDPA-direct processor routed by cp_lightning; gathers with parameters after them",
    loss_parallel="its forward cuts the text off the gathered [text, video] sequence by the full text length",
)


def _rope(model, frames: int, h: int, w: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline's CogVideoX 1.0 RoPE for an (h, w) latent grid after patching: (S, D) cos and sin."""
    cos, sin = get_3d_rotary_pos_embed(
        embed_dim=model.config.attention_head_dim, crops_coords=((0, 0), (h, w)), grid_size=(h, w), temporal_size=frames
    )
    return cos.to(dtype), sin.to(dtype)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    frames, h, w = _video(tokens)
    cfg = model.config
    p = cfg.patch_size
    return {
        "hidden_states": torch.randn(batch, frames, cfg.in_channels, p * h, p * w, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.text_embed_dim, generator=g, dtype=dtype),
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
        "image_rotary_emb": _rope(model, frames, h, w, dtype),
    }


def _consisid_inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    out = _inputs(model, g, batch, tokens, text_tokens, dtype)
    out["id_cond"] = torch.randn(batch, cfg.LFE_id_dim, generator=g, dtype=dtype)  # the face embedding
    vit = (batch, 5, cfg.LFE_vit_dim)  # one ViT hidden state of 5 tokens per scale
    out["id_vit_hidden"] = [torch.randn(vit, generator=g, dtype=dtype) for _ in range(cfg.LFE_num_scale)]
    return out


_COG = dict(
    num_attention_heads=4,
    attention_head_dim=16,  # the 3-D RoPE takes D/4 for time and 3D/8 for each spatial axis
    in_channels=4,
    out_channels=4,
    time_embed_dim=16,
    text_embed_dim=16,
    num_layers=1,
    use_rotary_positional_embeddings=True,
    sample_width=8,
    sample_height=8,
    sample_frames=5,
)

register(
    COGVIDEOX,
    CONSISID,
    TinyCase("cogvideox", "CogVideoXTransformer3DModel", _COG, _inputs, note="RoPE (CogVideoX-5B layout)"),
    TinyCase(
        "consisid",
        "ConsisIDTransformer3DModel",
        dict(
            _COG,
            num_layers=2,  # face cross-attention after block 0 (interval 2), on split tokens
            is_train_face=True,
            cross_attn_interval=2,
            cross_attn_dim_head=8,
            cross_attn_num_heads=4,
            LFE_id_dim=8,
            LFE_vit_dim=16,
            LFE_depth=1,
            LFE_dim_head=4,
            LFE_num_heads=4,
            LFE_num_id_token=2,
            LFE_num_querie=3,
            LFE_output_dim=42,  # the face tokens' width: 2/3 of the model width (64)
            LFE_ff_mult=2,
            LFE_num_scale=1,
        ),
        _consisid_inputs,
        note="face tokens: the extractor whole, the perceiver cross-attention per video token",
    ),
)

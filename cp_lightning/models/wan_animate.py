"""Wan-Animate (character animation on Wan 2.1 I2V) and Wan-Animate 2.

Wan-Animate is Wan with two conditions. The pose latents are patch-embedded and added to the video tokens
before the first block, and the face video becomes per-frame motion tokens (``motion_encoder``,
``face_encoder``) before the split, whole on every rank; both need no plan of their own, so Wan's plan is
kept (RoPE tables after ``rope``, video tokens at the first block, gathered after ``proj_out``; the text and
CLIP image tokens stay whole). After every ``inject_face_latents_blocks``-th block a face adapter lets each
video token attend to *its own frame's* motion tokens: the stock processor reshapes the whole sequence to
(frames, tokens per frame), which a shard cannot do (its tokens start mid-frame). Its stand-in
(:class:`WanAnimateFaceAttention`, routing.py's ``STAND_INS``) finds where the rank's tokens sit in the whole
sequence (``routing.shard_span``) and attends each run of them to its frame's keys, which every rank holds.
It is a per-token operation: no CP attention, no gather.

Wan-Animate 2 is refused: it trains in two passes, a reference pass that stores each layer's keys and values
and a generation pass that attends through a FlexAttention block mask over [generation, reference] (each
generated frame sees the whole generation and its own reference frame), a mask with one row per query; its
RoPE is also applied inside attention from the grid sizes of the whole sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_wan_animate import _get_qkv_projections

from cp_lightning import routing
from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.wan import _I2V, WAN_LIKE_PLAN, _wan_config


class WanAnimateFaceAttention(routing.StandIn):
    """``WanAnimateFaceBlockAttnProcessor``'s stand-in: each local video token attends to its frame's motion tokens."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        if not self.runs_cp():
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask)
        if attention_mask is not None:  # the model never passes one; a per-token mask would need splitting too
            raise ValueError("Wan-Animate's face attention under context parallelism takes no attention_mask.")
        hidden_states = attn.pre_norm_q(hidden_states)
        motion = attn.pre_norm_kv(encoder_hidden_states)
        batch, frames, per_frame_keys, _ = motion.shape  # B, T, N, C: N motion tokens for each latent frame
        query, key, value = _get_qkv_projections(attn, hidden_states, motion.flatten(1, 2))
        query = attn.norm_q(query.unflatten(2, (attn.heads, -1)))  # B, S_local, H, D
        key = attn.norm_k(key.view(batch, frames, per_frame_keys, attn.heads, -1))  # B, T, N, H, D
        value = value.view(batch, frames, per_frame_keys, attn.heads, -1)
        offset, total = routing.shard_span(hidden_states, 1)
        tokens_per_frame = total // frames
        start, end, outs = offset, offset + query.shape[1], []
        # the local tokens run over whole frames and a partial one at each end: one attention per frame
        for frame in range(start // tokens_per_frame, (end - 1) // tokens_per_frame + 1):
            lo, hi = max(start, frame * tokens_per_frame), min(end, (frame + 1) * tokens_per_frame)
            q = query[:, lo - offset : hi - offset].transpose(1, 2)  # B, H, n, D
            out = F.scaled_dot_product_attention(q, key[:, frame].transpose(1, 2), value[:, frame].transpose(1, 2))
            outs.append(out.transpose(1, 2))  # B, n, H, D
        hidden_states = torch.cat(outs, dim=1).flatten(2, 3).type_as(query)
        return attn.to_out(hidden_states)

    def __repr__(self) -> str:
        return f"WanAnimateFaceAttention({type(self.original).__name__})"


routing.STAND_INS["WanAnimateFaceBlockAttnProcessor"] = WanAnimateFaceAttention

# Wan's plan: the face adapters need none of their own (their stand-in reads the shard's place)
WAN_ANIMATE = PlanEntry(
    "WanAnimateTransformer3DModel",
    WAN_LIKE_PLAN,
    needs="a stand-in processor (per-frame face attention on a shard that starts mid-frame)",
)

ANIMATE2_REASON = (
    "Wan-Animate 2's generation pass attends through a FlexAttention block mask over [generation, reference] "
    "tokens (each generated frame sees the generation and its own reference frame), a mask with one row per query "
    "that context parallelism cannot split yet (masks under CP are being built); it also rotates queries and keys "
    "inside attention from the whole sequence's grid sizes, and its reference pass caches every layer's keys and "
    "values. Train it without CP for now."
)
WAN_ANIMATE2 = PlanEntry("WanAnimate2Transformer3DModel", None, refuse=lambda _model: ANIMATE2_REASON)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    frames = next(d for d in range(2, tokens + 1) if tokens % d == 0)  # >= 2 latent frames: the pose skips one
    w = tokens // frames
    latent = cfg.latent_channels
    size = cfg.motion_encoder_size
    face_frames = 4 * frames - 7  # the face encoder's two stride-2 convolutions give frames - 1 motion frames
    return {
        "hidden_states": torch.randn(batch, cfg.in_channels, frames, 2, 2 * w, generator=g, dtype=dtype),
        "pose_hidden_states": torch.randn(batch, latent, frames - 1, 2, 2 * w, generator=g, dtype=dtype),
        "face_pixel_values": torch.randn(batch, 3, face_frames, size, size, generator=g, dtype=dtype),
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
        "encoder_hidden_states": torch.randn(batch, 512, cfg.text_dim, generator=g, dtype=dtype),
        "encoder_hidden_states_image": torch.randn(batch, 5, cfg.image_dim, generator=g, dtype=dtype),
    }


register(
    WAN_ANIMATE,
    WAN_ANIMATE2,
    TinyCase(
        "wan-animate",
        "WanAnimateTransformer3DModel",
        _wan_config(
            **_I2V,
            in_channels=12,  # 2 x 4 latent channels + 4 mask channels
            latent_channels=4,
            motion_encoder_channel_sizes={"8": 8, "4": 8},
            motion_encoder_size=8,
            motion_style_dim=8,
            motion_dim=4,
            motion_encoder_dim=8,
            face_encoder_hidden_dim=8,
            face_encoder_num_heads=4,
            inject_face_latents_blocks=1,
        ),
        _inputs,
        text_tokens=512,  # Wan's I2V processor takes the last 512 context tokens as text
        note="pose and per-frame face motion tokens (stand-in for the per-frame face attention)",
    ),
)

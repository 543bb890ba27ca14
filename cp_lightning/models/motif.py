"""Motif-Video: HunyuanVideo-style dual- then single-stream blocks over [video, image + text], a decoder tail.

``forward`` concatenates the SigLIP image tokens (image-to-video) in front of the projected text and builds one
(B, 1, 1, S + T) key mask over [video, image + text] from the full lengths. Video and conditioning tokens meet
in every block's joint attention (dispatch processor), so both streams are split at the first block, the mask
as a ``JointInput`` (rank r holds [video_r, cond_r]) and the (S, D) RoPE tables after ``rope``. The last
``num_decoder_layers`` single blocks attend over [a copy of the embedded video taken before the blocks, the
encoder's video output]: that copy is whole, so it is split where the decoder starts. The video is gathered
after ``proj_out`` (``norm_out`` is per token, modulated per sample).

The optional text cross-attention (after each block's joint attention) takes the text keys as the conditioning
stream minus its first ``image_embed_seq_len`` tokens, sliced by count, which a shard of that stream cannot do
(the image tokens sit on the first ranks only). Its stand-in (:class:`MotifTextCrossAttention`) keeps the
rank's whole conditioning shard as keys and masks out the image tokens among them (found with
``routing.shard_span``), with the text padding mask: the same softmax over the text keys, through CP attention.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out
from diffusers.models.embeddings import apply_rotary_emb

from cp_lightning import routing
from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.hunyuan import _text_mask
from cp_lightning.models.wan import _video
from cp_lightning.plan import JointInput


class MotifTextCrossAttention(routing.StandIn):
    """``MotifVideoCrossAttnProcessor2_0``'s stand-in: video queries to the text keys of a split conditioning stream."""

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states,
        attention_mask=None,
        image_rotary_emb=None,
        image_embed_seq_len=0,
    ):
        if not self.runs_cp():
            args = (hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, image_embed_seq_len)
            return self.original(attn, *args)
        query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1))  # B, S_local, H, D
        key = attn.to_k(encoder_hidden_states).unflatten(2, (attn.heads, -1))  # B, T_local, H, D: [image, text]_r
        value = attn.to_v(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        if attn.norm_q is not None:
            query, key = attn.norm_q(query), attn.norm_k(key)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        local = key.shape[1]
        offset, _ = routing.shard_span(encoder_hidden_states, 1)
        text = torch.arange(offset, offset + local, device=key.device) >= image_embed_seq_len  # the shard's text
        keys = text.expand(key.shape[0], local)
        if attention_mask is not None:  # (B, 1, 1, S_local + T_local) over [video_r, cond_r]: the cond part
            keys = keys & attention_mask[:, 0, 0, -local:].bool()
        out = self.attend(query, key, value, keys[:, None, None, :]).flatten(2, 3).to(query.dtype)
        return attn.to_out[1](attn.to_out[0](out))

    def __repr__(self) -> str:
        return f"MotifTextCrossAttention({type(self.original).__name__})"


routing.STAND_INS["MotifVideoCrossAttnProcessor2_0"] = MotifTextCrossAttention

_STREAMS = {
    "hidden_states": In(split_dim=1, expected_dims=3),
    "encoder_hidden_states": In(split_dim=1, expected_dims=3),  # [image, text]: one joint-attention stream
}
_MASK = {"attention_mask": JointInput(split_dim=3, expected_dims=4, segments=tuple(_STREAMS))}
_TABLE = In(split_dim=0, expected_dims=2, split_output=True)  # (S, D), one row per video token


def _plan(config) -> dict:
    first = "transformer_blocks.0" if config.num_layers else "single_transformer_blocks.0"
    plan = {
        "rope": {0: _TABLE, 1: _TABLE},
        first: _STREAMS,  # before the mask entries: it records the streams' full lengths
        "transformer_blocks.*": _MASK,
        "single_transformer_blocks.*": _MASK,  # the decoder blocks get no mask (None passes)
        "proj_out": Out(gather_dim=1, expected_dims=3),
    }
    if config.num_decoder_layers:  # the decoder's query stream: the whole pre-block copy of the video tokens
        decoder = f"single_transformer_blocks.{config.num_single_layers - config.num_decoder_layers}"
        plan[decoder] = {"hidden_states": In(split_dim=1, expected_dims=3)}
    return plan


MOTIF = PlanEntry(
    "MotifVideoTransformer3DModel",
    _plan,
    needs="a stand-in processor (text cross-attention keys sliced by count from a split stream)",
)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    frames, h, w = _video(tokens)
    cfg = model.config
    p = cfg.patch_size
    return {
        "hidden_states": torch.randn(batch, cfg.in_channels, frames, p * h, p * w, generator=g, dtype=dtype),
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.text_embed_dim, generator=g, dtype=dtype),
        "encoder_attention_mask": _text_mask(batch, text_tokens),
        "image_embeds": torch.randn(batch, 3, cfg.image_embed_dim, generator=g, dtype=dtype),  # image-to-video
    }


register(
    MOTIF,
    TinyCase(
        "motif-video",
        "MotifVideoTransformer3DModel",
        dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=4,
            attention_head_dim=16,
            num_layers=1,
            num_single_layers=2,
            num_decoder_layers=1,  # one encoder single block, one decoder block
            mlp_ratio=2.0,
            text_embed_dim=16,
            image_embed_dim=8,
            rope_axes_dim=(4, 6, 6),
            enable_text_cross_attention_dual=True,
            enable_text_cross_attention_single=True,
        ),
        _inputs,
        note="image-to-video (image tokens before the text), text cross-attention, a decoder block",
    ),
)

"""Mochi: joint [video, text] attention whose stock processor unpads each sample's text first.

``MochiAttnProcessor2_0`` drops each sample's padded text tokens and calls SDPA once per sample over
[video, valid text], then pads the text outputs with zeros. That loop needs every valid text token of
the sample in one place, so it cannot run on split tokens; but it is one masked SDPA in disguise:
attention over [video, all text] with the padded text keys masked out, and the padded text rows of the
output zeroed. :class:`MochiJointAttention` stands in for it inside the split region (routing.py's
``STAND_INS``) and calls CP attention with that key mask; outside it, and in one process, the stock
processor runs. The two agree when each sample's valid tokens come first (the Mochi pipeline pads at
the end); for a mask with holes the stock loop moves the valid outputs to the front (a diffusers
quirk) where the stand-in leaves them in place.

Plan: video and text split at the first block, the (B, T) text mask at every block (``forward`` hands
each block the whole mask), the RoPE tables (per video token; their frequencies are a parameter, so
their gradient flows back through the split) after ``rope``, and the video gathered after ``proj_out``.
The caption pooling in ``time_embed`` runs before the split, on whole text.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning import routing
from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.wan import _video


def _rotate(x, cos, sin):
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2).to(x.dtype)


class MochiJointAttention(routing.StandIn):
    """``MochiAttnProcessor2_0``'s stand-in: the same projections, one key-masked attention over the CP group."""

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb=None):
        if not self.runs_cp():
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        video_in = (hidden_states, (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k))
        text_projs = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        text_in = (encoder_hidden_states, text_projs, (attn.norm_added_q, attn.norm_added_k))
        streams = []
        for x, to_qkv, norms in (video_in, text_in):
            q, k, v = (proj(x).unflatten(2, (attn.heads, -1)) for proj in to_qkv)  # B, S, H, D
            q = norms[0](q) if norms[0] is not None else q
            k = norms[1](k) if norms[1] is not None else k
            streams.append((q, k, v))
        (q, k, v), (eq, ek, ev) = streams
        if image_rotary_emb is not None:  # the video tokens only, as in the stock processor
            q, k = _rotate(q, *image_rotary_emb), _rotate(k, *image_rotary_emb)
        valid = attention_mask.bool()  # B, T_local: this rank's text tokens that are not padding
        keys = torch.cat([torch.ones_like(valid[:, :1]).expand(-1, q.shape[1]), valid], dim=1)
        out = self.attend(
            torch.cat([q, eq], dim=1), torch.cat([k, ek], dim=1), torch.cat([v, ev], dim=1), keys[:, None, None, :]
        )
        out = out.flatten(2, 3)
        video, text = out.split_with_sizes((q.shape[1], eq.shape[1]), dim=1)
        text = text * valid[..., None].to(text.dtype)  # the stock processor pads padded rows with zeros
        video = attn.to_out[1](attn.to_out[0](video))
        if hasattr(attn, "to_add_out"):
            text = attn.to_add_out(text)
        return video, text

    def __repr__(self) -> str:
        return f"MochiJointAttention({type(self.original).__name__})"


routing.STAND_INS["MochiAttnProcessor2_0"] = MochiJointAttention

_STREAMS = {
    "hidden_states": In(split_dim=1, expected_dims=3),
    "encoder_hidden_states": In(split_dim=1, expected_dims=3),
}
MOCHI = PlanEntry(
    "MochiTransformer3DModel",
    {
        "rope": {i: In(split_dim=0, expected_dims=3, split_output=True) for i in (0, 1)},  # (S, H, D/2) cos, sin
        "transformer_blocks.0": _STREAMS,
        "transformer_blocks.*": {"encoder_attention_mask": In(split_dim=1, expected_dims=2)},
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
    needs="a stand-in processor (key-masked joint attention for the per-sample unpadding)",
)


# the last block is context_pre_only: its text output is dropped, so its text queries get no gradient (in one
# process too)
_UNUSED = ("transformer_blocks.1.attn1.add_q_proj", "transformer_blocks.1.attn1.norm_added_q")


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    frames, h, w = _video(tokens)
    cfg = model.config
    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    mask[1:, -2:] = 0  # the second sample's last two text tokens are padding
    return {
        "hidden_states": torch.randn(batch, cfg.in_channels, frames, 2 * h, 2 * w, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.text_embed_dim, generator=g, dtype=dtype),
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
        "encoder_attention_mask": mask,
    }


register(
    MOCHI,
    TinyCase(
        "mochi",
        "MochiTransformer3DModel",
        dict(
            patch_size=2,
            num_attention_heads=4,
            attention_head_dim=8,
            num_layers=2,  # the last block is context_pre_only: the first one's text output is tested
            pooled_projection_dim=16,
            in_channels=4,
            text_embed_dim=16,
            time_embed_dim=16,
        ),
        _inputs,
        unused=_UNUSED,
        note="text padded per sample (stand-in for the per-sample unpadding)",
    ),
)

"""Lumina-Image 2.0: a single-stream transformer over one joint sequence of caption and image tokens.

Like Z-Image: the caption tokens (context refiner) and image tokens (noise refiner) are refined apart, whole
on every rank, then packed per sample into the joint sequence [caption_i, image, padding] that the main
``layers`` run on. Every main layer reads three per-token tensors from ``forward``: the sequence (split once,
at ``layers.0``, then it flows sharded), its RoPE table (B, S, D/2, complex) and, when the samples' caption
lengths differ, its key-padding mask (B, S) (both split at each layer, which each get the root's full
tensor). ``norm_out`` is per token, so its output is gathered before ``forward`` cuts each sample's image
tokens out of the joint sequence. The stock ``Lumina2AttnProcessor2_0`` calls SDPA directly after repeating its
grouped key/value heads, which under CP would send g times the K/V bytes: inside the split region
:class:`Lumina2Attention` stands in for it (routing.py's ``STAND_INS``) and hands CP attention the H_kv heads as
they are (grouped-query attention); outside it (the refiners, which run locally) the stock processor runs.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out
from diffusers.models.embeddings import apply_rotary_emb

from cp_lightning import routing
from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.tiny import _factor


class Lumina2Attention(routing.StandIn):
    """``Lumina2AttnProcessor2_0``'s stand-in: the same projections, norms and RoPE, and its K/V heads unrepeated."""

    def __call__(
        self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None,
        base_sequence_length=None,
    ):  # fmt: skip
        if not self.runs_cp():
            return self.original(
                attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, base_sequence_length
            )
        if base_sequence_length is not None:
            raise ValueError(
                "Lumina2's proportional attention (base_sequence_length, an inference option) scales the scores by "
                "the sequence length, which under context parallelism would be the local one: train without it."
            )
        q = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))  # B, S, H*D -> B, S, H, D
        head_dim, dtype = q.shape[-1], q.dtype
        # B, S, H_kv*D -> B, S, H_kv, D: the grouped heads go to CP attention as they are (enable_gqa)
        k, v = (proj(encoder_hidden_states).unflatten(-1, (-1, head_dim)) for proj in (attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, use_real=False)
            k = apply_rotary_emb(k, image_rotary_emb, use_real=False)
        q, k = q.to(dtype), k.to(dtype)
        mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]  # B, S -> B, 1, 1, S
        out = self.attend(q, k, v, mask, scale=attn.scale).flatten(2).type_as(q)  # B, S, H, D -> B, S, H*D
        return attn.to_out[1](attn.to_out[0](out))

    def __repr__(self) -> str:
        return f"Lumina2Attention({type(self.original).__name__})"


routing.STAND_INS["Lumina2AttnProcessor2_0"] = Lumina2Attention

LUMINA2 = PlanEntry(
    "Lumina2Transformer2DModel",
    {
        "layers.0": {"hidden_states": In(split_dim=1, expected_dims=3)},
        "layers.*": {
            "attention_mask": In(split_dim=1, expected_dims=2),
            "image_rotary_emb": In(split_dim=1, expected_dims=3),
        },
        "norm_out": Out(gather_dim=1, expected_dims=3),
    },
    needs="CP-aware processors for SDPA-direct processors (Lumina2AttnProcessor2_0)",
)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    h, p = _factor(tokens), cfg.patch_size
    # caption i ends in i + 1 padding tokens: joint lengths differ per sample (a key mask), the longest is odd
    mask = torch.ones(batch, text_tokens, dtype=torch.bool)
    for i in range(batch):
        mask[i, text_tokens - 1 - i :] = False
    return {
        "hidden_states": torch.randn(batch, cfg.in_channels, p * h, p * (tokens // h), generator=g, dtype=dtype),
        "timestep": torch.rand(batch, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.cap_feat_dim, generator=g, dtype=dtype),
        "encoder_attention_mask": mask,
    }


register(
    LUMINA2,
    TinyCase(
        "lumina2",
        "Lumina2Transformer2DModel",
        dict(
            sample_size=16,
            patch_size=2,
            in_channels=4,
            hidden_size=32,
            num_layers=2,
            num_refiner_layers=1,
            num_attention_heads=4,
            num_kv_heads=2,  # grouped-query attention: repeated by the stock processor, not by the stand-in
            multiple_of=16,
            axes_dim_rope=(2, 2, 4),
            axes_lens=(64, 32, 32),
            cap_feat_dim=16,
        ),
        _inputs,
        note="joint caption + image sequence, per-sample caption lengths, GQA",
    ),
)


# Lumina-Next: self-attention over the image tokens and gated cross-attention to the caption in every block, both
# from the stock ``LuminaAttnProcessor2_0`` (SDPA-direct, routed; it repeats its grouped key/value heads itself). The
# self-attention passes its own tokens as ``encoder_hidden_states``, which routing.py tells from the cross-attention
# to the caption (that one runs locally, against the whole caption). ``patch_embedder`` returns the tokens, their
# (all-ones) key mask, the image sizes and the RoPE table (1, S, D/2) cropped from the full one: all but the sizes
# are split after it. ``norm_out`` is per token (it projects to the patch channels); its output is gathered before
# ``forward`` reshapes it. The pipeline's proportional attention (``cross_attention_kwargs["base_sequence_length"]``,
# an inference option) scales the scores by the processor's local sequence length: do not train with it under CP.
_PATCHES = {i: In(split_dim=1, expected_dims=dims, split_output=True) for i, dims in ((0, 3), (1, 2), (3, 3))}
LUMINA_NEXT = PlanEntry(
    "LuminaNextDiT2DModel",
    {"patch_embedder": _PATCHES, "norm_out": Out(gather_dim=1, expected_dims=3)},
    needs="CP-aware processors for SDPA-direct processors (LuminaAttnProcessor2_0)",
)


def _next_inputs(model, g, batch, tokens, text_tokens, dtype):
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

    cfg = model.config
    h, p = _factor(tokens), cfg.patch_size
    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    mask[1:, -2:] = 0  # the second caption ends in two padding tokens
    return {
        "hidden_states": torch.randn(batch, cfg.in_channels, p * h, p * (tokens // h), generator=g, dtype=dtype),
        "timestep": torch.rand(batch, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.cross_attention_dim, generator=g, dtype=dtype),
        "encoder_mask": mask,
        "image_rotary_emb": get_2d_rotary_pos_embed_lumina(model.head_dim, 16, 16),
        "cross_attention_kwargs": {},  # the blocks unpack it: None would fail
    }


register(
    LUMINA_NEXT,
    TinyCase(
        "lumina-next",
        "LuminaNextDiT2DModel",
        dict(
            sample_size=16,
            patch_size=2,
            in_channels=4,
            hidden_size=32,
            num_layers=1,
            num_attention_heads=4,
            num_kv_heads=2,  # grouped-query attention, repeated by the processor
            multiple_of=16,
            learn_sigma=False,
            cross_attention_dim=16,
        ),
        _next_inputs,
        unused=("pad_token",),  # a parameter diffusers' forward never reads
        note="gated cross-attention to the caption, GQA; no gradient checkpointing in diffusers (rows run plain)",
    ),
)

"""Krea 2: a single-stream MMDiT over one [text, image] sequence, after a text-fusion stage.

The tapped text-encoder layers are fused (attention across the layer axis per token, then across the text) whole on
every rank, before the split: like Z-Image's refiners, that attention runs locally. ``forward`` then concatenates
[text, image] into one sequence and builds its RoPE table (cos, sin), each (T + S, D), from the (T + S, 3) position
ids, and its (B, 1, 1, T + S) key mask (padded text) over the whole sequence, and hands both to every block. So the
sequence is split once, at the first block, and the table and the mask at every block. The modulation is per
sample. The sequence is gathered after the last block: ``forward`` then cuts the image tokens out of it by the full
text length (``loss_parallel`` is refused for that reason) and ``final_layer`` runs on them.

The stock processor repeats the grouped key/value heads before attention (48 query, 12 key/value heads in the
released model), which under CP would send g = 4 times the K/V bytes: inside the split region
:class:`Krea2GroupedAttention` stands in for it (routing.py's ``STAND_INS``) and hands CP attention the H_kv heads as
they are (grouped-query attention); outside it (the text fusion, which runs locally) the stock processor runs.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out
from diffusers.models.embeddings import apply_rotary_emb

from cp_lightning import routing
from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.tiny import _factor


class Krea2GroupedAttention(routing.StandIn):
    """``Krea2AttnProcessor``'s stand-in: the same projections, norms, RoPE and gate, its K/V heads unrepeated."""

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        if not self.runs_cp():
            return self.original(attn, hidden_states, attention_mask, image_rotary_emb)
        q = attn.norm_q(attn.to_q(hidden_states).unflatten(-1, (attn.num_heads, attn.head_dim)))  # B, S, H, D
        # B, S, H_kv*D -> B, S, H_kv, D: the grouped heads go to CP attention as they are (enable_gqa)
        k = attn.norm_k(attn.to_k(hidden_states).unflatten(-1, (attn.num_kv_heads, attn.head_dim)))
        v = attn.to_v(hidden_states).unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        out = self.attend(q, k, v, attention_mask).flatten(2)  # B, S, H, D -> B, S, H*D
        return attn.to_out[0](out * torch.sigmoid(attn.to_gate(hidden_states)))

    def __repr__(self) -> str:
        return f"Krea2GroupedAttention({type(self.original).__name__})"


routing.STAND_INS["Krea2AttnProcessor"] = Krea2GroupedAttention


def _plan(config) -> dict:
    last = config.num_layers - 1
    sequence = {"hidden_states": In(split_dim=1, expected_dims=3)}  # [text, image]
    per_block = {
        "image_rotary_emb": In(split_dim=0, expected_dims=2),  # (cos, sin) over [text, image]
        "attention_mask": In(split_dim=3, expected_dims=4),  # (B, 1, 1, T + S) key mask of the padded text
    }
    gather = Out(gather_dim=1, expected_dims=3)
    if not last:  # one key cannot both split and gather the only block: its "*" entry splits the sequence too
        return {"transformer_blocks.*": {**sequence, **per_block}, "transformer_blocks.0": gather}
    return {"transformer_blocks.0": sequence, "transformer_blocks.*": per_block, f"transformer_blocks.{last}": gather}


KREA2 = PlanEntry(
    "Krea2Transformer2DModel",
    _plan,
    needs="gathers with parameters after them; a stand-in that keeps the grouped K/V heads (Krea2AttnProcessor)",
    loss_parallel="its forward cuts the image tokens out of the last block's output by the full text length",
)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    text = text_tokens if (tokens + text_tokens) % 2 else text_tokens - 1  # an odd sequence: no CP degree divides it
    h = _factor(tokens)
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(tokens // h), indexing="ij")
    image_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3)
    mask = torch.ones(batch, text, dtype=torch.bool)
    mask[1:, -2:] = False  # the second prompt ends in two padding tokens
    return {
        "hidden_states": torch.randn(batch, tokens, cfg.in_channels, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(
            batch, text, cfg.num_text_layers, cfg.text_hidden_dim, generator=g, dtype=dtype
        ),
        "timestep": torch.rand(batch, generator=g, dtype=dtype),
        "position_ids": torch.cat([torch.zeros(text, 3, dtype=torch.long), image_ids]),
        "encoder_attention_mask": mask,
    }


register(
    KREA2,
    TinyCase(
        "krea2",
        "Krea2Transformer2DModel",
        dict(
            in_channels=8,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            num_key_value_heads=2,  # grouped-query attention: repeated by the stock processor, not by the stand-in
            intermediate_size=64,
            timestep_embed_dim=16,
            text_hidden_dim=16,
            num_text_layers=3,
            text_num_attention_heads=2,
            text_num_key_value_heads=2,
            text_intermediate_size=32,
            num_layerwise_text_blocks=1,
            num_refiner_text_blocks=1,
            axes_dims_rope=(2, 2, 4),
        ),
        _inputs,
        note="text fusion before the split; GQA; text padded per sample",
    ),
)

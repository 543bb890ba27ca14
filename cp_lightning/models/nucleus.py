"""NucleusMoE-Image: image queries attend to [image, text] keys; expert-choice mixture-of-experts feed-forwards.

Attention: the text gives keys and values only (``encoder_proj`` per block, from the same text ``forward`` hands
to every block), so, as for PRX (prx.py), the text is split at every block: over the CP group each text key must
count once. The image tokens are split once, at the first block. The RoPE tables (image (S, D/2) and text (T, D/2),
complex) are split at every block like the tokens each rotates, and the (B, S + T) key mask over [image, text] that
``forward`` builds from full lengths is split at every attention module as a ``JointInput``. The stock processor
repeats grouped key/value heads before attention, which under CP would send g times the K/V bytes:
:class:`NucleusGroupedAttention` stands in for it (routing.py's ``STAND_INS``) and hands CP attention the H_kv heads.

Feed-forwards: the dense ones are per token. The MoE ones route by expert choice: each expert takes the top
``capacity_factor * S / num_experts`` tokens of the whole sequence, a choice no split of it reproduces. So in every
MoE block the input of the MoE layer (``pre_mlp_norm``'s output, from which the block also builds the modulated
input) is gathered and the MoE output split again: the MoE runs on the whole sequence on every rank (cp times its
work, exact), the rest of the block on the shard. The image stream is gathered after ``proj_out``.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out
from diffusers.models.transformers.transformer_nucleusmoe_image import _apply_rotary_emb_nucleus, _is_moe_layer

from cp_lightning import routing
from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.hunyuan import _text_mask
from cp_lightning.plan import JointInput


class NucleusGroupedAttention(routing.StandIn):
    """``NucleusMoEAttnProcessor2_0``'s stand-in: image queries over [image, text] keys as the stock processor builds
    them (projections, norms, RoPE), its K/V heads unrepeated."""

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None,
        cached_txt_key=None, cached_txt_value=None,
    ):  # fmt: skip
        if not self.runs_cp():
            return self.original(
                attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, cached_txt_key,
                cached_txt_value,
            )  # fmt: skip
        if cached_txt_key is not None:
            raise ValueError(
                "NucleusMoE's cached text keys (an inference cache) hold the whole text, while under context "
                "parallelism each rank's block attends over its own share of it: train without the cache."
            )
        head_dim = attn.inner_dim // attn.heads
        q = attn.to_q(hidden_states).unflatten(-1, (attn.heads, head_dim))  # B, S, H*D -> B, S, H, D
        # B, S, H_kv*D -> B, S, H_kv, D: the grouped heads go to CP attention as they are (enable_gqa)
        k, v = (proj(hidden_states).unflatten(-1, (-1, head_dim)) for proj in (attn.to_k, attn.to_v))
        q = q if attn.norm_q is None else attn.norm_q(q)
        k = k if attn.norm_k is None else attn.norm_k(k)
        if image_rotary_emb is not None:
            q = _apply_rotary_emb_nucleus(q, image_rotary_emb[0], use_real=False)
            k = _apply_rotary_emb_nucleus(k, image_rotary_emb[0], use_real=False)
        if encoder_hidden_states is not None:  # the text's keys and values only, after the image's
            text_k, text_v = (
                proj(encoder_hidden_states).unflatten(-1, (-1, head_dim)) for proj in (attn.add_k_proj, attn.add_v_proj)
            )
            text_k = text_k if attn.norm_added_k is None else attn.norm_added_k(text_k)
            if image_rotary_emb is not None:
                text_k = _apply_rotary_emb_nucleus(text_k, image_rotary_emb[1], use_real=False)
            k, v = torch.cat([k, text_k], dim=1), torch.cat([v, text_v], dim=1)
        mask = attention_mask
        if mask is not None and mask.dim() == 2:  # B, S + T key mask -> B, 1, 1, S + T (as the dispatcher reads it)
            mask = mask[:, None, None, :]
        out = self.attend(q, k, v, mask).flatten(2).to(q.dtype)  # B, S, H, D -> B, S, H*D
        out = attn.to_out[0](out)
        return attn.to_out[1](out) if len(attn.to_out) > 1 else out

    def __repr__(self) -> str:
        return f"NucleusGroupedAttention({type(self.original).__name__})"


routing.STAND_INS["NucleusMoEAttnProcessor2_0"] = NucleusGroupedAttention

_TOKENS = In(split_dim=1, expected_dims=3)
_WHOLE = Out(gather_dim=1, expected_dims=3)


def _plan(config) -> dict:
    plan = {
        "transformer_blocks.0": {"hidden_states": _TOKENS},
        "transformer_blocks.*": {
            "encoder_hidden_states": _TOKENS,  # keys and values only: split at every block
            "image_rotary_emb": In(split_dim=0, expected_dims=2),  # (image table, text table)
        },
        "transformer_blocks.*.attn": {  # (B, S + T) key mask of the padded text, when given
            "attention_mask": JointInput(
                split_dim=1, expected_dims=2, segments=("hidden_states", "encoder_hidden_states")
            )
        },
        "proj_out": _WHOLE,
    }
    for index in range(config.num_layers):
        if config.moe_enabled and _is_moe_layer(config.dense_moe_strategy, index, config.num_layers):
            plan[f"transformer_blocks.{index}.pre_mlp_norm"] = _WHOLE  # the routing sees the whole sequence
            plan[f"transformer_blocks.{index}.img_mlp"] = {0: In(split_dim=1, expected_dims=3, split_output=True)}
    return plan


NUCLEUS = PlanEntry(
    "NucleusMoEImageTransformer2DModel",
    _plan,
    needs="gathers that are split again, parameters after them (the MoE layers); a stand-in that keeps the grouped "
    "K/V heads (NucleusMoEAttnProcessor2_0)",
)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    h = 3 if tokens % 3 == 0 else 1
    return {
        "hidden_states": torch.randn(batch, tokens, cfg.in_channels, generator=g, dtype=dtype),
        "img_shapes": [(1, h, tokens // h)] * batch,
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.joint_attention_dim, generator=g, dtype=dtype),
        "encoder_hidden_states_mask": _text_mask(batch, text_tokens),
        "timestep": torch.rand(batch, generator=g, dtype=dtype),
    }


register(
    NUCLEUS,
    TinyCase(
        "nucleusmoe-image",
        "NucleusMoEImageTransformer2DModel",
        dict(
            patch_size=2,
            in_channels=8,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            num_key_value_heads=2,  # grouped-query attention: repeated by the stock processor, not by the stand-in
            joint_attention_dim=16,
            axes_dims_rope=(2, 2, 4),
            mlp_ratio=6.0,  # the dense feed-forward's width rounds down to a multiple of 128
            dense_moe_strategy="leave_first_block_dense",  # block 0 dense, block 1 MoE
            num_experts=4,
            moe_intermediate_dim=16,
            capacity_factors=2.0,
        ),
        _inputs,
        unused=tuple(f"transformer_blocks.{i}.attn.norm_added_q" for i in (0, 1)),  # the text has no queries
        note="expert-choice MoE on the whole sequence; GQA; text padded per sample",
    ),
)

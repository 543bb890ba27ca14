"""NucleusMoE-Image: image queries attend to [image, text] keys; expert-choice mixture-of-experts feed-forwards.

Attention: the text gives keys and values only (``encoder_proj`` per block, from the same text ``forward`` hands
to every block), so, as for PRX (prx.py), the text is split at every block: over the CP group each text key must
count once. The image tokens are split once, at the first block. The RoPE tables (image (S, D/2) and text (T, D/2),
complex) are split at every block like the tokens each rotates, and the (B, S + T) key mask over [image, text] that
``forward`` builds from full lengths is split at every attention module as a ``JointInput``. The stock processor
repeats grouped key/value heads before attention; under CP the repeated heads are exchanged as they are.

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
from diffusers.models.transformers.transformer_nucleusmoe_image import _is_moe_layer

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.hunyuan import _text_mask
from cp_lightning.plan import JointInput

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
    needs="gathers that are split again, parameters after them (the MoE layers)",
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
            num_key_value_heads=2,  # grouped-query attention, repeated by the processor
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
        note="expert-choice MoE on the whole sequence; GQA (repeated K/V); text padded per sample",
    ),
)

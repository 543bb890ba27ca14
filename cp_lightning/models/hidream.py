"""HiDream-I1: double- and single-stream blocks with MoE feed-forwards and a Llama layer fed to every block.

``forward`` glues the blocks together on whole sequences: before each block it concatenates that block's
own Llama hidden states to the text (double-stream blocks) or to [image, text] (single-stream blocks),
and after it cuts the result back by full lengths. So the sequence cannot flow sharded from block to
block; the plan splits at each block's input and gathers at its output. Everything inside a block is per
token except the attention: its MoE routes each token on its own, and the RoPE table over [image, text]
is split as the joint sequence each rank holds ([image_r, text_r], a JointInput). Between blocks only the
concatenation and the cut run on whole, replicated tokens.

The MoE gate also computes a load-balancing loss over the whole sequence (a product of two sequence
means, which no split reproduces), but diffusers' ``MOEFeedForwardSwiGLU`` discards it (its
``AddAuxiliaryLoss`` line is commented out, diffusers 0.42.1): training with the stock class has no
auxiliary loss, and under CP neither. A model that adds it back is not exact under CP.

``loss_parallel`` is refused: ``forward`` cuts the last block's output to the image tokens by full
lengths, which a sharded output would not survive.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.plan import JointInput
from cp_lightning.tiny import _factor

_TOKENS = In(split_dim=1, expected_dims=3)
_MASK = In(split_dim=1, expected_dims=2)  # (B, S) image padding mask: zero keys of padded tokens
_ROPE = 6  # (B, S, 1, D/2, 2, 2) rotation matrices


def _plan(config) -> dict:
    gather = Out(gather_dim=1, expected_dims=3)
    return {
        "double_stream_blocks.*": {
            "hidden_states": _TOKENS,
            "hidden_states_masks": _MASK,
            "encoder_hidden_states": _TOKENS,  # [T5, last Llama layer, this block's Llama layer]
            "image_rotary_emb": JointInput(
                split_dim=1, expected_dims=_ROPE, segments=("hidden_states", "encoder_hidden_states")
            ),
        },
        "single_stream_blocks.*": {
            "hidden_states": _TOKENS,  # [image, text, this block's Llama layer]
            "hidden_states_masks": _MASK,
            "image_rotary_emb": In(split_dim=1, expected_dims=_ROPE),
        },
        **{f"double_stream_blocks.{i}": [gather, gather] for i in range(config.num_layers)},
        **{f"single_stream_blocks.{i}": gather for i in range(config.num_single_layers)},
    }


HIDREAM = PlanEntry(
    "HiDreamImageTransformer2DModel",
    _plan,
    needs="gathers that are split again, parameters after them",
    loss_parallel="its forward cuts the last block's output to the image tokens by full lengths",
)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    h = _factor(tokens)
    p, blocks = cfg.patch_size, cfg.num_layers + cfg.num_single_layers
    t5, llama = cfg.caption_channels
    return {
        # a non-square grid: patchify pads it to max_resolution's token count and masks the padding
        "hidden_states": torch.randn(batch, cfg.in_channels, p * h, p * (tokens // h), generator=g, dtype=dtype),
        "timesteps": torch.randint(0, 1000, (batch,), generator=g),
        "encoder_hidden_states_t5": torch.randn(batch, text_tokens, t5, generator=g, dtype=dtype),
        "encoder_hidden_states_llama3": torch.randn(blocks, batch, text_tokens - 3, llama, generator=g, dtype=dtype),
        "pooled_embeds": torch.randn(batch, cfg.text_emb_dim, generator=g, dtype=dtype),
    }


register(
    HIDREAM,
    TinyCase(
        "hidream-i1",
        "HiDreamImageTransformer2DModel",
        dict(
            patch_size=2,
            in_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=4,
            caption_channels=[16, 12],  # T5, Llama
            text_emb_dim=16,
            num_routed_experts=4,
            num_activated_experts=2,
            axes_dims_rope=(8, 4, 4),
            max_resolution=(12, 12),  # 36 tokens: a 21-token grid gets 15 masked padding tokens
            llama_layers=[0, 1],
        ),
        _inputs,
        note="MoE feed-forwards; image padding mask; per-block Llama text",
    ),
)

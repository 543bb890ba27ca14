"""Tencent's image DiTs: HunyuanDiT (v1.x) and HunyuanImage-2.1.

HunyuanDiT: self-attention over the image tokens, cross-attention to the [CLIP, T5] text, and long skip connections
from the first half of the blocks to the second (concatenated per token). ``pos_embed`` only patchifies (no added
positions), so its output tokens are split; the RoPE table (cos, sin), each (S, D), comes in as an input and is split
at the root with the tokens it rotates (the cross-attention rotates its image queries with it too). The text stays
whole: the cross-attention runs locally (routing.py's "self" kind), and the text pooling in ``time_extra_emb`` sees
it all. The stock ``HunyuanAttnProcessor2_0`` calls SDPA directly: ``parallelize`` routes it. Gathered after
``proj_out``, before the unpatchify reshape.

HunyuanImage-2.1: HunyuanVideo's layout (hunyuan.py) in 2-D, and its plan: the text runs through the token refiner
whole, image and text are split apart at the first dual-stream block, the (S, D) RoPE tables after ``rope``, and
the (B, 1, 1, S + T) key mask over [image, text] that ``forward`` builds from full lengths at every block as a
``JointInput``; the image stream is gathered after ``proj_out``.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out
from diffusers.models.embeddings import get_2d_rotary_pos_embed

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.hunyuan import HUNYUAN_VIDEO, _text_mask
from cp_lightning.tiny import _factor

HUNYUAN_DIT = PlanEntry(
    "HunyuanDiT2DModel",
    {
        "": {"image_rotary_emb": In(split_dim=0, expected_dims=2)},  # (cos, sin) of the image tokens
        "pos_embed": {0: In(split_dim=1, expected_dims=3, split_output=True)},  # patch tokens
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
    needs="CP-aware processors for SDPA-direct processors (HunyuanAttnProcessor2_0)",
)

HUNYUAN_IMAGE = PlanEntry(
    "HunyuanImageTransformer2DModel",
    HUNYUAN_VIDEO.plan,
    needs="unsplit modules keep their own processors (the token refiner)",
)


def _dit_inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    h, p = _factor(tokens), cfg.patch_size
    w = tokens // h
    clip, t5 = cfg.text_len, cfg.text_len_t5
    return {
        "hidden_states": torch.randn(batch, cfg.in_channels, p * h, p * w, generator=g, dtype=dtype),
        "timestep": torch.randint(0, 1000, (batch,), generator=g).to(dtype),
        "encoder_hidden_states": torch.randn(batch, clip, cfg.cross_attention_dim, generator=g, dtype=dtype),
        "text_embedding_mask": _text_mask(batch, clip),
        "encoder_hidden_states_t5": torch.randn(batch, t5, cfg.cross_attention_dim_t5, generator=g, dtype=dtype),
        "text_embedding_mask_t5": _text_mask(batch, t5),
        "image_rotary_emb": get_2d_rotary_pos_embed(cfg.attention_head_dim, ((0, 0), (h, w)), (h, w)),
    }


def _image_inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    h = _factor(tokens)
    return {
        "hidden_states": torch.randn(batch, cfg.in_channels, h, tokens // h, generator=g, dtype=dtype),
        "timestep": 1000 * torch.rand(batch, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.text_embed_dim, generator=g, dtype=dtype),
        "encoder_attention_mask": _text_mask(batch, text_tokens),
    }


register(
    HUNYUAN_DIT,
    HUNYUAN_IMAGE,
    TinyCase(
        "hunyuan-dit",
        "HunyuanDiT2DModel",
        dict(
            num_attention_heads=4,
            attention_head_dim=8,
            in_channels=4,
            patch_size=2,
            sample_size=8,
            hidden_size=32,
            num_layers=4,  # the last block takes the first one's skip connection
            mlp_ratio=2.0,
            cross_attention_dim=16,
            cross_attention_dim_t5=16,
            pooled_projection_dim=16,
            text_len=3,
            text_len_t5=5,
            use_style_cond_and_image_meta_size=False,  # v1.2 and later
        ),
        _dit_inputs,
        note="skip connections, CLIP + T5 text (cross-attention), RoPE as an input",
    ),
    TinyCase(
        "hunyuanimage-2.1",
        "HunyuanImageTransformer2DModel",
        dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=4,
            attention_head_dim=8,
            num_layers=1,
            num_single_layers=1,
            num_refiner_layers=1,
            mlp_ratio=2.0,
            text_embed_dim=16,
            rope_axes_dim=(4, 4),
        ),
        _image_inputs,
        note="token refiner before the split, text padded per sample",
    ),
)

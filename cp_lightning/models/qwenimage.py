"""QwenImage and QwenImage-Edit (one class; Edit concatenates reference-image tokens after the target's).

Text and image tokens meet in joint attention and every other layer is per token, so both streams are
split at the first block, the per-token tensors every block reads from ``forward`` (the text padding
mask, Edit's ``modulate_index``) at each block, the RoPE tables after ``pos_embed``, and the image
stream gathered after ``proj_out``.
"""

from __future__ import annotations

from cp_lightning.models import DIFFUSERS, PlanEntry, TinyCase, register
from cp_lightning.tiny import _factor, _qwenimage_inputs

# QwenImage's own plan, right for training as it is; with zero_cond_t (QwenImage-Edit-2511) every block
# reads `modulate_index` (B, S), 0 for target tokens and 1 for reference tokens, split with the tokens.
QWENIMAGE = PlanEntry("QwenImageTransformer2DModel", DIFFUSERS)

_CONFIG = dict(
    patch_size=2,
    in_channels=16,
    out_channels=4,
    num_layers=1,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=16,
    axes_dims_rope=(8, 4, 4),
)


def _edit_inputs(model, g, batch, tokens, text_tokens, dtype):
    out = _qwenimage_inputs(model, g, batch, tokens, text_tokens, dtype)
    target = tokens - tokens // 2  # the image being edited; the reference image's tokens follow it
    shapes = [(1, _factor(n), n // _factor(n)) for n in (target, tokens - target)]
    out["img_shapes"] = [shapes] * batch
    return out


# the last block's text output is dropped, so its text queries, text output projection and text MLP get no
# gradient (in one process too)
_LAST_TEXT = tuple(f"transformer_blocks.0.{p}" for p in ("attn.add_q_proj", "attn.norm_added_q", "attn.to_add_out"))
_UNUSED = (*_LAST_TEXT, "transformer_blocks.0.txt_mlp")

register(
    QWENIMAGE,
    TinyCase("qwenimage", "QwenImageTransformer2DModel", _CONFIG, _qwenimage_inputs, unused=_UNUSED),
    TinyCase(
        "qwenimage-edit",
        "QwenImageTransformer2DModel",
        dict(_CONFIG, zero_cond_t=True),
        _edit_inputs,
        unused=_UNUSED,
        note="target + reference image tokens, zero_cond_t modulate_index",
    ),
)

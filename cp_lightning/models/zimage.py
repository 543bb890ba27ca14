"""Z-Image: a single-stream transformer over one unified sequence of image and caption tokens.

The image tokens (noise refiner) and caption tokens (context refiner) are refined apart, each whole on
every rank, then concatenated per sample into the unified sequence that the main ``layers`` run on.
Every main layer reads three per-token tensors from ``forward``: the sequence itself (split once, at
``layers.0``, then it flows sharded), its RoPE table and its key-padding mask (split at each layer,
since each gets the root's full tensor). The final layer is per token, so its output is gathered, before
``unpatchify`` cuts the image tokens out of the unified sequence.

The refiners run outside the split region: their attention is over whole tensors, so it is exact on
its own (and, until the engine keeps unsplit modules local, done by CP on replicated keys, cp times the
work). Z-Image pads every stream to a multiple of 32 tokens, so its unified length is always divisible
by cp = 2 and 4; different caption lengths per sample give the key-padding mask.
"""

from __future__ import annotations

import torch

from cp_lightning.models import PlanEntry, TinyCase, register


def _plan(config) -> dict:
    key = f"{config.all_patch_size[0]}-{config.all_f_patch_size[0]}"  # the default patch size's final layer
    return {
        "layers.0": {"x": _in(3)},
        "layers.*": {"freqs_cis": _in(3), "attn_mask": _in(2)},  # (B, S, D/2) complex; (B, S) bool
        f"all_final_layer.{key}": _out(),
    }


def _in(dims):
    from diffusers.models._modeling_parallel import ContextParallelInput

    return ContextParallelInput(split_dim=1, expected_dims=dims)


def _out():
    from diffusers.models._modeling_parallel import ContextParallelOutput

    return ContextParallelOutput(gather_dim=1, expected_dims=3)


ZIMAGE = PlanEntry("ZImageTransformer2DModel", _plan)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    from cp_lightning.tiny import _factor

    h = _factor(tokens)
    cfg = model.config
    # caption lengths differ per sample (the second one pads to one more block of 32), so a mask is built
    caps = [torch.randn(text_tokens + 32 * (i % 2), cfg.cap_feat_dim, generator=g, dtype=dtype) for i in range(batch)]
    latent = (cfg.in_channels, 1, 2 * h, 2 * (tokens // h))
    return {
        "x": [torch.randn(latent, generator=g, dtype=dtype) for _ in range(batch)],
        "t": torch.rand(batch, generator=g, dtype=dtype),
        "cap_feats": caps,
    }


register(
    ZIMAGE,
    TinyCase(
        "z-image",
        "ZImageTransformer2DModel",
        dict(
            in_channels=4,
            dim=64,
            n_layers=1,
            n_refiner_layers=1,
            n_heads=4,
            n_kv_heads=4,
            cap_feat_dim=16,
            axes_dims=[4, 6, 6],
            axes_lens=[256, 32, 32],
        ),
        _inputs,
        # pad tokens fill the streams up to a multiple of 32; the padded image rows are cut away by unpatchify,
        # so the final layer sees every row but the output (and loss) only the real image rows
        note="caption lengths differ per sample (key-padding mask); lengths are multiples of 32 by design",
    ),
)

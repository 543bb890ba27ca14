"""Bria Fibo (Flux.1's layout, per-block text layers) and Fibo 2.0 (a Z-Image-style single stream with gist tokens).

Fibo: text and image tokens form one joint sequence in every block, as in Flux.1 (flux.py). Each block also
concatenates a projection of its own text-encoder layer to the text along the channel dim, per token, so every
item of ``text_encoder_layers`` is split with the text. The (S, 3) ids are split with their tokens (the RoPE
table over [text_r, image_r] is built from them on each rank). Padded prompts come with a (B, 1, 1, T + S) key
mask over [text, image] that the pipeline passes through ``joint_attention_kwargs`` to every attention module: a
``JointInput``, so each rank's mask matches its local [text_r, image_r] keys. Gathered after ``proj_out``.

Fibo 2.0: the image tokens run through the noise refiner and the text through the Perceiver (which squeezes it
into gist tokens by cross- and self-attention) whole on every rank, before the split, as Z-Image's refiners; then
``forward`` builds one stream [gist, image] (or [image, gist] with a gist padding mask) with its RoPE table,
key mask and per-token noise mask (clean gist, noisy image), all over the full sequence, and hands them to every
main layer. So the stream is split once, at the first main layer, and the three per-token tensors at every layer.
The injection layers' cross-attention to the text bundles keeps the text whole (it runs locally, see routing.py's
``CROSS_LOCAL_DISPATCH``). The stream is gathered after the last layer: ``forward`` then cuts the image tokens out
of it by full lengths (``loss_parallel`` is refused for that reason) and ``final_layer`` runs on them.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.plan import JointInput
from cp_lightning.tiny import _factor, _flux_inputs

_TOKENS = In(split_dim=1, expected_dims=3)
_KEYS = {
    "attention_mask": JointInput(split_dim=3, expected_dims=4, segments=("encoder_hidden_states", "hidden_states"))
}

FIBO = PlanEntry(
    "BriaFiboTransformer2DModel",
    {
        "": {
            "hidden_states": _TOKENS,
            "encoder_hidden_states": _TOKENS,
            "text_encoder_layers": _TOKENS,  # a list: one (B, T, C) text layer per block, split like the text
            "img_ids": In(split_dim=0, expected_dims=2),
            "txt_ids": In(split_dim=0, expected_dims=2),
        },
        "transformer_blocks.*.attn": _KEYS,  # the padding mask, when the pipeline passes one
        "single_transformer_blocks.*.attn": _KEYS,
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
)


def _fibo2_plan(config) -> dict:
    last = config.n_layers - 1
    per_layer = {
        "attn_mask": In(split_dim=1, expected_dims=2),  # (B, S) gist padding key mask, when prompts differ
        "freqs_cis": In(split_dim=1, expected_dims=3),  # (1, S, D/2) complex RoPE table
        "noise_mask": In(split_dim=1, expected_dims=2),  # (B, S): which tokens take the noisy modulation
    }
    if not last:  # one key cannot both split and gather the only layer: its "*" entry splits the stream too
        return {"layers.*": {"x": _TOKENS, **per_layer}, "layers.0": Out(gather_dim=1, expected_dims=3)}
    return {"layers.0": {"x": _TOKENS}, "layers.*": per_layer, f"layers.{last}": Out(gather_dim=1, expected_dims=3)}


FIBO2 = PlanEntry(
    "BriaFibo2Transformer2DModel",
    _fibo2_plan,
    needs="gathers with parameters after them; cross-attention to unsplit text run locally",
    loss_parallel="its forward cuts the image tokens out of the last layer's output by full lengths",
)


def _fibo_inputs(model, g, batch, tokens, text_tokens, dtype):
    inputs = _flux_inputs(model, g, batch, tokens, text_tokens, dtype)
    del inputs["pooled_projections"]
    cfg = model.config
    blocks = cfg.num_layers + cfg.num_single_layers
    inputs["hidden_states"] = torch.randn(batch, tokens, cfg.in_channels, generator=g, dtype=dtype)
    inputs["encoder_hidden_states"] = torch.randn(batch, text_tokens, cfg.joint_attention_dim, generator=g, dtype=dtype)
    inputs["text_encoder_layers"] = [
        torch.randn(batch, text_tokens, cfg.text_encoder_dim, generator=g, dtype=dtype) for _ in range(blocks)
    ]
    keys = torch.ones(batch, text_tokens + tokens, dtype=torch.bool)
    keys[1:, text_tokens - 2 : text_tokens] = False  # the second prompt ends in two padding tokens
    inputs["joint_attention_kwargs"] = {"attention_mask": keys[:, None, None, :]}
    return inputs


def _fibo2_inputs(model, g, batch, tokens, text_tokens, dtype):
    cfg = model.config
    h, p = _factor(tokens), cfg.patch_size
    bundles = 1 + len(cfg.injection_layer_ids)
    mask = torch.ones(batch, text_tokens, dtype=torch.bool)
    mask[1:, 2:] = False  # the second prompt is 2 tokens long: fewer gist tokens, padded and masked
    return {
        "hidden_states": torch.randn(batch, cfg.in_channels, p * h, p * (tokens // h), generator=g, dtype=dtype),
        "timestep": torch.rand(batch, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, bundles, text_tokens, cfg.cap_feat_dim, generator=g, dtype=dtype),
        "encoder_attention_mask": mask,
    }


register(
    FIBO,
    FIBO2,
    TinyCase(
        "bria-fibo",
        "BriaFiboTransformer2DModel",
        dict(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=16,
            axes_dims_rope=(2, 2, 4),
            text_encoder_dim=16,
        ),
        _fibo_inputs,
        note="per-block text-encoder layers; text padded per sample",
    ),
    TinyCase(
        "bria-fibo2",
        "BriaFibo2Transformer2DModel",
        dict(
            in_channels=4,
            patch_size=2,
            dim=32,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=4,
            cap_feat_dim=16,
            injection_layer_ids=(1,),
            perceiver_num_layers=1,
            min_num_gist_tokens=2,
            max_num_gist_tokens=4,
            gist_step=2,
            gist_min_text_len=2,
            gist_max_text_len=8,
            axes_dims=(2, 2, 4),
            axes_lens=(16, 16, 16),
        ),
        _fibo2_inputs,
        note="gist tokens (Perceiver) before the split, gist padding mask, cross-attention injection layer",
    ),
)

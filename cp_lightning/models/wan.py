"""Wan-architecture video transformers: Wan 2.1/2.2, Wan-VACE, SkyReels-V2 and ChronoEdit.

They share one layout: ``rope(hidden_states)`` returns per-token cos/sin tables, the latent video is
patch-embedded into ``(B, S, C)`` tokens, every block self-attends over the video tokens and
cross-attends to text (and CLIP image tokens in I2V) that stay whole on every rank, and
``norm_out``/``proj_out`` are per-token. So the video tokens are split at the first block, the rope
tables after ``rope`` (the same rows as the tokens they rotate), and the output is gathered after
``proj_out``; text is never split (an I2V context of 257 + 512 tokens would not divide anyway).
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import DIFFUSERS, PlanEntry, TinyCase, register
from cp_lightning.plan import PerTokenInput
from cp_lightning.tiny import _factor, _frames

# Wan's own plan is right for training and kept: rope tables split with their tokens, video tokens split
# at blocks.0, proj_out gathered, and the root's `timestep` split along dim 1 when it is per token
# (Wan2.2 TI2V-5B passes (B, S) timesteps; a per-sample (B,) timestep has no dim 1 and passes whole).
WAN = PlanEntry("WanTransformer3DModel", DIFFUSERS)

WAN_LIKE_PLAN = {
    # cos/sin tables (1, S, 1, D): split after rope, the same rows as the tokens they rotate
    "rope": {
        0: In(split_dim=1, expected_dims=4, split_output=True),
        1: In(split_dim=1, expected_dims=4, split_output=True),
    },
    # video tokens, after patch embedding; text stays whole (cross-attention keys are not split)
    "blocks.0": {"hidden_states": In(split_dim=1, expected_dims=3)},
    # norm_out / proj_out are per token, so the gather comes after them, before the unpatchify reshape
    "proj_out": Out(gather_dim=1, expected_dims=3),
}

# ChronoEdit is Wan with a temporal rope skip; diffusers' plan lacks Wan's per-token `timestep` split,
# so per-token timesteps (B, S) would meet sharded tokens in every block's modulation and crash.
CHRONOEDIT = PlanEntry(
    "ChronoEditTransformer3DModel",
    {**WAN_LIKE_PLAN, "": {"timestep": In(split_dim=1, expected_dims=2)}},
)


# SkyReels-V2 (T2V, I2V, diffusion forcing) has no diffusers plan; its layout is Wan's. Under diffusion
# forcing the timestep is per latent frame: every block's modulation `temb` becomes (B, 6, S, C) per token
# (split with the tokens; the per-sample (B, 6, C) form passes whole), and norm_out's shift/scale
# (B, S, C) are computed in forward from the full sequence, so the tokens are gathered after the last
# block and norm_out / proj_out run on whole tokens (the engine's gather rule keeps that exact).
# num_frame_per_block > 1 builds a block-causal (S, S) mask: every query row differs, so no rank can
# apply its slice of it without the others' rows and columns; refused.
def _skyreels_plan(config) -> dict:
    plan = {**WAN_LIKE_PLAN, "blocks.*": {"temb": PerTokenInput(split_dim=2, expected_dims=4)}}
    if config.num_layers > 1:  # one plan key cannot both split blocks.0's input and gather its output
        del plan["proj_out"]
        plan[f"blocks.{config.num_layers - 1}"] = Out(gather_dim=1, expected_dims=3)
    return plan


SKYREELS = PlanEntry(
    "SkyReelsV2Transformer3DModel",
    _skyreels_plan,
    refuse=lambda m: (
        f"num_frame_per_block={m.config.num_frame_per_block} builds a block-causal attention mask (one row per "
        "query), which context parallelism cannot split exactly; train with num_frame_per_block=1 (full attention, "
        "diffusion forcing by per-frame timesteps is fine)."
        if m.config.num_frame_per_block > 1
        else None
    ),
    needs="gathers with parameters after them",
)

# Wan-VACE: the VACE blocks read the *unsplit* video tokens (the same tensor blocks.0 gets) and the control
# tokens, and their hints are added to the main stream after the matching blocks. Every vace block's
# `hidden_states` is split (each block gets the root's full tensor), the control tokens once at
# vace_blocks.0 (then they flow sharded from vace block to vace block), so each hint is sharded exactly
# like the main stream it is added to.
VACE = PlanEntry(
    "WanVACETransformer3DModel",
    {
        **WAN_LIKE_PLAN,
        "vace_blocks.*": {"hidden_states": In(split_dim=1, expected_dims=3)},
        "vace_blocks.0": {"control_hidden_states": In(split_dim=1, expected_dims=3)},
    },
)


def _video(tokens: int) -> tuple[int, int, int]:
    frames = _frames(tokens)
    side_h = _factor(tokens // frames)
    return frames, side_h, tokens // frames // side_h


def _wan_config(**over):
    config = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=1,
        rope_max_seq_len=64,
    )
    return {**config, **over}


def wan_inputs(model, g, batch, tokens, text_tokens, dtype, *, per_token_timestep=False, image_tokens=0):
    frames, h, w = _video(tokens)
    channels = model.config.in_channels
    out = {
        "hidden_states": torch.randn(batch, channels, frames, 2 * h, 2 * w, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, model.config.text_dim, generator=g, dtype=dtype),
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
    }
    if per_token_timestep:
        # Wan2.2 TI2V: the first latent frame is the clean conditioning image (t = 0), the rest noisy
        t = out["timestep"][:, None].expand(batch, tokens).clone()
        t[:, : h * w] = 0
        out["timestep"] = t
    if image_tokens:
        dim = model.config.image_dim
        out["encoder_hidden_states_image"] = torch.randn(batch, image_tokens, dim, generator=g, dtype=dtype)
    return out


def _vace_inputs(model, g, batch, tokens, text_tokens, dtype):
    out = wan_inputs(model, g, batch, tokens, text_tokens, dtype)
    _, channels, frames, hh, ww = out["hidden_states"].shape
    vace = model.config.vace_in_channels
    out["control_hidden_states"] = torch.randn(batch, vace, frames, hh, ww, generator=g, dtype=dtype)
    out["control_hidden_states_scale"] = torch.tensor([0.7] * len(model.config.vace_layers), dtype=dtype)
    return out


def _i2v_inputs(model, g, batch, tokens, text_tokens, dtype, per_token_timestep=False):
    # Wan's I2V processor splits the context at its last 512 tokens (the text); the rest are image tokens
    return wan_inputs(model, g, batch, tokens, 512, dtype, per_token_timestep=per_token_timestep, image_tokens=5)


def _df_inputs(model, g, batch, tokens, text_tokens, dtype):
    # diffusion forcing: one timestep per latent frame; 3 frames when they divide the tokens (21 = 3 x 1 x 7)
    frames = 3 if tokens % 3 == 0 else _frames(tokens)
    h = _factor(tokens // frames)
    w = tokens // frames // h
    return {
        "hidden_states": torch.randn(batch, model.config.in_channels, frames, 2 * h, 2 * w, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, model.config.text_dim, generator=g, dtype=dtype),
        "timestep": torch.randint(0, 1000, (batch, frames), generator=g),
        "enable_diffusion_forcing": True,
    }


_I2V = dict(image_dim=8, added_kv_proj_dim=48)

register(
    WAN,
    CHRONOEDIT,
    SKYREELS,
    VACE,
    TinyCase("wan2.1", "WanTransformer3DModel", _wan_config(), wan_inputs),
    # Wan2.2 TI2V-5B: Wan's class with 48 latent channels in the real config and per-token timesteps
    TinyCase(
        "wan2.2-ti2v",
        "WanTransformer3DModel",
        _wan_config(),
        lambda *a: wan_inputs(*a, per_token_timestep=True),
        note="per-token timesteps (B, S), first latent frame clean",
    ),
    # Wan2.2 A14B: two Wan experts (high noise, low noise) parallelized on one mesh and trained together
    TinyCase("wan2.2-a14b", "WanTransformer3DModel", _wan_config(), wan_inputs, experts=2),
    TinyCase("wan-vace", "WanVACETransformer3DModel", _wan_config(vace_layers=[0], vace_in_channels=8), _vace_inputs),
    TinyCase("skyreels-v2-t2v", "SkyReelsV2Transformer3DModel", _wan_config(num_layers=2), wan_inputs),
    TinyCase(
        "skyreels-v2-df",
        "SkyReelsV2Transformer3DModel",
        _wan_config(num_layers=2),
        _df_inputs,
        note="diffusion forcing: per-frame timesteps, no block-causal mask",
    ),
    TinyCase("skyreels-v2-i2v", "SkyReelsV2Transformer3DModel", _wan_config(**_I2V), _i2v_inputs, text_tokens=512),
    TinyCase(
        "chronoedit",
        "ChronoEditTransformer3DModel",
        _wan_config(**_I2V, rope_temporal_skip_len=2),
        lambda *a: _i2v_inputs(*a, per_token_timestep=True),
        text_tokens=512,
        note="image-conditioned, per-token timesteps",
    ),
)

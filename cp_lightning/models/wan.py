"""Wan-architecture video transformers: Wan 2.1/2.2, Wan-VACE, SkyReels-V2 and ChronoEdit.

They share one layout: ``rope(hidden_states)`` returns per-token cos/sin tables, the latent video is
patch-embedded into ``(B, S, C)`` tokens, every block self-attends over the video tokens and
cross-attends to text (and CLIP image tokens in I2V) that stay whole on every rank, and
``norm_out``/``proj_out`` are per-token. So the video tokens are split at the first block, the rope
tables after ``rope`` (the same rows as the tokens they rotate), and the output is gathered after
``proj_out``; text is never split (an I2V context of 257 + 512 tokens would not divide anyway).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
from diffusers.configuration_utils import FrozenDict
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out
from torch.utils.hooks import RemovableHandle

from cp_lightning.masks import MaskSpec, block_causal
from cp_lightning.models import DIFFUSERS, PlanEntry, TinyCase, register
from cp_lightning.parallelize import set_layout
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
def _skyreels_plan(config) -> dict:
    plan = {**WAN_LIKE_PLAN, "blocks.*": {"temb": PerTokenInput(split_dim=2, expected_dims=4)}}
    del plan["proj_out"]
    # one plan key cannot both split blocks.0's input and gather its output: a one-block model gathers after
    # norm_out (per token, no parameters), whose output then meets the whole per-token shift / scale
    last = f"blocks.{config.num_layers - 1}" if config.num_layers > 1 else "norm_out"
    plan[last] = Out(gather_dim=1, expected_dims=3)
    return plan


# num_frame_per_block > 1 (diffusion forcing's causal blocks): a block of latent frames sees itself and the
# blocks before it. diffusers' forward builds that as a dense (1, 1, S, S) boolean (2.6 GB at 540p x 97 frames)
# and passes it to every block, where no rank could apply its rows without the others' keys. The entry's hooks
# hand each block's self-attention masks.block_causal(frames, frame_tokens, num_frame_per_block) instead, the
# same mask as rectangles, which the routed CP attention runs exactly (docs/masks.md):
# - a root pre-hook computes the spec from the config and the input's shape (frames F // p_t, frame tokens
#   (H // p_h) * (W // p_w), frame-major as patch_embedding flattens them) and makes forward build no mask: the
#   config reads num_frame_per_block=1 (nothing else in forward reads it) until a root forward hook, registered
#   with always_call so that an exception restores it too, puts the model's own config object back;
# - a pre-hook on every block puts the spec where forward passes None as the block's `attention_mask`; the
#   block hands it to its self-attention only (attn1; the text cross-attention gets None), whose processor
#   passes it to dispatch_attention_fn as attn_mask.
# Activation checkpointing recomputes each block during backward, after forward returned: the spec is kept
# until the next forward (as the split table keeps its lengths), so the recomputation gets the same spec; a
# backward after a later forward of another shape is not supported (nor is it by the split table).
# diffusers floors the block count and crashes on frames left over (diffusers#13609); the spec makes them a
# shorter tail block, so such clips run under CP (one process has no reference for them).
@functools.lru_cache(maxsize=32)
def _df_mask(frames: int, frame_tokens: int, per_block: int) -> MaskSpec:
    return block_causal(frames, frame_tokens, per_block)


def _install_block_causal(model) -> list[RemovableHandle]:
    current = SimpleNamespace(spec=None, config=None)  # this forward's spec; the config while forward runs

    def before_forward(module, args, kwargs):
        _, _, frames, height, width = (args[0] if args else kwargs["hidden_states"]).shape
        p_t, p_h, p_w = module.config.patch_size
        frames, frame_tokens = frames // p_t, (height // p_h) * (width // p_w)
        # layout="head_tail": the split hooks cut the video tokens (and their RoPE rows and per-token modulation)
        # into each rank's head and tail runs of whole frames, before the first split (rope's)
        set_layout(module, frames * frame_tokens, frame_tokens)
        per_block = module.config.num_frame_per_block
        if per_block <= 1:
            current.spec = None
            return
        current.spec = _df_mask(frames, frame_tokens, per_block)
        current.config = module._internal_dict
        module._internal_dict = FrozenDict({**current.config, "num_frame_per_block": 1})

    def after_forward(module, args, kwargs, output):
        if current.config is not None:
            module._internal_dict, current.config = current.config, None

    def before_block(block, args, kwargs):
        if current.spec is None:
            return None
        if len(args) > _MASK_AT:  # diffusers passes the blocks' arguments by position
            if args[_MASK_AT] is None:
                return (*args[:_MASK_AT], current.spec, *args[_MASK_AT + 1 :]), kwargs
        elif kwargs.get("attention_mask") is None:
            return args, {**kwargs, "attention_mask": current.spec}
        return None

    handles = [
        model.register_forward_pre_hook(before_forward, with_kwargs=True),
        model.register_forward_hook(after_forward, with_kwargs=True, always_call=True),
    ]
    handles += [block.register_forward_pre_hook(before_block, with_kwargs=True) for block in model.blocks]
    return handles


# SkyReelsV2TransformerBlock.forward(hidden_states, encoder_hidden_states, temb, rotary_emb, attention_mask)
_MASK_AT = 4

SKYREELS = PlanEntry(
    "SkyReelsV2Transformer3DModel",
    _skyreels_plan,
    needs="gathers with parameters after them",
    install=_install_block_causal,
    head_tail=True,
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
    return _df_video(model, g, batch, frames, h, tokens // frames // h, text_tokens, dtype)


def _blocks_inputs(frame_tokens: int):
    """Diffusion forcing over ``tokens // frame_tokens`` frames of ``1 x frame_tokens`` tokens, in causal blocks of
    ``num_frame_per_block`` frames: the one-process reference, diffusers' own forward, needs whole blocks."""

    def inputs(model, g, batch, tokens, text_tokens, dtype):
        frames, per_block = tokens // frame_tokens, model.config.num_frame_per_block
        if tokens % frame_tokens or frames % per_block:
            raise ValueError(
                f"{tokens} tokens are not whole blocks of {per_block} frames of {frame_tokens} tokens (diffusers' "
                "SkyReels-V2 crashes on a shorter tail block); pass a multiple of "
                f"{per_block * frame_tokens} tokens."
            )
        return _df_video(model, g, batch, frames, 1, frame_tokens, text_tokens, dtype)

    return inputs


def _df_video(model, g, batch, frames, h, w, text_tokens, dtype):
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
    # num_frame_per_block > 1: the block-causal mask as a spec (blocks of 2 frames need an even frame count, 21
    # tokens have none: 10 frames x 3 tokens, which cp 4 does not divide; blocks of 3: 21 frames x 1 token)
    TinyCase(
        "skyreels-v2-df-block2",
        "SkyReelsV2Transformer3DModel",
        _wan_config(num_layers=2, num_frame_per_block=2),
        _blocks_inputs(3),
        note="diffusion forcing with causal blocks of 2 latent frames (10 frames x 3 tokens): the block-causal "
        "mask as a mask spec, never an S x S tensor",
        tokens=30,
    ),
    TinyCase(
        "skyreels-v2-df-block3",
        "SkyReelsV2Transformer3DModel",
        _wan_config(num_layers=2, num_frame_per_block=3),
        _blocks_inputs(1),
        note="diffusion forcing with causal blocks of 3 latent frames (21 frames x 1 token), as a mask spec",
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

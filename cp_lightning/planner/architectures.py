"""Built-in full-size transformer configs for the planner (no download) and what it needs to know about each.

The configs are the diffusers ``transformer/config.json`` values as published for each model (the same as
``configs/architectures/*.json``, which tests/test_planner.py checks). :func:`resolve_model` also takes a path
to a diffusers ``config.json`` (or the folder holding it) of a class that one of the families below knows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

_WAN = dict(
    _class_name="WanTransformer3DModel",
    patch_size=[1, 2, 2],
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-06,
    image_dim=None,
    added_kv_proj_dim=None,
    rope_max_seq_len=1024,
)
_WAN_14B = dict(_WAN, num_attention_heads=40, ffn_dim=13824, num_layers=40)

CONFIGS: dict[str, dict] = {
    "wan2.1-t2v-1.3b": dict(_WAN, num_attention_heads=12, ffn_dim=8960, num_layers=30),
    "wan2.1-t2v-14b": _WAN_14B,
    "wan2.2-ti2v-5b": dict(_WAN, num_attention_heads=24, in_channels=48, out_channels=48, ffn_dim=14336, num_layers=30),
    # one expert (high- or low-noise): the recipes train one expert per run
    "wan2.2-t2v-a14b": dict(_WAN_14B),
    "hunyuanvideo": dict(
        _class_name="HunyuanVideoTransformer3DModel",
        attention_head_dim=128,
        guidance_embeds=True,
        in_channels=16,
        mlp_ratio=4.0,
        num_attention_heads=24,
        num_layers=20,
        num_refiner_layers=2,
        num_single_layers=40,
        out_channels=16,
        patch_size=2,
        patch_size_t=1,
        pooled_projection_dim=768,
        qk_norm="rms_norm",
        rope_axes_dim=[16, 56, 56],
        rope_theta=256.0,
        text_embed_dim=4096,
    ),
    "flux.1-dev": dict(
        _class_name="FluxTransformer2DModel",
        patch_size=1,
        in_channels=64,
        out_channels=None,
        num_layers=19,
        num_single_layers=38,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=4096,
        pooled_projection_dim=768,
        guidance_embeds=True,
        axes_dims_rope=[16, 56, 56],
    ),
    "qwen-image": dict(
        _class_name="QwenImageTransformer2DModel",
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=60,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=3584,
        guidance_embeds=False,
        axes_dims_rope=[16, 56, 56],
    ),
}
ALIASES = {"flux1-dev": "flux.1-dev", "qwenimage": "qwen-image", "hunyuanvideo-t2v": "hunyuanvideo"}


@dataclass(frozen=True)
class Family:
    """What the planner needs to know about a diffusers class beyond its config."""

    cls: str
    layer_keys: tuple[str, ...]  # config keys counting each kind of repeated block
    block_lists: tuple[str, ...]  # the ModuleLists holding those blocks (same order)
    joint: bool  # text tokens go through joint attention and are split by CP with the image tokens
    text_tokens: int  # the recipes' default text length
    lora_targets: tuple[str, ...]
    case: str  # the tiny case of cp_lightning.models whose inputs fit this class
    per_token_timestep: bool = False


_ATTN = ("to_q", "to_k", "to_v", "to_out.0")
_JOINT = (*_ATTN, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
FAMILIES: dict[str, Family] = {
    "WanTransformer3DModel": Family("WanTransformer3DModel", ("num_layers",), ("blocks",), False, 512, _ATTN, "wan2.1"),
    # SkyReels-V2 diffusion forcing: Wan's layout, one timestep per latent frame (per-token block modulation)
    "SkyReelsV2Transformer3DModel": Family(
        "SkyReelsV2Transformer3DModel", ("num_layers",), ("blocks",), False, 512, _ATTN, "skyreels-v2-df", True
    ),
    "HunyuanVideoTransformer3DModel": Family(
        "HunyuanVideoTransformer3DModel",
        ("num_layers", "num_single_layers"),
        ("transformer_blocks", "single_transformer_blocks"),
        True,
        256,
        _JOINT,
        "hunyuanvideo",
    ),
    "FluxTransformer2DModel": Family(
        "FluxTransformer2DModel",
        ("num_layers", "num_single_layers"),
        ("transformer_blocks", "single_transformer_blocks"),
        True,
        512,
        _JOINT,
        "flux",
    ),
    "QwenImageTransformer2DModel": Family(
        "QwenImageTransformer2DModel", ("num_layers",), ("transformer_blocks",), True, 512, _JOINT, "qwenimage"
    ),
}


@dataclass(frozen=True)
class ModelSpec:
    """A full-size config and its family; ``name`` is the built-in name or the config's path."""

    name: str
    config: dict = field(hash=False)
    family: Family

    @property
    def heads(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def hidden(self) -> int:
        return self.heads * int(self.config["attention_head_dim"])

    @property
    def layers(self) -> dict[str, int]:
        return {k: int(self.config[k]) for k in self.family.layer_keys}


def resolve_model(name_or_config: str) -> ModelSpec:
    """A :class:`ModelSpec` from a built-in name (see :data:`CONFIGS`) or a diffusers ``config.json`` path."""
    key = ALIASES.get(name_or_config.lower(), name_or_config.lower())
    if key in CONFIGS:
        config = dict(CONFIGS[key])
        # Wan2.2 TI2V-5B trains with the first latent frame clean (per-token timesteps)
        family = FAMILIES[config["_class_name"]]
        if key == "wan2.2-ti2v-5b":
            family = Family(**{**family.__dict__, "case": "wan2.2-ti2v", "per_token_timestep": True})
        return ModelSpec(key, config, family)
    path = Path(name_or_config)
    if path.is_dir():
        path = path / "config.json"
    if not (path.suffix == ".json" and path.is_file()):
        raise ValueError(
            f"unknown model {name_or_config!r}: use a built-in name ({', '.join(sorted(CONFIGS))}) or the path of a "
            "diffusers transformer config.json."
        )
    config = json.loads(path.read_text())
    cls = config.get("_class_name")
    if cls not in FAMILIES:
        raise ValueError(
            f"{path}: the planner knows the classes {', '.join(sorted(FAMILIES))}, not {cls!r} (its block layout and "
            "inputs are needed to trace activations)."
        )
    return ModelSpec(str(path), config, FAMILIES[cls])

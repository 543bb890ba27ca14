"""What the planner reads from a recipe YAML: the model, the buckets and the layout, with no process launched.

The buckets come from the recipe's data module scanning ``data.data_dir`` (the dry run's scan,
``EncodedData.plan``) with the VAE and patch geometry of the built-in model instead of the pipeline's files,
so a hub id needs no download; without the folder, the recipe's one ``resolution x width x num_frames``
bucket stands in (and the result says so). The scan is the recipes' (``recipes.plan_buckets.scan_buckets``),
found through the ``cp_lightning.planner`` entry point ``buckets`` that pyproject.toml declares: the library
never imports the recipes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

HUB = {
    "wan-ai/wan2.1-t2v-1.3b-diffusers": "wan2.1-t2v-1.3b",
    "wan-ai/wan2.1-t2v-14b-diffusers": "wan2.1-t2v-14b",
    "wan-ai/wan2.2-ti2v-5b-diffusers": "wan2.2-ti2v-5b",
    "wan-ai/wan2.2-t2v-a14b-diffusers": "wan2.2-t2v-a14b",
    "hunyuanvideo-community/hunyuanvideo": "hunyuanvideo",
    "black-forest-labs/flux.1-dev": "flux.1-dev",
    "qwen/qwen-image": "qwen-image",
}
# (pixels per latent token side, frames per latent frame, latent frames per token) of the built-in models
GEOMETRY = {
    "WanTransformer3DModel": (16, 4, 1),
    "SkyReelsV2Transformer3DModel": (16, 4, 1),
    "HunyuanVideoTransformer3DModel": (16, 4, 1),
    "FluxTransformer2DModel": (16, 1, 1),
    "QwenImageTransformer2DModel": (16, 1, 1),
}
GEOMETRY_TI2V = (32, 4, 1)  # Wan2.2 TI2V-5B's VAE compresses 16x spatially
FAMILY_OF = {
    "WanTransformer3DModel": "wan",
    "SkyReelsV2Transformer3DModel": "wan",  # Wan's layout and data; the recipe is recipes.skyreels_df
    "HunyuanVideoTransformer3DModel": "hunyuan",
    "FluxTransformer2DModel": "flux",
    "QwenImageTransformer2DModel": "qwenimage",
}


@dataclass
class Recipe:
    model: str  # a built-in name or a config.json path
    tokens: list[int]
    text_tokens: int
    batch: int
    gpus: int
    nodes: int
    cp: int | str | None
    ring: int
    fsdp: str
    hsdp: bool
    checkpointing: bool
    lora_rank: int
    weights_dtype: str
    ema: bool
    base_dtype: str | None = None  # model.base_dtype: a float8 frozen base (LoRA), else weights_dtype holds it
    offload: bool = False  # model.activation_offload or the strategy's
    buckets: list[dict] = field(default_factory=list)
    note: str = ""


def _model_of(pretrained: str) -> str:
    if pretrained.lower() in HUB:
        return HUB[pretrained.lower()]
    path = Path(pretrained) / "transformer" / "config.json"
    if path.is_file():
        return str(path)
    raise ValueError(
        f"model.pretrained {pretrained!r} is neither a known hub id ({', '.join(sorted(HUB))}) nor a local pipeline "
        "folder with transformer/config.json: pass --model NAME_OR_CONFIG instead."
    )


def read_recipe(path: str | Path, model: str | None = None) -> Recipe:
    """The planner's inputs from a recipe YAML (``model`` overrides the recipe's ``model.pretrained``)."""
    import yaml

    from cp_lightning.planner.architectures import resolve_model

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config {path}: no such file.")
    cfg = yaml.safe_load(path.read_text()) or {}
    trainer, mod, data = cfg.get("trainer", {}), cfg.get("model", {}), cfg.get("data", {})
    strategy = (trainer.get("strategy") or {}).get("init_args", {}) if isinstance(trainer.get("strategy"), dict) else {}
    name = model or _model_of(str(mod.get("pretrained", data.get("pretrained", "tiny"))))
    spec = resolve_model(name)
    cls = spec.family.cls
    if cls not in FAMILY_OF:
        raise ValueError(f"{path}: the recipes train Flux, QwenImage, Wan and HunyuanVideo, not {cls}.")
    geometry = GEOMETRY_TI2V if spec.name == "wan2.2-ti2v-5b" else GEOMETRY[cls]
    buckets, note = _buckets(FAMILY_OF[cls], data, geometry, spec.family.text_tokens)
    devices = trainer.get("devices", 1)
    nodes = int(trainer.get("num_nodes", 1))
    batch = data.get("batch_size", 1)
    return Recipe(
        model=name,
        tokens=[b["tokens_per_sample"] - b.get("text_tokens", 0) for b in buckets],
        text_tokens=int(data.get("max_sequence_length", spec.family.text_tokens)),
        batch=1 if batch == "auto" else int(batch),
        gpus=int(devices) * nodes if isinstance(devices, int) else nodes,
        nodes=nodes,
        cp=strategy.get("cp"),
        ring=int(strategy.get("ring", 1)),
        fsdp="on" if strategy.get("fsdp") else "off",
        hsdp=bool(strategy.get("hsdp", False)),
        checkpointing=bool(mod.get("gradient_checkpointing", False)),
        lora_rank=int(mod.get("lora_rank", 4)),
        weights_dtype=str(mod.get("weights_dtype", "float32")),
        ema=bool(mod.get("ema_decay", 0.0)),
        base_dtype=mod.get("base_dtype"),
        offload=bool(mod.get("activation_offload", False) or strategy.get("activation_offload", False)),
        buckets=buckets,
        note=note,
    )


def _buckets(family: str, data: dict, geometry: tuple[int, int, int], text_tokens: int) -> tuple[list[dict], str]:
    """The recipe's buckets: its data module's scan of ``data.data_dir`` when a scanner is installed (the
    ``cp_lightning.planner`` entry point ``buckets``, which the recipes provide), else the YAML's one bucket."""
    scan = _scanner()
    if scan is not None:
        return scan(family, data, geometry)
    if "resolution" not in data:
        raise ValueError(
            "no bucket scanner is installed (the recipes register one: run from the repository, where "
            "`pip install -e .` made it known) and the YAML's data section names no resolution: give --model and "
            "--tokens instead of --config."
        )
    multiple, temporal, patch_t = geometry
    h = int(data["resolution"])
    w = int(data.get("width") or h)
    frames = int(data.get("num_frames", 1)) if family in ("wan", "hunyuan") else 1
    latent_frames = ((frames - 1) // temporal + 1) // patch_t
    split = latent_frames * (h // multiple) * (w // multiple)
    text = int(data.get("max_sequence_length", text_tokens)) if family != "wan" else 0
    row = {"bucket": f"{frames}x{h}x{w}", "tokens_per_sample": split + text, "text_tokens": text}
    return [row], f"planned for the recipe's {frames}x{h}x{w} bucket (no bucket scanner installed: data_dir not read)"


def _scanner():
    """The installed bucket scanner, or None (the library does not import the recipes; they register it)."""
    from importlib.metadata import entry_points

    for point in entry_points(group="cp_lightning.planner", name="buckets"):
        try:
            return point.load()
        except ImportError:  # the recipes are not importable from here (another working directory)
            return None
    return None

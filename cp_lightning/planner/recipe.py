"""What the planner reads from a recipe YAML: the model, the buckets and the layout, with no process launched.

The buckets come from the recipe's data module scanning ``data.data_dir`` (the dry run's scan,
``EncodedData.plan``) with the VAE and patch geometry of the built-in model instead of the pipeline's files,
so a hub id needs no download; without the folder, the recipe's one ``resolution x width x num_frames``
bucket stands in (and the result says so).
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
    "HunyuanVideoTransformer3DModel": (16, 4, 1),
    "FluxTransformer2DModel": (16, 1, 1),
    "QwenImageTransformer2DModel": (16, 1, 1),
}
GEOMETRY_TI2V = (32, 4, 1)  # Wan2.2 TI2V-5B's VAE compresses 16x spatially
FAMILY_OF = {
    "WanTransformer3DModel": "wan",
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
    buckets, note = _buckets(FAMILY_OF[cls], data, geometry)
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
        buckets=buckets,
        note=note,
    )


def _buckets(family: str, data: dict, geometry: tuple[int, int, int]) -> tuple[list[dict], str]:
    from recipes import data as recipe_data

    cls = {
        "wan": recipe_data.WanData,
        "hunyuan": recipe_data.HunyuanData,
        "flux": recipe_data.FluxData,
        "qwenimage": recipe_data.QwenImageData,
    }[family]
    kwargs = {k: v for k, v in data.items() if k not in ("dry_run",)}
    if kwargs.get("batch_size") == "auto":
        kwargs["batch_size"] = 1
    module = cls(**kwargs)
    module.geometry = lambda: geometry  # the built-in model's geometry: no pipeline files needed
    text = module.hparams.max_sequence_length
    if not Path(module.data_dir).exists():
        multiple, temporal, patch_t = geometry
        h = module.hparams.resolution
        w = module.hparams.width or h
        frames = getattr(module, "num_frames", 1)
        latent_frames = ((frames - 1) // temporal + 1) // patch_t
        split = latent_frames * (h // multiple) * (w // multiple)
        joint = family != "wan"
        row = {"bucket": f"{frames}x{h}x{w}", "tokens_per_sample": split + (text if joint else 0)}
        row["text_tokens"] = text if joint else 0
        return [row], f"data_dir {module.data_dir} not found: planned for the recipe's {frames}x{h}x{w} bucket"
    module.plan(cp=1)
    rows = module.table
    for row in rows:
        split, t = module.tokens(_Bucket(row))
        row["text_tokens"] = t
    return rows, f"{len(rows)} buckets from {module.data_dir}"


class _Bucket:
    def __init__(self, row: dict) -> None:
        self.frames, self.height, self.width = row["frames"], row["height"], row["width"]

"""The recipes' bucket scan for the layout planner: ``python -m cp_lightning.plan --config RECIPE.yaml`` finds
:func:`scan_buckets` through the ``cp_lightning.planner`` entry point that pyproject.toml declares (the library
never imports the recipes), and plans for the buckets the recipe's data module would make of ``data_dir``.
"""

from __future__ import annotations

from pathlib import Path

from recipes import data as recipe_data
from recipes.encoded import _Bucket


def scan_buckets(family: str, data: dict, geometry: tuple[int, int, int]) -> tuple[list[dict], str]:
    """The layout planner's buckets for a recipe YAML's ``data`` section (``python -m cp_lightning.plan --config``,
    which finds this function through the ``cp_lightning.planner`` entry point in pyproject.toml): the data
    module scans ``data_dir`` with the built-in model's ``geometry`` (no pipeline files); without the folder,
    the recipe's one ``resolution x width x num_frames`` bucket stands in. Returns (rows, a note)."""
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

"""Data for the recipes: image folders with captions -> a cached HF dataset of latents and text embeddings.

Input: a folder in the ``imagefolder`` convention (images plus ``metadata.jsonl`` lines
``{"file_name": ..., "text": ...}``), or a dataset saved with ``datasets.save_to_disk`` with ``image``
and ``text`` columns. ``prepare`` validates every item (a missing caption, an unreadable image or an
empty folder is an error naming the file), encodes latents with the VAE and text with the pipeline's
text encoders once, and writes the cache atomically, so an interrupted prepare leaves nothing behind
and can simply be rerun. Training then reads only tensors.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import lightning as L
import torch
from PIL import Image, ImageDraw
from torch.utils.data import DataLoader, DistributedSampler
from tqdm.auto import tqdm

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square", "triangle")


def make_shapes(folder: str | Path, n: int, size: int = 32, seed: int = 0) -> Path:
    """Write ``n`` images of one coloured shape each, captioned by what they show, in imagefolder layout."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        image = Image.new("RGB", (size, size), (245, 245, 240))
        draw = ImageDraw.Draw(image)
        r = rng.randint(size // 5, size // 3)
        cx, cy = rng.randint(r, size - r), rng.randint(r, size - r)
        box = (cx - r, cy - r, cx + r, cy + r)
        if shape == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        elif shape == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLOURS[colour])
        name = f"{i:05d}.png"
        image.save(folder / name)
        lines.append(json.dumps({"file_name": name, "text": f"a {colour} {shape}"}))
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def read_items(source: str | Path, caption_column: str = "text") -> list[tuple[str, Image.Image, str]]:
    """(name, RGB image, caption) for every item; raises ValueError naming the first bad one."""
    source = Path(source)
    if (source / "dataset_info.json").exists() or (source / "state.json").exists():
        import datasets

        ds = datasets.load_from_disk(str(source))
        if len(ds) == 0:
            raise ValueError(f"the dataset saved at {source} is empty.")
        items = []
        for i, row in enumerate(ds):
            if not row.get(caption_column):
                raise ValueError(f"item {i} of the dataset at {source} has no caption in column {caption_column!r}.")
            items.append((f"{source}[{i}]", row["image"].convert("RGB"), row[caption_column]))
        return items
    metadata = source / "metadata.jsonl"
    if not source.is_dir() or not metadata.exists():
        raise ValueError(
            f"{source} is not an image folder with captions: it needs images and a metadata.jsonl with lines "
            '{"file_name": "img.png", "text": "a caption"} (or pass a dataset saved with save_to_disk).'
        )
    rows = [json.loads(line) for line in metadata.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"the image folder {source} is empty: {metadata} lists no images.")
    items = []
    for row in rows:
        path = source / row.get("file_name", "")
        caption = row.get(caption_column)
        if not caption or not isinstance(caption, str):
            raise ValueError(f"{path} has no caption ({caption_column!r} missing or empty in {metadata}).")
        try:
            with Image.open(path) as image:
                items.append((str(path), image.convert("RGB"), caption))
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot read image {path}: {err}") from None
    return items


def _to_tensor(image: Image.Image, resolution: int, name: str, multiple: int) -> torch.Tensor:
    if resolution % multiple != 0:
        raise ValueError(
            f"resolution {resolution} does not fit the model: it must be a multiple of {multiple} "
            "(VAE downsampling x the transformer's 2x2 patches)."
        )
    if image.size != (resolution, resolution):
        image = image.resize((resolution, resolution), Image.BICUBIC)
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(resolution, resolution, 3)
    return pixels.permute(2, 0, 1).float() / 127.5 - 1.0  # C, H, W in [-1, 1]


@torch.no_grad()
def prepare(
    source, cache: str | Path, pipeline, resolution: int, max_sequence_length: int, batch_size: int = 8
) -> Path:
    """Encode every item once (VAE latents, T5 and CLIP embeddings) into a datasets cache at ``cache``."""
    import datasets

    cache = Path(cache)
    multiple = pipeline.vae_scale_factor * 2
    items = read_items(source)
    latents, prompt_embeds, pooled = [], [], []
    for start in tqdm(range(0, len(items), batch_size), desc="prepare: encoding", unit="batch"):
        chunk = items[start : start + batch_size]
        pixels = torch.stack([_to_tensor(image, resolution, name, multiple) for name, image, _ in chunk])
        dist = pipeline.vae.encode(pixels.to(pipeline.vae.dtype)).latent_dist
        z = (dist.mode() - pipeline.vae.config.shift_factor) * pipeline.vae.config.scaling_factor
        embeds, pooled_embeds, _ = pipeline.encode_prompt(
            [caption for _, _, caption in chunk], prompt_2=None, max_sequence_length=max_sequence_length
        )
        latents += list(z.float())
        prompt_embeds += list(embeds.float())
        pooled += list(pooled_embeds.float())
    table = datasets.Dataset.from_dict(
        {
            "latents": [t.numpy() for t in latents],
            "prompt_embeds": [t.numpy() for t in prompt_embeds],
            "pooled_prompt_embeds": [t.numpy() for t in pooled],
            "caption": [caption for _, _, caption in items],
        }
    )
    tmp = cache.with_name(cache.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    table.save_to_disk(str(tmp))
    shutil.rmtree(cache, ignore_errors=True)
    tmp.rename(cache)  # only a complete cache ever appears under its final name
    return cache


class IndexedDataset(torch.utils.data.Dataset):
    """The cached dataset as tensors, each item carrying its index (it seeds the item's noise)."""

    def __init__(self, cache: str | Path):
        import datasets

        self.table = datasets.load_from_disk(str(cache)).with_format("torch")

    def __len__(self):
        return len(self.table)

    def __getitem__(self, index):
        row = self.table[index]
        return {key: row[key] for key in ("latents", "prompt_embeds", "pooled_prompt_embeds")} | {"index": index}


class FluxData(L.LightningDataModule):
    """Image folder -> cached latents and embeddings -> batches.

    Args:
        image_dir: imagefolder-style folder, or a dataset saved with ``save_to_disk``.
        cache_dir: where the encoded cache (and the tiny pipeline, for ``pretrained: tiny``) lives.
        pretrained: the pipeline whose VAE and text encoders encode the data (``tiny`` or a path / hub id).
        resolution: square training resolution in pixels.
        batch_size: samples per data-parallel rank and step.
        synthetic_samples: if > 0 and ``image_dir`` does not exist, generate this many shape images there.
        max_sequence_length: T5 tokens per caption.
        seed: shuffling seed.
    """

    def __init__(
        self,
        image_dir: str = "outputs/data/shapes",
        cache_dir: str = "outputs/cache",
        pretrained: str = "tiny",
        resolution: int = 32,
        batch_size: int = 4,
        synthetic_samples: int = 0,
        max_sequence_length: int = 32,
        seed: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        tag = f"{Path(image_dir).name}-{Path(str(pretrained)).name}-{resolution}px-{max_sequence_length}tok"
        self.cache = Path(cache_dir) / "encoded" / tag
        self.dataset = None

    def prepare_data(self) -> None:
        h = self.hparams
        if h.synthetic_samples > 0 and not Path(h.image_dir).exists():
            make_shapes(h.image_dir, h.synthetic_samples, size=h.resolution, seed=h.seed)
        if not self.cache.exists():
            from recipes.flux_components import load_pipeline

            pipeline = load_pipeline(h.pretrained, h.cache_dir)
            prepare(h.image_dir, self.cache, pipeline, h.resolution, h.max_sequence_length)

    def setup(self, stage: str) -> None:
        self.dataset = IndexedDataset(self.cache)

    def train_dataloader(self) -> DataLoader:
        # One sampler for every layout: sized by the strategy (dp ranks under CP), one replica otherwise.
        kwargs = (self.trainer.distributed_sampler_kwargs if self.trainer else None) or {"num_replicas": 1, "rank": 0}
        sampler = DistributedSampler(self.dataset, shuffle=True, seed=self.hparams.seed, drop_last=True, **kwargs)
        return DataLoader(self.dataset, batch_size=self.hparams.batch_size, sampler=sampler, drop_last=True)

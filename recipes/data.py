"""Data for the recipes: image or video folders with captions -> a cached HF dataset of latents and text.

Input: a folder in the ``imagefolder`` convention (media plus ``metadata.jsonl`` lines
``{"file_name": ..., "text": ...}``; a file name may be an image, an animated GIF, or a folder of frame
images for a video), or a dataset saved with ``datasets.save_to_disk`` with ``image`` and ``text``
columns. ``prepare`` validates every item (a missing caption, an unreadable image or an
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
from PIL import Image, ImageDraw, ImageSequence
from torch.utils.data import DataLoader, DistributedSampler
from tqdm.auto import tqdm

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square", "triangle")


def _draw(size: int, colour: str, shape: str, cx: int, cy: int, r: int) -> Image.Image:
    image = Image.new("RGB", (size, size), (245, 245, 240))
    draw = ImageDraw.Draw(image)
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        draw.ellipse(box, fill=COLOURS[colour])
    elif shape == "square":
        draw.rectangle(box, fill=COLOURS[colour])
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLOURS[colour])
    return image


def make_shapes(folder: str | Path, n: int, size: int = 32, seed: int = 0, frames: int = 1) -> Path:
    """Write ``n`` captioned items in imagefolder layout: one coloured shape each, as a still image
    (``frames == 1``) or as an animated GIF of the shape moving to the right."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        r = rng.randint(size // 5, size // 3)
        cx, cy = rng.randint(r, size - r), rng.randint(r, size - r)
        if frames == 1:
            name, caption = f"{i:05d}.png", f"a {colour} {shape}"
            _draw(size, colour, shape, cx, cy, r).save(folder / name)
        else:
            name, caption = f"{i:05d}.gif", f"a {colour} {shape} moving right"
            step = max(1, (size - 2 * r) // frames)
            clip = [_draw(size, colour, shape, min(size - r, r + k * step), cy, r) for k in range(frames)]
            clip[0].save(folder / name, save_all=True, append_images=clip[1:], duration=100, loop=0)
        lines.append(json.dumps({"file_name": name, "text": caption}))
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _frames(path: Path) -> list[Image.Image]:
    """An image -> [it]; an animated image -> its frames; a folder -> its images in name order."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp"))
        if not files:
            raise ValueError(f"the frame folder {path} holds no images.")
        return [frame for file in files for frame in _frames(file)]
    with Image.open(path) as image:
        return [frame.convert("RGB") for frame in ImageSequence.Iterator(image)]


def read_items(source: str | Path, caption_column: str = "text") -> list[tuple[str, list[Image.Image], str]]:
    """(name, RGB frames, caption) for every item; raises ValueError naming the first bad one."""
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
            items.append((f"{source}[{i}]", [row["image"].convert("RGB")], row[caption_column]))
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
            items.append((str(path), _frames(path), caption))
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot read image {path}: {err}") from None
    return items


def _to_tensor(frames: list[Image.Image], height: int, width: int, num_frames: int, name: str) -> torch.Tensor:
    """F, C, H, W in [-1, 1]: the first ``num_frames`` frames, resized to ``height`` x ``width``."""
    if len(frames) < num_frames:
        raise ValueError(f"{name} has {len(frames)} frames; the recipe trains on clips of {num_frames}.")
    out = []
    for image in frames[:num_frames]:
        if image.size != (width, height):
            image = image.resize((width, height), Image.BICUBIC)
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(height, width, 3)
        out.append(pixels.permute(2, 0, 1).float() / 127.5 - 1.0)  # H, W, C -> C, H, W
    return torch.stack(out)


def flux_encoder(pipeline, max_sequence_length: int):
    """Images -> Flux latents (C, h, w) and T5 + CLIP caption embeddings."""

    def encode(pixels: torch.Tensor, captions: list[str]) -> dict[str, list]:
        x = pixels[:, 0].to(pipeline.vae.dtype)  # B, 1, C, H, W -> B, C, H, W
        z = pipeline.vae.encode(x).latent_dist.mode()
        z = (z - pipeline.vae.config.shift_factor) * pipeline.vae.config.scaling_factor
        embeds, pooled, _ = pipeline.encode_prompt(captions, prompt_2=None, max_sequence_length=max_sequence_length)
        return {
            "latents": list(z.float()),
            "prompt_embeds": list(embeds.float()),
            "pooled_prompt_embeds": list(pooled.float()),
        }

    return encode


def wan_encoder(pipeline, max_sequence_length: int):
    """Clips -> Wan latents (C, f, h, w), normalised as the pipeline expects, and UMT5 caption embeddings."""

    def encode(pixels: torch.Tensor, captions: list[str]) -> dict[str, list]:
        x = pixels.permute(0, 2, 1, 3, 4).to(pipeline.vae.dtype)  # B, F, C, H, W -> B, C, F, H, W
        z = pipeline.vae.encode(x).latent_dist.mode()
        mean = torch.tensor(pipeline.vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(pipeline.vae.config.latents_std).view(1, -1, 1, 1, 1)
        z = (z - mean) / std
        embeds, _ = pipeline.encode_prompt(
            captions, do_classifier_free_guidance=False, max_sequence_length=max_sequence_length
        )
        return {"latents": list(z.float()), "prompt_embeds": list(embeds.float())}

    return encode


@torch.no_grad()
def prepare(
    source,
    cache: str | Path,
    encode,
    resolution: int,
    multiple: int,
    num_frames: int = 1,
    batch_size: int = 8,
    width: int | None = None,
) -> Path:
    """Encode every item once with ``encode`` into a datasets cache at ``cache``, atomically.

    Items are resized to ``resolution`` x ``width`` pixels (height x width; square without ``width``).
    """
    import datasets

    width = width or resolution
    for side in (resolution, width):
        if side % multiple != 0:
            raise ValueError(
                f"resolution {side} does not fit the model: it must be a multiple of {multiple} "
                "(VAE downsampling x the transformer's 2x2 patches)."
            )
    cache = Path(cache)
    items = read_items(source)
    columns: dict[str, list] = {}
    for start in tqdm(range(0, len(items), batch_size), desc="prepare: encoding", unit="batch"):
        chunk = items[start : start + batch_size]
        pixels = torch.stack([_to_tensor(frames, resolution, width, num_frames, name) for name, frames, _ in chunk])
        for key, values in encode(pixels, [caption for _, _, caption in chunk]).items():
            columns.setdefault(key, []).extend(v.numpy() for v in values)
    columns["caption"] = [caption for _, _, caption in items]
    table = datasets.Dataset.from_dict(columns)
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
        return {key: value for key, value in row.items() if key != "caption"} | {"index": index}


class EncodedData(L.LightningDataModule):
    """Media folder -> cached latents and embeddings -> batches (the family's subclass says how to encode).

    Args:
        image_dir: imagefolder-style folder, or a dataset saved with ``save_to_disk``.
        cache_dir: where the encoded cache (and the tiny pipeline, for ``pretrained: tiny``) lives.
        pretrained: the pipeline whose VAE and text encoders encode the data (``tiny`` or a path / hub id).
        resolution: training height in pixels (and width, unless ``width`` is given).
        width: training width in pixels, for non-square data.
        batch_size: samples per data-parallel rank and step.
        synthetic_samples: if > 0 and ``image_dir`` does not exist, generate this many captioned shapes there.
        max_sequence_length: text tokens per caption.
        seed: shuffling seed.
    """

    family = ""
    num_frames = 1

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
        width: int | None = None,
    ):
        super().__init__()
        self.save_hyperparameters()
        name = f"{Path(image_dir).name}-{Path(str(pretrained)).name}"
        tag = f"{name}-{resolution}x{width or resolution}px-{self.num_frames}f-{max_sequence_length}tok"
        self.cache = Path(cache_dir) / "encoded" / self.family / tag
        self.dataset = None

    def encoder(self, pipeline):
        raise NotImplementedError

    def prepare_data(self) -> None:
        from recipes.components import load_pipeline

        h = self.hparams
        if h.synthetic_samples > 0 and not Path(h.image_dir).exists():
            make_shapes(h.image_dir, h.synthetic_samples, size=h.resolution, seed=h.seed, frames=self.num_frames)
        if not self.cache.exists():
            pipeline = load_pipeline(self.family, h.pretrained, h.cache_dir)
            multiple = pipeline.vae_scale_factor * 2 if self.family == "flux" else pipeline.vae_scale_factor_spatial * 2
            prepare(
                h.image_dir, self.cache, self.encoder(pipeline), h.resolution, multiple, self.num_frames, width=h.width
            )

    def setup(self, stage: str) -> None:
        self.dataset = IndexedDataset(self.cache)

    def train_dataloader(self) -> DataLoader:
        # One sampler for every layout: sized by the strategy (dp ranks under CP), one replica otherwise.
        kwargs = (self.trainer.distributed_sampler_kwargs if self.trainer else None) or {"num_replicas": 1, "rank": 0}
        sampler = DistributedSampler(self.dataset, shuffle=True, seed=self.hparams.seed, drop_last=True, **kwargs)
        return DataLoader(self.dataset, batch_size=self.hparams.batch_size, sampler=sampler, drop_last=True)


class FluxData(EncodedData):
    __doc__ = EncodedData.__doc__
    family = "flux"

    def encoder(self, pipeline):
        return flux_encoder(pipeline, self.hparams.max_sequence_length)


class WanData(EncodedData):
    """Video clips (animated GIFs or frame folders) for Wan; see :class:`EncodedData` for the arguments.

    Args:
        num_frames: frames per clip (Wan's VAE wants 4k+1 for its temporal compression).
    """

    family = "wan"

    def __init__(
        self,
        image_dir: str = "outputs/data/moving_shapes",
        cache_dir: str = "outputs/cache",
        pretrained: str = "tiny",
        resolution: int = 32,
        num_frames: int = 4,
        batch_size: int = 2,
        synthetic_samples: int = 0,
        max_sequence_length: int = 32,
        seed: int = 0,
        width: int | None = None,
    ):
        self.num_frames = num_frames
        super().__init__(
            image_dir,
            cache_dir,
            pretrained,
            resolution,
            batch_size,
            synthetic_samples,
            max_sequence_length,
            seed,
            width,
        )
        self.save_hyperparameters()

    def encoder(self, pipeline):
        return wan_encoder(pipeline, self.hparams.max_sequence_length)

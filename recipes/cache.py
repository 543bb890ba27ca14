"""The encoded-data cache: one file per sample, keyed by a fingerprint of everything that shaped it.

A sample's key hashes its file (relative path, size, mtime; or dataset fingerprint and row), its
caption, its clip and bucket, the crop, the model (its id plus the encoders' config files and weight
file sizes/mtimes) and every encoding option. Editing a caption or an image changes that sample's key
only, so a rerun encodes just what changed; a stale latent is never reused. Each entry and the index
are written to a temporary name and renamed, so an interrupted encode leaves only complete entries
(and no index) behind. :func:`encode_entries` splits the missing entries over all ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from recipes.media import load_frames, to_pixels

EMPTY = "empty_caption"


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


ENCODERS = ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")


def model_fingerprint(path: str) -> str:
    """The model id plus, for a local checkpoint, its encoders' (VAE, text encoders, tokenizers) config
    files and their weights' sizes and mtimes; the transformer's files do not shape the cache."""
    parts: list = [str(path)]
    root = Path(path)
    if root.is_dir():
        for p in sorted(q for name in ENCODERS for q in (root / name).rglob("*")):
            if p.is_file() and p.suffix == ".json":
                parts.append((str(p.relative_to(root)), p.read_text()))
            elif p.is_file():
                stat = p.stat()
                parts.append((str(p.relative_to(root)), stat.st_size, stat.st_mtime_ns))
    return digest(parts)


def atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, path)  # only a complete entry ever appears under its name
    finally:
        tmp.unlink(missing_ok=True)  # an interrupted write leaves no half file either


def atomic_write_text(text: str, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def flux_encoder(pipeline, max_sequence_length: int):
    """Pixels (B, 1, C, H, W) -> Flux latents (B, C, h, w); captions -> T5 and CLIP embeddings."""

    def latents(pixels: torch.Tensor) -> torch.Tensor:
        x = pixels[:, 0].to(pipeline.vae.device, pipeline.vae.dtype)  # B, 1, C, H, W -> B, C, H, W
        z = pipeline.vae.encode(x).latent_dist.mode()
        return ((z - pipeline.vae.config.shift_factor) * pipeline.vae.config.scaling_factor).float().cpu()

    def text(captions: list[str]) -> dict[str, torch.Tensor]:
        embeds, pooled, _ = pipeline.encode_prompt(captions, prompt_2=None, max_sequence_length=max_sequence_length)
        return {"prompt_embeds": embeds.float().cpu(), "pooled_prompt_embeds": pooled.float().cpu()}

    return latents, text


def wan_encoder(pipeline, max_sequence_length: int):
    """Clips (B, F, C, H, W) -> Wan latents (B, C, f, h, w), normalised as the pipeline expects; UMT5 text."""

    def latents(pixels: torch.Tensor) -> torch.Tensor:
        vae = pipeline.vae
        x = pixels.permute(0, 2, 1, 3, 4).to(vae.device, vae.dtype)  # B, F, C, H, W -> B, C, F, H, W
        z = vae.encode(x).latent_dist.mode().float().cpu()
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        return (z - mean) / std

    def text(captions: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = pipeline.encode_prompt(
            captions, do_classifier_free_guidance=False, max_sequence_length=max_sequence_length
        )
        return {"prompt_embeds": embeds.float().cpu()}

    return latents, text


def hunyuan_encoder(pipeline, max_sequence_length: int):
    """Clips (B, F, C, H, W) -> HunyuanVideo latents (B, C, f, h, w) x the VAE's scaling factor; captions ->
    Llama embeddings (through the pipeline's prompt template) with their padding mask, and CLIP's pooled one."""
    from recipes.components import hunyuan_prompt_template

    template = hunyuan_prompt_template(pipeline.tokenizer)

    def latents(pixels: torch.Tensor) -> torch.Tensor:
        vae = pipeline.vae
        x = pixels.permute(0, 2, 1, 3, 4).to(vae.device, vae.dtype)  # B, F, C, H, W -> B, C, F, H, W
        return (vae.encode(x).latent_dist.mode() * vae.config.scaling_factor).float().cpu()

    def text(captions: list[str]) -> dict[str, torch.Tensor]:
        embeds, pooled, mask = pipeline.encode_prompt(
            captions, prompt_template=template, max_sequence_length=max_sequence_length
        )
        return {
            "prompt_embeds": embeds.float().cpu(),
            "pooled_prompt_embeds": pooled.float().cpu(),
            "prompt_attention_mask": mask.long().cpu(),  # text padding: the transformer masks those keys
        }

    return latents, text


def qwenimage_encoder(pipeline, max_sequence_length: int):
    """Pixels (B, 1, C, H, W) -> QwenImage latents (B, C, h, w), normalised per channel as the pipeline expects;
    captions -> Qwen2.5-VL embeddings (through the pipeline's prompt template) padded to ``max_sequence_length``
    with their padding mask, so that captions of any length batch together."""

    def latents(pixels: torch.Tensor) -> torch.Tensor:
        vae = pipeline.vae
        x = pixels.permute(0, 2, 1, 3, 4).to(vae.device, vae.dtype)  # B, 1, C, H, W -> B, C, 1, H, W
        z = vae.encode(x).latent_dist.mode()[:, :, 0].float().cpu()
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1)
        return (z - mean) / std

    def text(captions: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask = pipeline.encode_prompt(captions, max_sequence_length=max_sequence_length)
        b, n, d = embeds.shape
        mask = torch.ones(b, n, dtype=torch.long) if mask is None else mask.long().cpu()
        padded = embeds.new_zeros(b, max_sequence_length, d)
        padded[:, :n] = embeds
        full = torch.zeros(b, max_sequence_length, dtype=torch.long)
        full[:, :n] = mask
        # text padding: the transformer masks those keys
        return {"prompt_embeds": padded.float().cpu(), "prompt_embeds_mask": full}

    return latents, text


def todo(samples: list[dict], folder: Path, rank: int = 0, world: int = 1) -> list[dict]:
    """This rank's share (every world-th sample, so ranks agree while others write) lacking an entry."""
    return [s for s in samples[rank::world] if not (folder / f"{s['key']}.safetensors").exists()]


@torch.no_grad()
def encode_entries(
    samples: list[dict],
    folder: Path,
    encoder,
    *,
    rank: int = 0,
    world: int = 1,
    batch_size: int = 4,
    crop: str = "center",
    seed: int = 0,
) -> int:
    """Encode the missing entries of this rank's share of the samples (and the empty caption, on rank 0);
    returns how many this rank encoded. Each sample has ``key``, ``source``, ``frames``, ``bucket``, ``caption``."""
    folder.mkdir(parents=True, exist_ok=True)
    latents_of, text_of = encoder
    mine = todo(samples, folder, rank, world)
    if rank == 0 and not (folder / f"{EMPTY}.safetensors").exists():
        atomic_save({k: v[0] for k, v in text_of([""]).items()}, folder / f"{EMPTY}.safetensors")
    groups: dict = {}
    for s in mine:
        groups.setdefault(s["bucket"], []).append(s)
    bar = tqdm(total=len(mine), desc=f"encoding (rank {rank} of {world})", unit="sample", disable=rank != 0 or not mine)
    for bucket, members in sorted(groups.items()):
        for start in range(0, len(members), batch_size):
            chunk = members[start : start + batch_size]
            pixels = torch.stack(
                [
                    to_pixels(
                        load_frames(s["source"], s["frames"], s.get("times")),
                        bucket.height,
                        bucket.width,
                        crop,
                        seed,
                        s["key"],
                    )
                    for s in chunk
                ]
            )
            z = latents_of(pixels)
            texts = text_of([s["caption"] for s in chunk])
            for i, s in enumerate(chunk):
                atomic_save({"latents": z[i]} | {k: v[i] for k, v in texts.items()}, folder / f"{s['key']}.safetensors")
            bar.update(len(chunk))
    bar.close()
    return len(mine)


def write_index(samples: list[dict], path: Path) -> None:
    rows = [
        {
            "key": s["key"],
            "name": s["name"],
            "clip": s.get("clip", 0),
            "bucket": [s["bucket"].frames, s["bucket"].height, s["bucket"].width],
        }
        for s in samples
    ]
    atomic_write_text(json.dumps({"samples": rows}), path)


class CachedDataset(torch.utils.data.Dataset):
    """The cached entries listed in an index. ``dataset[(i, epoch)]`` (what BucketBatchSampler yields)
    applies caption dropout drawn from (seed, epoch, i); ``dataset[i]`` is epoch 0; ``dataset[(i, epoch, tokens,
    W)]`` (dynamic CP) adds ``cp_tokens`` and ``step_total``."""

    def __init__(self, index: str | Path, *, caption_dropout: float = 0.0, seed: int = 0):
        index = Path(index)
        self.folder = index.parent
        self.rows = json.loads(index.read_text())["samples"]
        self.caption_dropout, self.seed = caption_dropout, seed
        self._empty = None

    @property
    def buckets(self) -> list[tuple]:
        return [tuple(r["bucket"]) for r in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def dropped(self, index: int, epoch: int) -> bool:
        """Caption dropout for sample ``index`` at ``epoch``: the same on every rank at every layout."""
        if self.caption_dropout <= 0:
            return False
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * 100_003 + index + 7_919_000_000)
        return bool(torch.rand((), generator=g) < self.caption_dropout)

    def __getitem__(self, item):
        index, epoch, *dynamic = item if isinstance(item, tuple) else (item, 0)
        entry = load_file(str(self.folder / f"{self.rows[index]['key']}.safetensors"))
        if self.dropped(index, epoch):
            if self._empty is None:
                self._empty = load_file(str(self.folder / f"{EMPTY}.safetensors"))
            entry |= self._empty
        if dynamic:  # dynamic CP: the bucket's tokens and the step's total W (BucketBatchSampler)
            entry |= {
                "cp_tokens": torch.tensor(dynamic[0]),
                "step_total": torch.tensor(dynamic[1], dtype=torch.float64),
            }
        return entry | {"index": index}

"""Qwen-Image-Edit fine-tuning (LoRA or full): a target image learned from one or more reference images and an
instruction, for the QwenImageEditPlusPipeline line (Qwen-Image-Edit-2509, -2511).

    python -m recipes.qwenimage_edit fit --config configs/tiny_qwenimage_edit_cp2.yaml

Paired data as the Kontext recipe reads it (recipes/flux_kontext.py): ``<data_dir>/<name>.<ext>`` is the target,
captioned with the instruction; ``control/<name>.<ext>`` its reference, and ``control_2/``, ``control_3/`` ... its
further references (the Plus pipeline takes several; every pair the same number), or a ``control_file_name``
column of metadata.jsonl / metadata.csv (a path, or a list of paths in metadata.jsonl, relative to the metadata
file). A reference must be of its target's aspect class; it is cropped as the target is, then prepared as the
pipeline prepares a reference of that shape: resized to ``reference_area`` pixels for the VAE and to
``condition_area`` for the text encoder (recipes/qwenimage_edit_parts.py). A missing reference is an error naming
the file.

As the pipeline does, the instruction is encoded by Qwen2.5-VL together with the references (cached per pair,
padded to ``max_sequence_length`` with its mask), and the references' packed latent tokens follow the noisy
target's in one sequence with their own ``img_shapes`` entries; context parallelism splits that sequence and the
text, and the loss covers the target's tokens only. The processor that turns references into the text encoder's
image tokens is ``data.processor`` (the checkpoint's own by default; a real one needs torchvision).
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import torch
from PIL import Image

from recipes.cache import CachedDataset, digest
from recipes.data import QwenImageData
from recipes.encoded import generating
from recipes.finetune import RecipeCLI
from recipes.flux_kontext import make_pairs
from recipes.media import IMAGE_EXTENSIONS, Source, find_sources, load_frames, probe, to_pixels
from recipes.qwenimage import QwenImageFineTune
from recipes.qwenimage_edit_parts import (
    CONDITION_AREA,
    VAE_AREA,
    SampleQwenImageEdit,
    attach_processor,
    check_processor,
    edit_inputs,
    reference_size,
)

CONTROL = "control"
PIPELINE = "QwenImageEditPlusPipeline"


def _control_dirs(folder: Path) -> list[str]:
    """``control``, ``control_2``, ``control_3`` ... under ``folder``, in reference order."""
    found = [p.name for p in folder.iterdir() if p.is_dir() and re.fullmatch(r"control(_[2-9]\d*)?", p.name)]
    return sorted(found, key=lambda name: int(name.partition("_")[2] or 1))


def _named_controls(folder: Path) -> dict[Path, list[Path]]:
    """{target: [reference, ...]} from every metadata file's ``control_file_name`` column (a path or a list)."""
    out = {}
    for meta in sorted(p for name in ("metadata.jsonl", "metadata.csv") for p in folder.rglob(name)):
        if meta.suffix == ".jsonl":
            rows = [json.loads(line) for line in meta.read_text().splitlines() if line.strip()]
        else:
            with meta.open(newline="") as f:
                rows = list(csv.DictReader(f))
        for row in rows:
            names = row.get("control_file_name")
            if names:
                out[meta.parent / row["file_name"]] = [
                    meta.parent / n for n in ([names] if isinstance(names, str) else names)
                ]
    return out


def _to_image(pixels: torch.Tensor) -> Image.Image:
    """C, H, W in [-1, 1] (recipes.media.to_pixels of an 8-bit image) -> the same 8-bit RGB image."""
    array = ((pixels.permute(1, 2, 0) + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
    return Image.fromarray(array)


class EditDataset(CachedDataset):
    """The cached targets with their references' latents (``control_latents_<i>``) and the instruction encoded
    with the references (``prompt_embeds``, ``prompt_embeds_mask``; the empty instruction with them when the
    caption is dropped)."""

    def __getitem__(self, item):
        from safetensors.torch import load_file

        index, epoch = (item if isinstance(item, tuple) else (item, 0))[:2]
        entry = super().__getitem__(item)
        extra = load_file(str(self.folder / f"{references_key(self.rows[index]['key'])}.safetensors"))
        text = "empty_prompt" if self.dropped(index, epoch) else "prompt"
        entry |= {k: v for k, v in extra.items() if k.startswith("control_latents_")}
        return entry | {"prompt_embeds": extra[f"{text}_embeds"], "prompt_embeds_mask": extra[f"{text}_embeds_mask"]}


def references_key(key: str) -> str:
    return digest([key, CONTROL])


class QwenImageEditData(QwenImageData):
    """Paired images for Qwen-Image-Edit; the arguments of :class:`recipes.data.QwenImageData`
    (``max_sequence_length``, 512 by default: Qwen2.5-VL tokens of the instruction with its references' image
    tokens, about 200 per 384 x 384 reference; the tiny pipeline: 71 for a 20-letter instruction and one
    reference), and:

    Args:
        processor: the processor of the references for the text encoder: unset, the checkpoint's own
            (``processor/``; the tiny pipeline's: its tiny one); a path or hub id of a ``Qwen2VLProcessor``; or
            ``tiny``. transformers' ``Qwen2VLProcessor`` needs torchvision (``pip install torchvision``).
        reference_area: pixels of a reference for the VAE (the pipeline's ``VAE_IMAGE_SIZE``, 1024 x 1024; sides
            rounded to 32 as the pipeline rounds them).
        condition_area: pixels of a reference for the text encoder (the pipeline's ``CONDITION_IMAGE_SIZE``,
            384 x 384).
    """

    family = "qwenimage_edit"
    default_dir = "outputs/data/qwen_shape_edits"
    dataset_class = EditDataset

    def __init__(
        self,
        data_dir: str | None = None,
        *,
        processor: str | None = None,
        reference_area: int = VAE_AREA,
        condition_area: int = CONDITION_AREA,
        max_sequence_length: int = 512,
        **kwargs,
    ):
        # (kwargs pass through untouched: LightningCLI reads the other arguments from QwenImageData's signature)
        super().__init__(data_dir, max_sequence_length=max_sequence_length, **kwargs)
        for name, area in (("reference_area", reference_area), ("condition_area", condition_area)):
            if not isinstance(area, int) or area < 32 * 32:
                raise ValueError(
                    f"data.{name} must be at least 1024 pixels (32 x 32: the pipeline rounds reference sides to "
                    f"multiples of 32), got {area!r}."
                )
        check_processor(self.hparams.pretrained, processor)  # a processor that cannot be built, before anything runs
        self.processor, self.reference_area, self.condition_area = processor, reference_area, condition_area
        self.controls: dict[str, list[Source]] = {}

    def prepare_data(self) -> None:
        h = self.hparams
        if h.synthetic_samples > 0 and not Path(self.data_dir).exists():
            print(generating(self.data_dir, h.synthetic_samples))
            make_pairs(self.data_dir, h.synthetic_samples, size=h.resolution, seed=h.seed)
        super().prepare_data()
        from diffusers import DiffusionPipeline

        name = DiffusionPipeline.load_config(self._pipeline_path()).get("_class_name")
        if name != PIPELINE:
            raise ValueError(
                f"{h.pretrained} is a {name} checkpoint; this recipe trains the {PIPELINE} line (Qwen-Image-Edit-2509, "
                "-2511), whose prompt template and reference sizes it reproduces."
            )

    def sources(self, folder) -> list:
        """The targets (the ``control`` folders left out), each with its references, whose files shape the key."""
        h = self.hparams
        folder = Path(folder)
        dirs = _control_dirs(folder) if folder.is_dir() else []
        targets = find_sources(
            folder, allow_empty_captions=h.allow_empty_captions, fingerprint=h.fingerprint, exclude=tuple(dirs)
        )
        named = _named_controls(folder) if folder.is_dir() else {}
        out, counts = [], {}
        for target in targets:
            path = Path(target.path)
            references = named.get(path)
            if references is None:
                references = []
                for name in dirs or [CONTROL]:
                    stem = folder / name / path.relative_to(folder).with_suffix("")
                    found = [stem.with_suffix(e) for e in IMAGE_EXTENSIONS if stem.with_suffix(e).is_file()]
                    references.append(found[0] if found else stem.with_suffix(path.suffix))
            for reference in references:
                if not reference.is_file():
                    raise ValueError(
                        f"{path} has no reference image {reference}: put it there (any of "
                        f"{', '.join(IMAGE_EXTENSIONS)}), or name its references in a control_file_name column of "
                        "metadata.jsonl / metadata.csv."
                    )
            counts.setdefault(len(references), path)
            stamps = [(str(r), r.stat().st_size, r.stat().st_mtime_ns) for r in references]
            self.controls[target.path] = [Source(str(r), "", False, s) for r, s in zip(references, stamps, strict=True)]
            out.append(Source(target.path, target.caption, target.is_video, (target.stamp, *stamps)))
        if len(counts) > 1:
            (a, first), (b, other) = sorted(counts.items())[:2]
            raise ValueError(
                f"every pair needs the same number of references (they batch together): {first} has {a}, {other} has "
                f"{b}."
            )
        self.reference_count = next(iter(counts), 1)
        return out

    def sample_references(self, count: int) -> list[list[Source]]:
        """The references of the first ``count`` pairs: what the samples edit without ``samples.images``."""
        return [self.controls[pair.path] for pair in super().sample_references(count)]

    def plan(self, cp: int = 1) -> list[dict]:
        samples = super().plan(cp)
        from recipes.buckets import nearest

        buckets = sorted({s["bucket"] for s in samples + self.val_samples})
        tag = [self.processor, self.reference_area, self.condition_area, self.hparams.caption_dropout > 0]
        for s in samples + self.val_samples:
            t = probe(s["source"])
            for reference in self.controls[s["source"].path]:
                p = probe(reference)
                if nearest(buckets, p.width, p.height, 1) != nearest(buckets, t.width, t.height, 1):
                    raise ValueError(
                        f"the reference {reference.path} ({p.width}x{p.height}) is of another aspect class than its "
                        f"target {s['source'].path} ({t.width}x{t.height}, bucket {s['bucket'].name}): references are "
                        "cropped as their target, so give them the target's aspect ratio."
                    )
            s["key"] = digest([s["key"], tag])  # how the references were prepared shapes the entry
        return samples

    def reference_shape(self, bucket) -> tuple[int, int]:
        """(width, height) of a reference of ``bucket`` for the VAE, as the pipeline resizes it."""
        width, height = reference_size(self.reference_area, bucket.width, bucket.height)
        multiple = self.geometry()[0]
        if width < multiple or height < multiple:
            raise ValueError(
                f"data.reference_area={self.reference_area} gives the {bucket.width}x{bucket.height} bucket's "
                f"references {width}x{height} pixels; raise it (e.g. to the bucket's {bucket.width * bucket.height})."
            )
        return width, height

    def tokens(self, bucket):
        image, text = super().tokens(bucket)
        width, height = self.reference_shape(bucket)
        multiple = self.geometry()[0]
        references = getattr(self, "reference_count", 1) * (width // multiple) * (height // multiple)
        return image + references, text  # the references' tokens join the target's

    def encoder(self, pipeline):
        latents, _ = super().encoder(pipeline)
        return latents, lambda captions: {}  # the instruction is encoded with its references (encode_extra)

    def encode_extra(self, samples: list[dict]) -> None:
        """Encode the references and the instruction with them, for the entries the cache lacks (each rank a
        share), the references cropped as their targets."""
        h = self.hparams
        size = h.max_sequence_length

        def text(pipeline, caption, conditions, s, name):
            embeds, mask = pipeline.encode_prompt(caption, image=conditions, max_sequence_length=size)
            n = embeds.shape[1]
            if n > size:
                raise ValueError(
                    f"{s['source'].path}: its instruction and {len(conditions)} reference images make {n} text "
                    f"tokens, more than data.max_sequence_length={size}: raise it to at least {n} (up to 1024)."
                )
            padded, full = embeds.new_zeros(size, embeds.shape[2]), torch.zeros(size, dtype=torch.long)
            padded[:n] = embeds[0]
            full[:n] = 1 if mask is None else mask[0].long().cpu()
            return {f"{name}_embeds": padded.float().cpu(), f"{name}_embeds_mask": full}

        def encode(pipeline, latents_of, s):
            if not getattr(pipeline, "_edit_processor", False):
                attach_processor(pipeline, h.pretrained, self.processor)
                pipeline._edit_processor = True
            b = s["bucket"]
            references = [
                _to_image(to_pixels(load_frames(r, [0]), b.height, b.width, h.crop, h.seed, s["key"])[0])
                for r in self.controls[s["source"].path]
            ]
            conditions, pixels = edit_inputs(pipeline, references, self.reference_area, self.condition_area)
            out = {f"control_latents_{i}": latents_of(x)[0] for i, x in enumerate(pixels)}  # C, h, w each
            out |= text(pipeline, s["caption"], conditions, s, "prompt")
            if h.caption_dropout > 0:  # the dropped caption keeps its references, as a negative prompt does
                out |= text(pipeline, "", conditions, s, "empty_prompt")
            return out

        self.encode_missing(samples, references_key, encode)


class QwenImageEditFineTune(QwenImageFineTune):
    """Flow-matching fine-tuning of Qwen-Image-Edit (a ``QwenImageTransformer2DModel``); the arguments of
    :class:`recipes.qwenimage.QwenImageFineTune`. The time shift follows the target's tokens, as the pipeline's."""

    family = "qwenimage_edit"

    def predict(self, batch):
        from diffusers import QwenImagePipeline

        from cp_lightning.parallelize import parallel_state

        state = parallel_state(self.transformer)
        if state is not None and state.loss_parallel:
            raise ValueError(
                "the Qwen-Image-Edit recipe drops the references' tokens from the output before the loss, which a "
                "loss-parallel (still split) output cannot: set the strategy's loss_parallel: false."
            )
        x0 = batch["latents"]  # B, C, h, w
        b, c, h, w = x0.shape
        references = [
            batch[f"control_latents_{i}"] for i in range(sum(k.startswith("control_latents_") for k in batch))
        ]
        noise, t = self.draws(x0, batch)
        xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
        # B, C, h, w -> B, (h/2)(w/2), 4C for the target and each reference (B, C, h_r, w_r)
        packed = QwenImagePipeline._pack_latents(xt, b, c, h, w)
        tokens = [packed] + [QwenImagePipeline._pack_latents(r.to(xt.dtype), b, c, *r.shape[-2:]) for r in references]
        shapes = [(1, h // 2, w // 2)] + [(1, r.shape[-2] // 2, r.shape[-1] // 2) for r in references]
        pred = self.transformer(
            hidden_states=torch.cat(tokens, dim=1),  # B, N + sum N_r, 4C: CP splits the joint sequence
            timestep=t,
            encoder_hidden_states=batch["prompt_embeds"],
            encoder_hidden_states_mask=batch["prompt_embeds_mask"],
            img_shapes=[shapes] * b,
            return_dict=False,
        )[0]
        return pred[:, : packed.shape[1]], QwenImagePipeline._pack_latents(noise - x0, b, c, h, w), t


QwenImageEditFineTune.sampler = SampleQwenImageEdit  # the recipe's samples section (recipes/finetune.py)


class EditCLI(RecipeCLI):
    """RecipeCLI with the samples' processor and reference areas taken from the data's (one setting for both)."""

    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        for name in ("processor", "reference_area", "condition_area"):
            parser.link_arguments(f"data.{name}", f"samples.{name}")


def main(args=None):
    return EditCLI(
        QwenImageEditFineTune,
        QwenImageEditData,
        args=args,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()

"""Flux Kontext image-editing fine-tuning (LoRA or full): a target image learned from a reference and an instruction.

    python -m recipes.flux_kontext fit --config configs/tiny_flux_kontext_cp2.yaml

Paired data: ``<data_dir>/<name>.<ext>`` is the target (captioned as for the Flux recipe: the instruction),
``<data_dir>/control/<name>.<ext>`` its reference (any image extension), or the file a ``control_file_name``
column of metadata.jsonl / metadata.csv names (relative to the metadata file; keep references in ``control/``
or outside ``data_dir``, where they are not taken for targets). A pair is bucketed by its target; the
reference must fall in the same aspect bucket and is cropped alike (resized to cover the bucket, the same
crop). A missing reference is an error naming the file.

As FluxKontextPipeline does, the reference's packed latent tokens join the noisy target's in one sequence
(position ids with first coordinate 1), so context parallelism splits them with it; the loss covers the
target's tokens only.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import numpy as np
import torch

from recipes.cache import CachedDataset, digest
from recipes.data import FluxData
from recipes.encoded import generating
from recipes.finetune import cli
from recipes.flux import FluxFineTune
from recipes.media import IMAGE_EXTENSIONS, Source, load_frames, probe, to_pixels
from recipes.sampling import SampleFlux
from recipes.synthetic import COLOURS, SHAPES, draw_shape

CONTROL = "control"


def make_pairs(folder: str | Path, n: int, size: int = 32, seed: int = 0) -> Path:
    """``n`` editing pairs: a reference shape in one colour (``control/``), the target the same shape recoloured,
    captioned with the instruction (``make the circle blue``)."""
    folder = Path(folder)
    (folder / CONTROL).mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        before, after = rng.sample(list(COLOURS), 2)
        shape = rng.choice(SHAPES)
        r = rng.randint(size // 5, size // 3)
        cx, cy = rng.randint(r, size - r), rng.randint(r, size - r)
        draw_shape(size, before, shape, cx, cy, r).save(folder / CONTROL / f"{i:05d}.png")
        draw_shape(size, after, shape, cx, cy, r).save(folder / f"{i:05d}.png")
        lines.append(json.dumps({"file_name": f"{i:05d}.png", "text": f"make the {shape} {after}"}))
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _control_names(folder: Path) -> dict[Path, Path]:
    """{target path: reference path} from every metadata file's ``control_file_name`` column."""
    out = {}
    for meta in sorted(p for name in ("metadata.jsonl", "metadata.csv") for p in folder.rglob(name)):
        if meta.suffix == ".jsonl":
            rows = [json.loads(line) for line in meta.read_text().splitlines() if line.strip()]
        else:
            with meta.open(newline="") as f:
                rows = list(csv.DictReader(f))
        for row in rows:
            if row.get("control_file_name"):
                out[meta.parent / row["file_name"]] = meta.parent / row["control_file_name"]
    return out


class PairedDataset(CachedDataset):
    """The cached targets with their cached references (``control_latents``)."""

    def __getitem__(self, item):
        from safetensors.torch import load_file

        entry = super().__getitem__(item)
        key = self.rows[entry["index"]]["key"]
        return entry | load_file(str(self.folder / f"{control_key(key)}.safetensors"))


def control_key(key: str) -> str:
    return digest([key, CONTROL])


class FluxKontextData(FluxData):
    """Paired images for Flux Kontext; the arguments of :class:`recipes.encoded.EncodedData` (``synthetic_samples``
    writes editing pairs of shapes)."""

    __doc__ = (__doc__ or "") + (FluxData.__doc__ or "")
    default_dir = "outputs/data/shape_edits"
    dataset_class = PairedDataset

    def prepare_data(self) -> None:
        h = self.hparams
        if h.synthetic_samples > 0 and not Path(self.data_dir).exists():
            print(generating(self.data_dir, h.synthetic_samples))
            make_pairs(self.data_dir, h.synthetic_samples, size=h.resolution, seed=h.seed)
        super().prepare_data()

    def sources(self, folder) -> list:
        """The targets (``control/`` left out), each with its reference, whose file also shapes the cache key."""
        from recipes.media import find_sources

        h = self.hparams
        folder = Path(folder)
        targets = find_sources(
            folder, allow_empty_captions=h.allow_empty_captions, fingerprint=h.fingerprint, exclude=(CONTROL,)
        )
        named = _control_names(folder)
        self.controls: dict[str, Source] = getattr(self, "controls", {})
        out = []
        for target in targets:
            path = Path(target.path)
            control = named.get(path)
            if control is None:
                stem = folder / CONTROL / path.relative_to(folder).with_suffix("")
                found = [stem.with_suffix(ext) for ext in IMAGE_EXTENSIONS if stem.with_suffix(ext).is_file()]
                control = found[0] if found else stem.with_suffix(path.suffix)
            if not control.is_file():
                raise ValueError(
                    f"{path} has no reference image: put it at {control} (any of {', '.join(IMAGE_EXTENSIONS)}), "
                    "or name it in a control_file_name column of metadata.jsonl / metadata.csv."
                )
            stat = control.stat()
            reference = Source(str(control), "", False, (str(control), stat.st_size, stat.st_mtime_ns))
            pair = Source(target.path, target.caption, target.is_video, (target.stamp, reference.stamp))
            self.controls[pair.path] = reference
            out.append(pair)
        return out

    def sample_references(self, count: int) -> list[Source]:
        """The references of the first ``count`` pairs: what the edit samples start from without ``samples.images``."""
        pairs = super().sample_references(count)
        return [self.controls[pair.path] for pair in pairs]

    def plan(self, cp: int = 1) -> list[dict]:
        samples = super().plan(cp)
        from recipes.buckets import nearest

        buckets = sorted({s["bucket"] for s in samples + self.val_samples})
        for s in samples + self.val_samples:
            reference = self.controls[s["source"].path]
            p, t = probe(reference), probe(s["source"])
            if nearest(buckets, p.width, p.height, 1) != nearest(buckets, t.width, t.height, 1):
                raise ValueError(
                    f"the reference {reference.path} ({p.width}x{p.height}) is of another aspect class than its "
                    f"target {s['source'].path} ({t.width}x{t.height}, bucket {s['bucket'].name}): pairs are cropped "
                    "alike, so give the reference the target's aspect ratio."
                )
        return samples

    def tokens(self, bucket):
        image, text = super().tokens(bucket)
        return 2 * image, text  # the reference's tokens join the target's

    def encode_extra(self, samples: list[dict]) -> None:
        """Encode the references missing from the cache (each rank a share), cropped as their targets."""
        h = self.hparams

        def reference(_pipeline, latents_of, s):
            b = s["bucket"]
            # the target's key names the crop: the same offset as the target's
            pixels = to_pixels(
                load_frames(self.controls[s["source"].path], [0]), b.height, b.width, h.crop, h.seed, s["key"]
            )
            return {"control_latents": latents_of(pixels[None])[0]}  # 1, 1, C, H, W -> C, h, w

        self.encode_missing(samples, control_key, reference)


class FluxKontextFineTune(FluxFineTune):
    """Flow-matching fine-tuning of Flux Kontext (a ``FluxTransformer2DModel``); the arguments of
    :class:`recipes.flux.FluxFineTune`. Kontext-dev is guidance-distilled: ``guidance_scale`` 2.5 as it samples."""

    def predict(self, batch):
        from diffusers import FluxPipeline

        from cp_lightning.parallelize import parallel_state

        state = parallel_state(self.transformer)
        if state is not None and state.loss_parallel:
            raise ValueError(
                "the Kontext recipe drops the reference's tokens from the output before the loss, which a "
                "loss-parallel (still split) output cannot: set the strategy's loss_parallel: false."
            )
        x0, ref = batch["latents"], batch["control_latents"]  # B, C, h, w each (one bucket)
        b, c, h, w = x0.shape
        noise, t = self.draws(x0, batch)
        xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
        # B, C, h, w -> B, (h/2)(w/2), 4C for target and reference; the reference's ids have first coordinate 1
        packed = FluxPipeline._pack_latents(xt, b, c, h, w)
        reference = FluxPipeline._pack_latents(ref.to(xt.dtype), b, c, h, w)
        ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, x0.device, x0.dtype)
        ref_ids = ids.clone()
        ref_ids[:, 0] = 1
        text = batch["prompt_embeds"]
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((b,), self.hparams.guidance_scale, device=x0.device)
        pred = self.transformer(
            hidden_states=torch.cat([packed, reference], dim=1),  # B, 2N, 4C: CP splits the joint sequence
            timestep=t,
            guidance=guidance,
            pooled_projections=batch["pooled_prompt_embeds"],
            encoder_hidden_states=text,
            txt_ids=torch.zeros(text.shape[1], 3, device=x0.device, dtype=x0.dtype),
            img_ids=torch.cat([ids, ref_ids], dim=0),
            return_dict=False,
        )[0]
        return pred[:, : packed.shape[1]], FluxPipeline._pack_latents(noise - x0, b, c, h, w), t


class SampleFluxKontext(SampleFlux):
    """Edits of fixed reference images rendered by FluxKontextPipeline with the training transformer (context
    parallel): ``images`` gives one reference per prompt; without it, prompt i edits the reference of the data's
    i-th pair (so ``--data.data_dir`` alone moves the samples to one's own pairs). The other arguments as
    :class:`recipes.sampling.Samples`'s."""

    default_guidance = 2.5  # FLUX.1 Kontext-dev's distilled guidance
    image_role = "reference image"

    def __init__(
        self,
        out_dir: str = "outputs/run",
        *,
        images: list[str] | None = None,
        every_n_steps: int = 0,
        prompts: list[str] | None = None,
        resolution: int = 32,
        width: int | None = None,
        num_inference_steps: int = 8,
        guidance_scale: float | None = None,
        max_sequence_length: int = 32,
        seed: int = 0,
    ):
        super().__init__(
            out_dir,
            every_n_steps=every_n_steps,
            prompts=prompts,
            resolution=resolution,
            width=width,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            max_sequence_length=max_sequence_length,
            seed=seed,
        )
        self.images = list(images or [])
        if self.images and len(self.images) != len(self.prompts):
            raise ValueError(
                f"samples.images must give one reference image per prompt ({len(self.prompts)} prompts, "
                f"{len(self.images)} images): an edit needs the image it edits (or leave images out: the "
                "references of the data's first pairs)."
            )

    def prepare(self, trainer, pl_module) -> None:
        from diffusers import FluxKontextPipeline

        references = self.load_images(trainer)
        super().prepare(trainer, pl_module)
        self.pipeline = FluxKontextPipeline.from_pipe(self.pipeline)
        self.pipeline.set_progress_bar_config(disable=True)
        self.references = references

    def render(self, pipeline, embeds, seed):
        index = (seed - self.seed) % len(self.references)  # prompt i renders with seed + i
        image = pipeline(
            image=self.references[index],
            **embeds,
            height=self.height,
            width=self.width,
            num_inference_steps=self.steps,
            guidance_scale=self.guidance,
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
            max_area=self.height * self.width,  # (the pipeline's default rescales to 1 Mpx)
            _auto_resize=False,  # the reference at its own size, not Kontext's preferred 1 Mpx resolutions
        ).images
        return image[:1].astype(np.float32)  # 1, H, W, 3


FluxKontextFineTune.sampler = SampleFluxKontext  # the recipe's samples section (recipes/finetune.py)


def main(args=None):
    return cli(FluxKontextFineTune, FluxKontextData, args)


if __name__ == "__main__":
    main()

"""Qwen-Image-Edit's pipeline pieces for the recipe: the processor, the tiny pipeline, and the reference sizes.

QwenImageEditPlusPipeline (Qwen-Image-Edit-2509 / -2511) encodes the instruction together with its reference
images: transformers' ``Qwen2VLProcessor`` turns each ``<|image_pad|>`` of the prompt template into one token per
2x2 merged vision patch and gives the Qwen2.5-VL text encoder the patches (``pixel_values``) and their grid
(``image_grid_thw``). That processor cannot be built without torchvision (its video processor needs it), so a
real checkpoint's processor makes torchvision the user's dependency (:data:`TORCHVISION`). The tiny pipeline,
whose tokenizer is a byte tokenizer, takes :class:`TinyQwenVLProcessor` instead: transformers' own PIL image
processor for the patches and grid, and the image tokens written as the real processor writes them.

The pipeline resizes every reference to about ``VAE_IMAGE_SIZE`` pixels (1024 x 1024, sides rounded to 32) for the
VAE and about ``CONDITION_IMAGE_SIZE`` (384 x 384) for the text encoder; both are module constants it reads at
call time. :func:`edit_inputs` prepares references exactly so for given areas, and :func:`reference_areas` sets
the pipeline's constants for a call (the tiny model trains and samples at 32 x 32 references);
:class:`SampleQwenImageEdit` renders the recipe's samples with them.
"""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from recipes.media import Source, load_frames
from recipes.sampling import SampleQwenImage

TINY = "tiny"
VAE_AREA, CONDITION_AREA = 1024 * 1024, 384 * 384  # QwenImageEditPlusPipeline's VAE_IMAGE_SIZE, CONDITION_IMAGE_SIZE
TORCHVISION = (
    "Qwen-Image-Edit's processor (transformers' Qwen2VLProcessor) needs torchvision, which is not installed: "
    "pip install torchvision (the build that matches your torch)."
)
# the tiny text encoder's special tokens: the last ids of the byte tokenizer's 384 (its unused extra ids)
VIDEO_ID, VISION_END_ID, VISION_START_ID, IMAGE_ID = 380, 381, 382, 383
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


class TinyQwenVLProcessor:
    """What ``Qwen2VLProcessor`` gives QwenImage-Edit's text encoder, for the tiny pipeline's byte tokenizer:
    ``input_ids`` with each image's placeholder written as vision-start, one image token per merged patch and
    vision-end (the ids of the text encoder's config), ``attention_mask`` (right padding), and the patches and grid
    from transformers' ``Qwen2VLImageProcessorPil`` (the real processor's layout, without torchvision)."""

    def __init__(
        self,
        tokenizer,
        *,
        patch_size: int,
        merge_size: int,
        temporal_patch_size: int = 2,
        ids: tuple[int, int, int] = (VISION_START_ID, IMAGE_ID, VISION_END_ID),
    ):
        from transformers import Qwen2VLImageProcessorPil

        self.tokenizer, self.merge, self.ids = tokenizer, merge_size, ids
        factor = patch_size * merge_size
        self.image_processor = Qwen2VLImageProcessorPil(
            patch_size=patch_size,
            merge_size=merge_size,
            temporal_patch_size=temporal_patch_size,
            size={"shortest_edge": factor * factor, "longest_edge": 1024 * 1024},
        )

    @classmethod
    def for_pipeline(cls, pipeline) -> TinyQwenVLProcessor:
        config = pipeline.text_encoder.config
        ids = (config.vision_start_token_id, config.image_token_id, config.vision_end_token_id)
        vision = config.vision_config
        return cls(pipeline.tokenizer, patch_size=vision.patch_size, merge_size=vision.spatial_merge_size, ids=ids)

    def _bytes(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def __call__(self, text, images=None, padding=True, return_tensors="pt"):
        from transformers import BatchFeature

        text = [text] if isinstance(text, str) else list(text)
        images = [] if images is None else images if isinstance(images, list) else [images]
        out = {}
        if images:
            out = dict(self.image_processor(images=images, return_tensors="pt"))
        counts = iter([int(g.prod()) // self.merge**2 for g in out.get("image_grid_thw", [])])
        start, image, end = self.ids
        rows = []
        for line in text:
            pieces = line.split(PLACEHOLDER)
            ids = self._bytes(pieces[0])
            for piece in pieces[1:]:
                n = next(counts, None)
                if n is None:
                    raise ValueError(f"the prompt has more image placeholders than the {len(images)} images given.")
                ids += [start, *[image] * n, end, *self._bytes(piece)]
            rows.append(ids + [self.tokenizer.eos_token_id])
        if next(counts, None) is not None:
            raise ValueError(f"{len(images)} images were given for fewer image placeholders in the prompts.")
        longest = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        out["input_ids"] = torch.tensor([r + [pad] * (longest - len(r)) for r in rows])
        out["attention_mask"] = torch.tensor([[1] * len(r) + [0] * (longest - len(r)) for r in rows])
        return BatchFeature(out, tensor_type=return_tensors)


def check_processor(pretrained: str, processor: str | None) -> None:
    """Refuse, before anything loads, a processor that cannot be built: the checkpoint's own or a named one is a
    ``Qwen2VLProcessor``, which needs torchvision; the tiny one needs nothing."""
    if processor not in (None, TINY):
        if not isinstance(processor, str) or not processor:
            raise ValueError(f"processor must be 'tiny', a path or hub id, or unset, got {processor!r}.")
    if (processor or pretrained) != TINY and importlib.util.find_spec("torchvision") is None:
        raise ValueError(TORCHVISION)


def attach_processor(pipeline, pretrained: str, processor: str | None):
    """Give ``pipeline`` its processor: the tiny one (``processor: tiny``, or the tiny pipeline, saved without
    one), one loaded from ``processor`` (a path or hub id), or the checkpoint's own that ``from_pretrained``
    loaded."""
    check_processor(pretrained, processor)
    if processor == TINY or (processor is None and pretrained == TINY):
        pipeline.processor = TinyQwenVLProcessor.for_pipeline(pipeline)
    elif processor is not None:
        from transformers import AutoProcessor

        pipeline.processor = AutoProcessor.from_pretrained(processor)
    elif getattr(pipeline, "processor", None) is None:
        raise ValueError(
            f"{pretrained} has no processor/ folder: name one with processor (a path or hub id of a Qwen2VLProcessor, "
            "e.g. Qwen/Qwen-Image-Edit-2509)."
        )
    return pipeline


def build_tiny_qwenimage_edit_pipeline(seed: int = 0):
    """Qwen-Image-Edit-2511 at tiny size: the tiny QwenImage pipeline's VAE, byte tokenizer and scheduler, a
    one-layer Qwen2.5-VL whose one-block vision tower takes 8 px patches (a 32 x 32 reference: 16 patches, 4 image
    tokens), and a transformer with 2511's ``zero_cond_t`` (reference tokens modulated at time 0). Saved without a
    processor: :func:`attach_processor` gives it the tiny one."""
    from diffusers import QwenImageEditPlusPipeline, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from recipes.components import build_tiny_qwenimage_pipeline

    base = build_tiny_qwenimage_pipeline(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed + 3)
        text = base.text_encoder.config.text_config.to_dict()
        text_encoder = Qwen2_5_VLForConditionalGeneration(
            Qwen2_5_VLConfig(
                text_config=text,
                vision_config=dict(
                    depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=8,
                    fullatt_block_indexes=[0],
                ),
                image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=VISION_START_ID,
                vision_end_token_id=VISION_END_ID,
            )
        )  # fmt: skip
        config = {k: v for k, v in base.transformer.config.items() if not k.startswith("_")}
        transformer = QwenImageTransformer2DModel(**{**config, "zero_cond_t": True})
    return QwenImageEditPlusPipeline(
        scheduler=base.scheduler,
        vae=base.vae,
        text_encoder=text_encoder,
        tokenizer=base.tokenizer,
        processor=None,
        transformer=transformer,
    )


def edit_inputs(pipeline, references: list, reference_area: int, condition_area: int):
    """(condition images for the text encoder, VAE pixels (1, 1, C, H, W) in [-1, 1] per reference), as
    QwenImageEditPlusPipeline prepares its PIL references when its areas are these."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    conditions, pixels = [], []
    for image in references:
        ratio = image.width / image.height
        width, height = calculate_dimensions(condition_area, ratio)
        conditions.append(pipeline.image_processor.resize(image, height, width))
        width, height = calculate_dimensions(reference_area, ratio)
        pixels.append(pipeline.image_processor.preprocess(image, height, width).unsqueeze(1))  # 1, 1, C, H, W
    return conditions, pixels


def reference_size(reference_area: int, width: int, height: int) -> tuple[int, int]:
    """(width, height) the pipeline resizes a ``width`` x ``height`` reference to for the VAE."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    return calculate_dimensions(reference_area, width / height)


@contextlib.contextmanager
def reference_areas(reference_area: int, condition_area: int):
    """QwenImageEditPlusPipeline's reference areas set for the calls inside: it reads ``VAE_IMAGE_SIZE`` and
    ``CONDITION_IMAGE_SIZE`` from its module at call time, and has no argument for them (the tiny model's 32 px
    references; a real checkpoint's are the defaults, and nothing changes)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as module

    saved = module.VAE_IMAGE_SIZE, module.CONDITION_IMAGE_SIZE
    module.VAE_IMAGE_SIZE, module.CONDITION_IMAGE_SIZE = reference_area, condition_area
    try:
        yield
    finally:
        module.VAE_IMAGE_SIZE, module.CONDITION_IMAGE_SIZE = saved


class SampleQwenImageEdit(SampleQwenImage):
    """Edits of fixed references rendered by QwenImageEditPlusPipeline with the training transformer (context
    parallel): ``images`` gives each prompt its reference, or a list of references; without it, prompt i edits the
    references of the data's i-th pair. ``processor``, ``reference_area`` and ``condition_area`` are the data's
    (linked); the other arguments as :class:`recipes.sampling.Samples`'s."""

    family = "qwenimage_edit"
    image_role = "reference image"

    def __init__(
        self,
        out_dir: str = "outputs/run",
        *,
        images: list[str | list[str]] | None = None,
        processor: str | None = None,
        reference_area: int = VAE_AREA,
        condition_area: int = CONDITION_AREA,
        **kwargs,
    ):
        super().__init__(out_dir, **kwargs)
        self.images = [[i] if isinstance(i, str) else list(i) for i in images or []]
        if self.images and len(self.images) != len(self.prompts):
            raise ValueError(
                f"samples.images must give each prompt its reference image(s) ({len(self.prompts)} prompts, "
                f"{len(self.images)} entries): an edit needs the image it edits (or leave images out: the "
                "references of the data's first pairs)."
            )
        self.processor, self.reference_area, self.condition_area = processor, reference_area, condition_area
        self.references: list[list[Image.Image]] = []

    def check_images(self) -> None:
        for prompt, paths in zip(self.prompts, self.images, strict=False):
            for path in paths:
                if not Path(path).is_file():
                    raise ValueError(
                        f"samples.images: {path} does not exist (a reference image of the prompt {prompt!r}); give an "
                        "existing file, or leave samples.images out to take those of the data's first pairs."
                    )

    def sample_images(self, datamodule) -> list[list[Source]]:
        if self.images:
            self.check_images()
            return [[Source(str(p), "", False) for p in paths] for paths in self.images]
        return super().sample_images(datamodule)

    def load_images(self, trainer) -> list[list[Image.Image]]:
        return [
            [load_frames(s, [0])[0] for s in refs] for refs in self.sample_images(getattr(trainer, "datamodule", None))
        ]

    def prepare(self, trainer, pl_module) -> None:
        from recipes.components import load_pipeline

        h = pl_module.hparams
        self.references = self.load_images(trainer)
        pipeline = load_pipeline(
            self.family, h.pretrained, h.cache_dir, dtype=getattr(torch, h.weights_dtype), transformer=None
        )
        attach_processor(pipeline, h.pretrained, self.processor).to(pl_module.device)
        pipeline.set_progress_bar_config(disable=True)
        if self.vae_tiling:
            pipeline.vae.enable_tiling()
        with torch.no_grad():
            self.embeds = [
                self.encode(pipeline, p, refs) for p, refs in zip(self.prompts, self.references, strict=True)
            ]
        # the text encoder is not needed again: its memory goes before training goes on
        pipeline.register_modules(text_encoder=None, transformer=pl_module.transformer)
        self.pipeline = pipeline

    def encode(self, pipeline, prompt, references=()):
        """The prompt encoded with its references (the pipeline's condition images of them)."""
        conditions, _ = edit_inputs(pipeline, list(references), self.reference_area, self.condition_area)

        def encode(text):
            embeds, mask = pipeline.encode_prompt(text, image=conditions, max_sequence_length=self.max_sequence_length)
            return embeds, torch.ones(
                embeds.shape[:2], dtype=torch.long, device=embeds.device
            ) if mask is None else mask

        embeds, mask = encode(prompt)
        out = {"prompt_embeds": embeds, "prompt_embeds_mask": mask, "true_cfg_scale": self.true_cfg}
        if self.true_cfg > 1.0:  # classifier-free guidance against the negative prompt, with the same references
            negative, negative_mask = encode(self.negative_prompt)
            out.update(negative_prompt_embeds=negative, negative_prompt_embeds_mask=negative_mask)
        return out

    def render(self, pipeline, embeds, seed):
        index = (seed - self.seed) % len(self.references)  # prompt i renders with seed + i
        with reference_areas(self.reference_area, self.condition_area):
            image = pipeline(
                image=self.references[index],
                **embeds,
                height=self.height,
                width=self.width,
                num_inference_steps=self.steps,
                generator=torch.Generator().manual_seed(seed),
                output_type="np",
            ).images
        return image[:1].astype(np.float32)  # 1, H, W, 3

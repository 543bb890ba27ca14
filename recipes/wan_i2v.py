"""Wan image-to-video LoRA (or full) fine-tuning: each training clip is conditioned on its own first frame.

    python -m recipes.wan_i2v fit --config configs/tiny_wan_i2v_cp2.yaml

As ``WanImageToVideoPipeline`` does, the transformer's input channels are the noisy latents, a mask that marks
the first frame as given, and the condition latents: the VAE's encoding of [first frame, black frames]. Wan2.1
I2V also attends to the first frame's CLIP image tokens beside the text (its ``image_encoder``); Wan2.2
I2V-A14B has no CLIP (``image_encoder`` absent) and two experts split at a timestep boundary (``model.expert``,
as in recipes/wan.py). The condition latents and image tokens are cached per clip beside its latents
(encode_extra); the CP plan splits the video tokens with their condition channels (they are the same tokens)
and keeps text and image tokens whole. Samples are rendered by WanImageToVideoPipeline under CP from fixed
(image, prompt) pairs: ``samples.images``, one per prompt.

Wan's cross-attention takes the image tokens as the keys before the last 512: the text must be padded to 512
tokens (``data.max_sequence_length`` and ``samples.max_sequence_length``), as the pipeline does.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from recipes.cache import CachedDataset, digest
from recipes.data import WanData
from recipes.finetune import cli
from recipes.media import load_frames, to_pixels
from recipes.sampling import SampleWan
from recipes.wan import WanFineTune

TEXT_TOKENS = 512  # Wan's attention processor takes the keys before the last 512 as image tokens


def condition_key(key: str) -> str:
    return digest([key, "first frame"])


class ConditionedDataset(CachedDataset):
    """The cached clips with their first-frame condition (``condition_latents``, and ``image_embeds`` for CLIP)."""

    def __getitem__(self, item):
        from safetensors.torch import load_file

        entry = super().__getitem__(item)
        key = self.rows[entry["index"]]["key"]
        return entry | load_file(str(self.folder / f"{condition_key(key)}.safetensors"))


def _image(pixels: torch.Tensor) -> Image.Image:
    """(C, H, W) in [-1, 1] -> the RGB image the pipeline would be given."""
    array = ((pixels.permute(1, 2, 0).float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
    return Image.fromarray(array)


def image_tokens(pipeline, image) -> torch.Tensor:
    """CLIP image tokens of ``image`` as WanImageToVideoPipeline computes them (its penultimate hidden state)."""
    inputs = pipeline.image_processor(images=image, return_tensors="pt").to(pipeline.image_encoder.device)
    return pipeline.image_encoder(**inputs, output_hidden_states=True).hidden_states[-2]


class WanI2VData(WanData):
    """Video clips for Wan image-to-video, each conditioned on its first frame; the arguments of
    :class:`recipes.data.WanData` (``num_frames``: 4k+1, default 5; ``max_sequence_length``: 512, needed when the
    model takes CLIP image tokens)."""

    __doc__ = (__doc__ or "") + (WanData.__doc__ or "")
    family = "wan_i2v"
    dataset_class = ConditionedDataset

    def __init__(
        self, data_dir: str | None = None, *, num_frames: int = 5, max_sequence_length: int = TEXT_TOKENS, **kwargs
    ):
        super().__init__(data_dir, num_frames=num_frames, max_sequence_length=max_sequence_length, **kwargs)

    def setup(self, stage: str) -> None:
        from diffusers import WanTransformer3DModel

        config = WanTransformer3DModel.load_config(self._pipeline_path(), subfolder="transformer")
        if config.get("image_dim") and self.hparams.max_sequence_length != TEXT_TOKENS:
            raise ValueError(
                f"data.max_sequence_length={self.hparams.max_sequence_length}: this Wan image-to-video model takes "
                f"CLIP image tokens, which its cross-attention finds before the last {TEXT_TOKENS} keys; set "
                f"data.max_sequence_length: {TEXT_TOKENS} (and samples.max_sequence_length: {TEXT_TOKENS})."
            )
        super().setup(stage)

    def encode_extra(self, samples: list[dict]) -> None:
        """Encode each clip's first-frame condition missing from the cache (each rank a share)."""
        h = self.hparams

        def condition(pipeline, latents_of, s):
            b = s["bucket"]
            # the clip's own pixels, cropped as it was: F, C, H, W in [-1, 1]
            frames = load_frames(s["source"], s["frames"], s.get("times"))
            pixels = to_pixels(frames, b.height, b.width, h.crop, h.seed, s["key"])
            video = torch.cat([pixels[:1], torch.zeros_like(pixels[1:])])  # the first frame, then black
            out = {"condition_latents": latents_of(video[None])[0]}
            if getattr(pipeline, "image_encoder", None) is not None:
                out["image_embeds"] = image_tokens(pipeline, _image(pixels[0]))[0].float().cpu()
            return out

        self.encode_missing(samples, condition_key, condition)


class WanI2VFineTune(WanFineTune):
    """Flow-matching fine-tuning of a Wan image-to-video transformer (Wan2.1 I2V, Wan2.2 I2V-A14B with
    ``expert``); the arguments of :class:`recipes.wan.WanFineTune`."""

    family = "wan_i2v"
    # Wan2.1 I2V's cross-attention to the image tokens has its own key and value projections
    lora_targets = ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj"]

    def predict(self, batch):
        x0, condition = batch["latents"], batch["condition_latents"]  # B, C, f, h, w each
        noise, t = self.draws(x0, batch)
        tb = t.view(-1, 1, 1, 1, 1)
        xt = (1 - tb) * x0 + tb * noise
        # the first frame is given: its latent frame's mask channels are 1 (one per frame the VAE folds into it)
        temporal = (self.transformer.config.in_channels - 2 * x0.shape[1], *x0.shape[2:])
        mask = torch.zeros(x0.shape[0], *temporal, device=x0.device, dtype=x0.dtype)
        mask[:, :, 0] = 1
        pred = self.transformer(
            hidden_states=torch.cat([xt, mask, condition.to(xt.dtype)], dim=1),
            timestep=t * 1000,
            encoder_hidden_states=batch["prompt_embeds"],
            encoder_hidden_states_image=batch.get("image_embeds"),
            return_dict=False,
        )[0]
        return pred, noise - x0, t


class SampleWanI2V(SampleWan):
    """Image-to-video samples of fixed (image, prompt) pairs: ``images`` gives one image per prompt (the clip's
    first frame), resized to the sample size; without ``images``, prompt i starts from the first frame of the
    i-th clip of the training data. The other arguments as :class:`recipes.sampling.Samples`'s."""

    family = "wan_i2v"
    image_role = "first frame"

    def __init__(
        self,
        out_dir: str = "outputs/run",
        *,
        images: list[str] | None = None,
        every_n_steps: int = 0,
        prompts: list[str] | None = None,
        resolution: int = 32,
        width: int | None = None,
        num_frames: int = 4,
        num_inference_steps: int = 8,
        guidance_scale: float | None = None,
        negative_prompt: str = "",
        max_sequence_length: int = TEXT_TOKENS,
        seed: int = 0,
        fps: int = 8,
        vae_tiling: bool = False,
    ):
        super().__init__(
            out_dir,
            every_n_steps=every_n_steps,
            prompts=prompts,
            resolution=resolution,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            negative_prompt=negative_prompt,
            max_sequence_length=max_sequence_length,
            seed=seed,
            fps=fps,
            vae_tiling=vae_tiling,
        )
        self.images = list(images or [])
        if self.images and len(self.images) != len(self.prompts):
            raise ValueError(
                f"samples.images must give one image per prompt ({len(self.prompts)} prompts, {len(self.images)} "
                "images): an image-to-video sample starts from its image."
            )
        self.references: list[Image.Image] = []

    def prepare(self, trainer, pl_module) -> None:
        references = self.load_images(trainer)  # samples.images, else the first frames of the data's first clips
        super().prepare(trainer, pl_module)
        self.references = [image.resize((self.width, self.height)) for image in references]

    def render(self, pipeline, embeds, seed):
        index = (seed - self.seed) % len(self.references)  # prompt i renders with seed + i
        # the pipeline rounds num_frames to k x (the VAE's temporal factor) + 1, and a factor of 1 (the tiny VAE)
        # adds a frame to any count (diffusers 0.42.1): ask for one less there
        frames = self.num_frames - 1 if pipeline.vae_scale_factor_temporal == 1 else self.num_frames
        frames = pipeline(
            image=self.references[index],
            **embeds,
            height=self.height,
            width=self.width,
            num_frames=frames,
            num_inference_steps=self.steps,
            guidance_scale=self.guidance,
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
        ).frames
        return np.asarray(frames[0], dtype=np.float32)  # F, H, W, 3


WanI2VFineTune.sampler = SampleWanI2V  # the recipe's samples section (recipes/finetune.py)


def main(args=None):
    return cli(WanI2VFineTune, WanI2VData, args)


if __name__ == "__main__":
    main()

"""FLUX.3 fine-tuning (LoRA or full) with flow matching: text-to-image, or reference-image editing; its CLI.

    python -m recipes.flux3 fit --config configs/tiny_flux3_cp2.yaml                    # text to image
    python -m recipes.flux3 fit --config configs/tiny_flux3_cp2.yaml --data.edit=true   # edits of references

``Flux3Transformer2DModel`` takes three token modes: the noisy image, the text, and (its image-condition mode)
clean reference images; each passes its own blocks, then all meet in the joint blocks, and only the image tokens
reach the output. With ``data.edit`` (``model.edit`` follows it) the data are edit pairs in the layout the Kontext
recipe reads (``<data_dir>/<name>`` the target captioned with the instruction, ``control/<name>`` or a
``control_file_name`` column its reference: recipes/flux_kontext.py), and the reference's latents are fed as the
image-condition tokens (position ids with l = -1, timestep 0, as diffusers' Flux3ModularPipeline feeds them).
The library's plan (cp_lightning/models/flux3.py) splits every mode at the root, so context parallelism splits
the reference's tokens with the target's and the text's; the loss covers the image tokens, the model's only
output. The module carries no CP code.

Samples are rendered by diffusers' ``Flux3ModularPipeline`` (recipes/flux3_pipeline.py) with the training
transformer still split over its CP group; edit samples start from ``samples.images`` or, left out, the
references of the data's first pairs (``Samples.sample_images``), cropped and encoded as training encodes them.
"""

from __future__ import annotations

import numpy as np
import torch

from recipes.cache import CachedDataset
from recipes.data import FluxData
from recipes.encoded import EncodedData
from recipes.finetune import FlowMatchingFineTune, RecipeCLI
from recipes.flux3_pipeline import flux3_encoder, image_ids, text_ids
from recipes.flux_kontext import FluxKontextData, PairedDataset
from recipes.sampling import Samples

# the reference-image mode's input projection, blocks and modulations: no input in text-to-image training
IMAGE_COND_MODULES = (
    "x_embedders.image_cond",
    "mode_blocks.image_cond",
    "early_stream_modulations.image_cond",
    "single_stream_modulations.image_cond",
)


class Flux3Data(FluxKontextData):
    """Captioned images for FLUX.3 (the arguments of :class:`recipes.encoded.EncodedData`), or with ``edit`` the
    edit pairs of :class:`recipes.flux_kontext.FluxKontextData` (``synthetic_samples`` then writes recolouring
    pairs of shapes). ``max_sequence_length`` is the text window: every caption is encoded by FLUX.3's Qwen3-VL
    encoding padded to exactly that many tokens (the pipeline pads to multiples of 80; the transformer attends
    to the padding); the samples take the same window (``samples.max_sequence_length`` follows it).

    Args:
        edit: train reference-image editing on pairs (``model.edit`` follows this switch).
    """

    family = "flux3"

    def __init__(self, data_dir: str | None = None, *, edit: bool = False, **kwargs):
        # (kwargs pass through untouched: LightningCLI reads the other arguments from EncodedData's signature)
        self.edit = edit
        self.default_dir = FluxKontextData.default_dir if edit else EncodedData.default_dir
        self.dataset_class = PairedDataset if edit else CachedDataset
        super().__init__(data_dir, **kwargs)

    def geometry(self):
        from diffusers import AutoencoderKLFlux2

        vae = AutoencoderKLFlux2.load_config(self._pipeline_path(), subfolder="vae")
        return 2 ** (len(vae["block_out_channels"]) - 1) * 2, 1, 1  # the VAE's downsampling x 2x2 patches

    def tokens(self, bucket):
        image, text = FluxData.tokens(self, bucket)
        return (2 if self.edit else 1) * image, text  # a reference of the target's size joins as its own mode

    def encoder(self, pipeline):
        return flux3_encoder(pipeline, self.hparams.max_sequence_length)

    # text to image: the plain data of EncodedData; editing: FluxKontextData's pairs
    def prepare_data(self) -> None:
        (FluxKontextData if self.edit else EncodedData).prepare_data(self)

    def sources(self, folder) -> list:
        return (FluxKontextData if self.edit else EncodedData).sources(self, folder)

    def sample_references(self, count: int) -> list:
        return (FluxKontextData if self.edit else EncodedData).sample_references(self, count)

    def plan(self, cp: int = 1) -> list[dict]:
        return (FluxKontextData if self.edit else EncodedData).plan(self, cp)

    def encode_extra(self, samples: list[dict]) -> None:
        if self.edit:
            super().encode_extra(samples)


class Flux3FineTune(FlowMatchingFineTune):
    """Flow-matching fine-tuning of a ``Flux3Transformer2DModel`` (see FlowMatchingFineTune for the shared
    arguments). A step-distilled (flow-map) checkpoint is refused: fine-tune the base model.

    Args:
        edit: train with each sample's reference image as the image-condition tokens (set by ``data.edit``).
    """

    family = "flux3"
    lora_targets = ["to_q", "to_k", "to_v", "to_out.0"]  # the attention of every mode's blocks and the joint ones

    def __init__(self, pretrained: str = "tiny", *, edit: bool = False, **kwargs):
        super().__init__(pretrained, **kwargs)
        self.hparams.update(edit=edit)  # kwargs pass through untouched (LightningCLI reads them)

    def configure_model(self) -> None:
        from diffusers import Flux3Transformer2DModel

        from recipes.components import resolve_pretrained

        h = self.hparams
        path = resolve_pretrained(self.family, h.pretrained, h.cache_dir)
        config = Flux3Transformer2DModel.load_config(path, subfolder=self.transformer_subfolder)
        if self.transformer is None and config.get("flow_map"):  # before any weight loads
            raise ValueError(
                f"{h.pretrained} is a step-distilled (flow-map) FLUX.3 transformer, which samples by "
                "jumping between timesteps (target_timestep): flow-matching training needs the base model; use the "
                "non-distilled checkpoint."
            )
        super().configure_model()

    def unused_modules(self, transformer) -> list[str]:
        # text to image: the reference mode gets no tokens, so no gradient (DDP refuses such parameters)
        return [] if self.hparams.edit else list(IMAGE_COND_MODULES)

    def image_tokens(self, x0):
        return x0.shape[-2] * x0.shape[-1]  # latents are cached 2x2-patchified: one token per latent pixel

    def predict(self, batch):
        x0 = batch["latents"]  # B, C, h, w (patchified, standardised)
        b, c, h, w = x0.shape
        noise, t = self.draws(x0, batch)  # t from the full token count, never a CP shard's
        xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
        text = batch["prompt_embeds"]  # B, L, D
        device, dtype = x0.device, x0.dtype
        reference = {}
        if self.hparams.edit:
            if "control_latents" not in batch:
                raise ValueError("model.edit is set but the batch has no reference (control_latents): set data.edit.")
            ref = batch["control_latents"].to(dtype)  # B, C, h', w' -> B, h' w', C; the first reference, l = -1
            reference = {
                "image_cond_hidden_states": ref.flatten(2).transpose(1, 2),
                "image_cond_ids": image_ids(*ref.shape[-2:], reference=1).to(device, dtype),
            }
        pred = self.transformer(
            hidden_states=xt.flatten(2).transpose(1, 2),  # B, C, h, w -> B, h w, C
            encoder_hidden_states=text,
            timestep=t,  # in [0, 1], as the pipeline passes it (the scheduler's timesteps / 1000)
            img_ids=image_ids(h, w).to(device, dtype),
            txt_ids=text_ids(text.shape[1]).to(device, dtype),
            return_dict=False,
            **reference,
        )[0]
        return pred, (noise - x0).flatten(2).transpose(1, 2), t


class SampleFlux3(Samples):
    """Samples rendered by diffusers' Flux3ModularPipeline with the training transformer (context parallel):
    text to image, or (``model.edit``) edits of a reference per prompt: ``images`` gives them; without it, prompt
    i edits the reference of the data's i-th pair (so ``--data.data_dir`` alone moves the samples to one's own
    pairs). A reference is cropped to the sample size and encoded as training encodes its references.
    ``guidance_scale`` is classifier-free guidance against ``negative_prompt`` above 1.0 (FLUX.3's pipeline:
    3.5). The other arguments as :class:`recipes.sampling.Samples`'s."""

    family = "flux3"
    default_guidance = 3.5  # Flux3ModularPipeline's classifier-free guidance
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
        negative_prompt: str = "",
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
            negative_prompt=negative_prompt,
            max_sequence_length=max_sequence_length,
            seed=seed,
        )
        self.images = list(images or [])
        if self.images and len(self.images) != len(self.prompts):
            raise ValueError(
                f"samples.images must give one reference image per prompt ({len(self.prompts)} prompts, "
                f"{len(self.images)} images), or be left out (the references of the data's first pairs)."
            )
        self.references: list[torch.Tensor] = []  # each prompt's reference latents (1, C, h, w), edit samples

    def prepare(self, trainer, pl_module) -> None:
        edit = pl_module.hparams.edit
        if self.images and not edit:
            raise ValueError(
                "samples.images gives reference images, but this run trains text to image: set data.edit=true "
                "(edit pairs), or leave samples.images out."
            )
        sources = self.sample_images(getattr(trainer, "datamodule", None)) if edit else []
        super().prepare(trainer, pl_module)
        multiple = self.pipeline.token_size
        if self.height % multiple or self.width % multiple:
            raise ValueError(
                f"samples.resolution {self.height} x {self.width} does not fit the model: both sides must be "
                f"multiples of {multiple} (the VAE's downsampling x the 2x2 patches)."
            )
        self.references = self.encode_references(self.pipeline, sources)

    def encode_references(self, pipeline, sources) -> list[torch.Tensor]:
        """Each source's first frame cropped to the sample size (centre) and encoded as the data's references."""
        from recipes.flux3_pipeline import encode_latents
        from recipes.media import load_frames, to_pixels

        with torch.no_grad():
            return [
                encode_latents(pipeline.vae, to_pixels(load_frames(s, [0]), self.height, self.width)) for s in sources
            ]

    def encode(self, pipeline, prompt):
        from recipes.flux3_pipeline import encode_prompts

        out = {"prompt_embeds": encode_prompts(pipeline, [prompt], self.max_sequence_length)}
        if self.guidance > 1.0:  # classifier-free guidance against the negative prompt ("" is unconditional)
            out["negative_prompt_embeds"] = encode_prompts(pipeline, [self.negative_prompt], self.max_sequence_length)
        return out

    def render(self, pipeline, embeds, seed):
        kwargs = dict(embeds)
        if self.references:
            index = (seed - self.seed) % len(self.references)  # prompt i renders with seed + i
            kwargs["image_cond_latents"] = [self.references[index]]
        images = pipeline.denoiser(self.guidance)(
            **kwargs,
            height=self.height,
            width=self.width,
            num_inference_steps=self.steps,
            generator=torch.Generator().manual_seed(seed),
            output="images",
            output_type="np",
        )
        return np.asarray(images[:1], dtype=np.float32)  # 1, H, W, 3


Flux3FineTune.sampler = SampleFlux3  # the recipe's samples section (recipes/finetune.py)


class Flux3CLI(RecipeCLI):
    """RecipeCLI with ``model.edit`` following ``data.edit`` (the data and the model agree on the mode) and
    ``samples.max_sequence_length`` following ``data.max_sequence_length`` (the samples see the text window
    training saw: the transformer attends to its padding)."""

    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        parser.link_arguments("data.edit", "model.edit")
        parser.link_arguments("data.max_sequence_length", "samples.max_sequence_length")


def main(args=None):
    return Flux3CLI(
        Flux3FineTune, Flux3Data, args=args, seed_everything_default=0, save_config_kwargs={"overwrite": True}
    )


if __name__ == "__main__":
    main()

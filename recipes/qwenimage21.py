"""Qwen-Image 2.1 text-to-image LoRA (or full) fine-tuning with flow matching; a LightningModule and its CLI.

    python -m recipes.qwenimage21 fit --config configs/tiny_qwenimage21_cp2.yaml

Qwen-Image 2.1 is one stream: the caption's Qwen3-VL tokens and the target image's latent tokens (one per 16 x 16
pixels, unpatched) form one joint sequence, attended block-causally (the text causal, the image bidirectional,
after all of the text), with the text modulated at t = 0. The recipe carries no CP code: the plan library's entry
(cp_lightning/models/qwenimage21.py) splits the joint sequence over the CP group and runs the model's segments as
one masked CP attention (docs/masks.md), so every layout trains on the same attention; the predictions are
gathered after ``proj_out`` and the recipe keeps the image's. Samples are rendered by ``QwenImage21Pipeline``
without its prefix KV cache (which no CP rank could hold whole). Times are shifted by the image token count as the
pipeline's scheduler samples (its ``calculate_shift`` ends); noise and times are drawn per sample from a generator
seeded by (seed, epoch, sample index), so any dp x cp layout trains on the same draws.

Text: each caption's embeddings are cached padded to ``max_sequence_length`` with their mask; a batch is cut to its
longest caption (right padding, masked, as the pipeline pads a batch of prompts), because the text's length moves
the image's position on RoPE's frame axis: a caption alone trains as the pipeline renders it.
"""

from __future__ import annotations

import numpy as np
import torch

from recipes.data import EncodedData
from recipes.finetune import FlowMatchingFineTune, cli
from recipes.qwenimage21_parts import check_processor, encode_text, latents_of, shift_ends
from recipes.sampling import Samples

VAE_SCALE = 16  # QwenImage21Pipeline's vae_scale_factor (hard-coded there): pixels per latent token side


class QwenImage21Data(EncodedData):
    """Captioned images for Qwen-Image 2.1; the arguments of :class:`~recipes.encoded.EncodedData`
    (``max_sequence_length``: Qwen3-VL tokens per caption after the prompt template's system prompt, padded and
    masked; a longer caption is an error, as the pipeline never truncates). Sides must be multiples of 32: the
    pipeline's 16x VAE, and the text encoder's image slots that stand for 2 x 2 latent tokens each. The text tokens
    are split across the CP group with the image tokens (one joint sequence)."""

    family = "qwenimage21"

    def __init__(self, data_dir: str | None = None, *, max_sequence_length: int = 512, **kwargs):
        # (kwargs pass through untouched: LightningCLI reads the other arguments from EncodedData's signature)
        if not 1 <= max_sequence_length <= 4096:
            raise ValueError(f"max_sequence_length must be in [1, 4096], got {max_sequence_length}.")
        super().__init__(data_dir, max_sequence_length=max_sequence_length, **kwargs)
        check_processor(self.hparams.pretrained)

    def geometry(self):
        return 2 * VAE_SCALE, 1, 1  # the VAE's 16x x the 2 x 2 latent tokens of an encoder image slot

    def tokens(self, bucket):
        image = (bucket.height // VAE_SCALE) * (bucket.width // VAE_SCALE)
        return image, self.hparams.max_sequence_length  # at most: a batch is cut to its longest caption

    def encoder(self, pipeline):
        n = self.hparams.max_sequence_length
        return (lambda pixels: latents_of(pipeline.vae, pixels)), (lambda captions: encode_text(pipeline, captions, n))


class SampleQwenImage21(Samples):
    __doc__ = Samples.__doc__
    family = "qwenimage21"

    def __init__(self, out_dir: str = "outputs/run", *, true_cfg_scale: float = 1.0, **kwargs):
        # (kwargs pass through untouched: LightningCLI reads the other arguments from Samples' signature)
        if kwargs.get("guidance_scale") is not None:
            raise ValueError(
                "samples.guidance_scale: Qwen-Image 2.1 has no distilled guidance; it samples without guidance (its "
                "pipeline's default), or with classifier-free guidance: samples.true_cfg_scale with negative_prompt."
            )
        if not true_cfg_scale >= 1.0:
            raise ValueError(
                f"samples.true_cfg_scale must be >= 1.0 (1.0: no classifier-free guidance), got {true_cfg_scale}."
            )
        super().__init__(out_dir, **kwargs)
        self.true_cfg = true_cfg_scale
        for name, side in (("resolution", self.height), ("width", self.width)):
            if side % (2 * VAE_SCALE):
                raise ValueError(
                    f"samples.{name}={side} does not fit Qwen-Image 2.1: it must be a multiple of {2 * VAE_SCALE} "
                    f"(the pipeline would render {side // (2 * VAE_SCALE) * 2 * VAE_SCALE} instead)."
                )

    def encode(self, pipeline, prompt):
        def encode(text):  # the caption's own tokens, unpadded, as the pipeline encodes one prompt
            embeds, mask, _ = pipeline.encode_prompt(text)
            if mask is None:  # (the pipeline gives None for an unpadded prompt)
                mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
            return embeds, mask

        embeds, mask = encode(prompt)
        out = {"prompt_embeds": embeds, "prompt_embeds_mask": mask, "true_cfg_scale": self.true_cfg}
        if self.true_cfg > 1.0:  # classifier-free guidance against the negative prompt ("" is unconditional)
            negative, negative_mask = encode(self.negative_prompt)
            out.update(negative_prompt_embeds=negative, negative_prompt_embeds_mask=negative_mask)
        return out

    def render(self, pipeline, embeds, seed):
        image = pipeline(
            **embeds,
            height=self.height,
            width=self.width,
            num_inference_steps=self.steps,
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
            use_kv_cache=False,  # a prefix cache is inference no CP rank can hold; without it, every step is exact
        ).images
        return image[:1, ..., :3].astype(np.float32)  # 1, H, W, 3 (a real VAE's alpha dropped)


class QwenImage21FineTune(FlowMatchingFineTune):
    """Flow-matching fine-tuning of a ``QwenImage21Transformer2DModel`` (see FlowMatchingFineTune for the shared
    arguments; ``resolution_shift`` is on by default: the shift exp(mu) that QwenImage21Pipeline's scheduler samples
    with, mu linear in the image token count between its scheduler's ends). A checkpoint other than ``tiny`` needs
    torchvision for its processor (checked here, before anything loads)."""

    family = "qwenimage21"
    sampler = SampleQwenImage21
    # the attention projections of every (single-stream) block
    lora_targets = ["to_q", "to_k", "to_v", "to_out.0"]

    def __init__(self, pretrained: str = "tiny", *, resolution_shift: bool = True, **kwargs):
        # (kwargs pass through untouched: LightningCLI reads the shared arguments from this call)
        super().__init__(pretrained, resolution_shift=resolution_shift, **kwargs)
        check_processor(pretrained)

    def configure_model(self) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler

        from recipes.components import resolve_pretrained

        strategy = self._trainer.strategy if self._trainer is not None else None
        if getattr(strategy, "loss_parallel", False):
            raise ValueError(
                "loss_parallel=True keeps each rank's shard of the model's output, which for Qwen-Image 2.1 is the "
                "joint [text | image] sequence, while the loss reads only its image tokens: set the strategy's "
                "loss_parallel to false (the default; the output is then gathered after proj_out)."
            )
        super().configure_model()
        h = self.hparams
        path = resolve_pretrained(self.family, h.pretrained, h.cache_dir)
        self.shift_range = shift_ends(FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler"))

    def image_tokens(self, x0):
        return x0.shape[-2] * x0.shape[-1]  # one token per latent pixel

    def predict(self, batch):
        x0 = batch["latents"]  # B, C, h, w
        b, c, h, w = x0.shape
        noise, t = self.draws(x0, batch)  # t from the full token count, never a CP shard's
        xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
        # B, C, h, w -> B, h w, C: QwenImage21Pipeline._pack_latents (a plain spatial flatten)
        packed = xt.flatten(2).transpose(1, 2)
        target = (noise - x0).flatten(2).transpose(1, 2)
        # the batch's text cut to its longest caption (the rest is padding in every sample)
        mask = batch["prompt_embeds_mask"]
        n = int(mask.sum(dim=1).max())
        embeds, mask = batch["prompt_embeds"][:, :n], mask[:, :n]
        # the encoder's sequence: n text positions, then one image slot per 2 x 2 latent tokens (the pipeline's
        # append_target_slots)
        img_mask = torch.ones(b, n + h * w // 4, dtype=torch.bool, device=mask.device)
        img_mask[:, :n] = False
        pred = self.transformer(
            hidden_states=packed,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,  # as the pipeline: no mask when unpadded
            timestep=t,  # as the pipeline calls it: timesteps / 1000, in [0, 1]
            img_shapes=[[(1, h, w)]] * b,
            img_mask=img_mask,
            return_dict=False,
        )[0]
        return pred[:, -h * w :], target, t  # the joint sequence's image tokens (last)


def main(args=None):
    return cli(QwenImage21FineTune, QwenImage21Data, args)


if __name__ == "__main__":
    main()

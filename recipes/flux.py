"""Flux text-to-image fine-tuning (LoRA or full) with flow matching; a LightningModule and its CLI.

    python -m recipes.flux fit --config configs/tiny_flux_cp2.yaml

The module carries no context-parallel code: ContextParallelStrategy (chosen in the config)
parallelizes the transformer, and ``loss_shard`` is a no-op unless the strategy runs loss-parallel.
Noise and timesteps are drawn per sample from a generator seeded by (seed, epoch, sample index), so a
run gives the same losses at any dp x cp layout (see recipes/training.py).
"""

from __future__ import annotations

import torch

from recipes.data import FluxData
from recipes.finetune import FlowMatchingFineTune, cli


class FluxFineTune(FlowMatchingFineTune):
    """Flow-matching fine-tuning of a ``FluxTransformer2DModel`` (see FlowMatchingFineTune for the
    shared arguments).

    Args:
        guidance_scale: value fed to Flux's guidance embedding (for guidance-distilled checkpoints).
    """

    family = "flux"
    lora_targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]

    def __init__(self, pretrained: str = "tiny", *, guidance_scale: float = 1.0, **kwargs):
        super().__init__(pretrained, **kwargs)
        self.hparams.update(guidance_scale=guidance_scale)  # kwargs pass through untouched (LightningCLI reads them)

    def image_tokens(self, x0):
        return (x0.shape[-2] // 2) * (x0.shape[-1] // 2)  # 2x2 packed latent patches

    def predict(self, batch):
        from diffusers import FluxPipeline

        x0 = batch["latents"]  # B, C, h, w
        b, c, h, w = x0.shape
        noise, t = self.draws(x0, batch)  # t from the full token count, never a CP shard's
        xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
        # B, C, h, w -> B, (h/2)(w/2), 4C: Flux's 2x2 packed latent tokens
        packed = FluxPipeline._pack_latents(xt, b, c, h, w)
        target = FluxPipeline._pack_latents(noise - x0, b, c, h, w)
        img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, x0.device, x0.dtype)
        text = batch["prompt_embeds"]
        txt_ids = torch.zeros(text.shape[1], 3, device=x0.device, dtype=x0.dtype)
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((b,), self.hparams.guidance_scale, device=x0.device)
        pred = self.transformer(
            hidden_states=packed,
            timestep=t,
            guidance=guidance,
            pooled_projections=batch["pooled_prompt_embeds"],
            encoder_hidden_states=text,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        return pred, target, t


def main(args=None):
    return cli(FluxFineTune, FluxData, args)


if __name__ == "__main__":
    main()

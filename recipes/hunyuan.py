"""HunyuanVideo text-to-video LoRA (or full) fine-tuning with flow matching; a LightningModule and its CLI.

    python -m recipes.hunyuan fit --config configs/tiny_hunyuan_cp2.yaml

Like recipes/wan.py it carries no CP code. HunyuanVideo's CP plan (cp_lightning/models/hunyuan.py) runs the
text token refiner whole on every rank, then splits both the video and the Llama text tokens (they meet in
every block's joint attention) and gathers the video after ``proj_out``. The text padding mask travels with
the batch: the transformer masks padded keys. Noise and timesteps are drawn per sample from a generator seeded
by (seed, epoch, sample index), so any dp x cp layout trains on the same draws.
"""

from __future__ import annotations

import torch

from recipes.components import HUNYUAN_SHIFT
from recipes.data import HunyuanData
from recipes.finetune import FlowMatchingFineTune, cli


class HunyuanFineTune(FlowMatchingFineTune):
    """Flow-matching fine-tuning of a ``HunyuanVideoTransformer3DModel`` (see FlowMatchingFineTune for the
    shared arguments).

    Args:
        shift: the fixed time shift of the training times; by default HunyuanVideo's flow shift 7.0 (its
            pipeline's scheduler), which weights training towards the noisy end as the model samples.
        guidance_scale: value fed to HunyuanVideo's guidance embedding while training (the pipeline feeds
            1000 x this); 1.0, as the usual HunyuanVideo LoRA trainers do. Samples use 6.0 (``samples``).
    """

    family = "hunyuan"
    # the attention projections of the dual-stream (video and text) and single-stream blocks
    lora_targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]

    def __init__(
        self, pretrained: str = "tiny", *, shift: float = HUNYUAN_SHIFT, guidance_scale: float = 1.0, **kwargs
    ):
        # (kwargs pass through untouched: LightningCLI reads the shared arguments from this call)
        super().__init__(pretrained, shift=shift, **kwargs)
        if not guidance_scale > 0:
            raise ValueError(f"guidance_scale must be > 0 (HunyuanVideo LoRAs train with 1.0), got {guidance_scale}.")
        self.hparams.update(guidance_scale=guidance_scale)

    def image_tokens(self, x0):
        config = self.transformer.config
        p, p_t = config.patch_size, config.patch_size_t
        return (x0.shape[-3] // p_t) * (x0.shape[-2] // p) * (x0.shape[-1] // p)  # latent frames x 2x2 patches

    def predict(self, batch):
        x0 = batch["latents"]  # B, C, f, h, w
        noise, t = self.draws(x0, batch)
        tb = t.view(-1, 1, 1, 1, 1)
        xt = (1 - tb) * x0 + tb * noise
        # as the pipeline calls it: timesteps in [0, 1000], guidance x 1000
        guidance = torch.full((x0.shape[0],), 1000.0 * self.hparams.guidance_scale, device=x0.device, dtype=x0.dtype)
        pred = self.transformer(
            hidden_states=xt,
            timestep=t * 1000,
            encoder_hidden_states=batch["prompt_embeds"],
            encoder_attention_mask=batch["prompt_attention_mask"],
            pooled_projections=batch["pooled_prompt_embeds"],
            guidance=guidance,
            return_dict=False,
        )[0]
        return pred, noise - x0, t


def main(args=None):
    return cli(HunyuanFineTune, HunyuanData, args)


if __name__ == "__main__":
    main()

"""Wan text-to-video LoRA (or full) fine-tuning with flow matching; a LightningModule and its CLI.

    python -m recipes.wan fit --config configs/tiny_wan_cp2.yaml

Like recipes/flux.py it carries no CP code; Wan's CP plan splits the video tokens and keeps the text
(cross-attention keys) whole on every rank. Noise and timesteps are drawn per sample from a generator
seeded by (seed, epoch, sample index), so any dp x cp layout trains on the same draws.
"""

from __future__ import annotations

from recipes.data import WanData
from recipes.finetune import FlowMatchingFineTune, cli


class WanFineTune(FlowMatchingFineTune):
    __doc__ = "Flow-matching fine-tuning of a ``WanTransformer3DModel``.\n" + FlowMatchingFineTune.__doc__

    family = "wan"
    lora_targets = ["to_q", "to_k", "to_v", "to_out.0"]

    def image_tokens(self, x0):
        return x0.shape[-3] * (x0.shape[-2] // 2) * (x0.shape[-1] // 2)  # frames x 2x2 patches

    def predict(self, batch):
        x0 = batch["latents"]  # B, C, f, h, w
        noise, t = self.noise_and_t(x0, batch["index"])
        tb = t.view(-1, 1, 1, 1, 1)
        xt = (1 - tb) * x0 + tb * noise
        # Wan's scheduler counts timesteps in [0, 1000]
        pred = self.transformer(
            hidden_states=xt, timestep=t * 1000, encoder_hidden_states=batch["prompt_embeds"], return_dict=False
        )[0]
        return pred, noise - x0, t


def main(args=None):
    return cli(WanFineTune, WanData, args)


if __name__ == "__main__":
    main()

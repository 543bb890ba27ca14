"""Wan text-to-video LoRA (or full) fine-tuning with flow matching; a LightningModule and its CLI.

    python -m recipes.wan fit --config configs/tiny_wan_cp2.yaml

Like recipes/flux.py it carries no CP code; Wan's CP plan splits the video tokens and keeps the text
(cross-attention keys) whole on every rank. Noise and timesteps are drawn per sample from a generator
seeded by (seed, epoch, sample index), so any dp x cp layout trains on the same draws.
"""

from __future__ import annotations

from recipes.data import WanData
from recipes.finetune import FlowMatchingFineTune, cli

EXPERTS = {"high_noise": "transformer", "low_noise": "transformer_2"}


class WanFineTune(FlowMatchingFineTune):
    """Flow-matching fine-tuning of a ``WanTransformer3DModel`` (see FlowMatchingFineTune for the shared
    arguments).

    Args:
        expert: for Wan2.2 A14B, which of its two experts to train: ``high_noise`` (``transformer``, used for
            t >= boundary_ratio) or ``low_noise`` (``transformer_2``, t < boundary_ratio). The training times
            are mapped into that expert's range; train one run per expert. None for single-model Wan.
        boundary_ratio: the experts' boundary (Wan2.2 A14B T2V: 0.875, the pipeline's ``boundary_ratio``).
    """

    family = "wan"
    lora_targets = ["to_q", "to_k", "to_v", "to_out.0"]

    def __init__(self, pretrained: str = "tiny", *, expert: str | None = None, boundary_ratio: float = 0.875, **kwargs):
        # (kwargs pass through untouched: LightningCLI reads the shared arguments from this call)
        super().__init__(pretrained, **kwargs)
        self.hparams.update(expert=expert, boundary_ratio=boundary_ratio)
        self.transformer_subfolder = EXPERTS.get(expert, "transformer")
        if expert is None:
            return
        if expert not in EXPERTS:
            raise ValueError(f"expert must be one of {sorted(EXPERTS)} (Wan2.2 A14B) or None, got {expert!r}.")
        if not 0.0 < boundary_ratio < 1.0:
            raise ValueError(f"boundary_ratio must be in (0, 1), got {boundary_ratio}.")
        low, high = (boundary_ratio, 1.0) if expert == "high_noise" else (0.0, boundary_ratio)
        h = self.hparams
        if (h.min_timestep, h.max_timestep) not in ((0.0, 1.0), (low, high)):
            raise ValueError(
                f"expert={expert!r} trains on t in [{low}, {high}] (boundary_ratio={boundary_ratio}); "
                "drop min_timestep/max_timestep, or set boundary_ratio."
            )
        h.update(min_timestep=low, max_timestep=high)

    def image_tokens(self, x0):
        return x0.shape[-3] * (x0.shape[-2] // 2) * (x0.shape[-1] // 2)  # frames x 2x2 patches

    def predict(self, batch):
        x0 = batch["latents"]  # B, C, f, h, w
        noise, t = self.draws(x0, batch)
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

"""Wan text-to-video LoRA (or full) fine-tuning with flow matching; a LightningModule and its CLI.

    python -m recipes.wan fit --config configs/tiny_wan_cp2.yaml

Like recipes/flux.py it carries no CP code; Wan's CP plan splits the video tokens and keeps the text
(cross-attention keys) whole on every rank. Noise and timesteps are drawn per sample from a generator
seeded by (seed, epoch, sample index), so any dp x cp layout trains on the same draws.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI

from recipes.components import load_transformer
from recipes.data import WanData
from recipes.flux import per_sample_noise

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


class WanFineTune(L.LightningModule):
    """Flow-matching fine-tuning of a ``WanTransformer3DModel``.

    Args:
        pretrained: ``tiny`` or a Wan diffusers checkpoint path / hub id.
        cache_dir: where the tiny pipeline is built.
        lora_rank: LoRA rank on the attention projections; 0 fine-tunes every weight.
        learning_rate: AdamW learning rate.
        timestep_sampling: ``logit_normal`` or ``uniform``.
        gradient_checkpointing: recompute each block in backward.
        weights_dtype: dtype the frozen weights load in (``bfloat16`` for real checkpoints).
        seed: seeds LoRA initialisation and the per-sample noise.
    """

    def __init__(
        self,
        pretrained: str = "tiny",
        cache_dir: str = "outputs/cache",
        lora_rank: int = 4,
        learning_rate: float = 1e-3,
        timestep_sampling: str = "logit_normal",
        gradient_checkpointing: bool = False,
        weights_dtype: str = "float32",
        seed: int = 0,
    ):
        super().__init__()
        if timestep_sampling not in ("logit_normal", "uniform"):
            raise ValueError(f"timestep_sampling must be 'logit_normal' or 'uniform', got {timestep_sampling!r}.")
        if not isinstance(getattr(torch, weights_dtype, None), torch.dtype):
            raise ValueError(f"weights_dtype must name a torch dtype such as 'bfloat16', got {weights_dtype!r}.")
        self.save_hyperparameters()
        self.transformer = None

    def configure_model(self) -> None:
        if self.transformer is not None:
            return
        from recipes.flux import prepare_for_training

        h = self.hparams
        transformer = load_transformer("wan", h.pretrained, h.cache_dir, torch_dtype=getattr(torch, h.weights_dtype))
        self.transformer = prepare_for_training(
            transformer, h.lora_rank, LORA_TARGETS, h.seed, h.gradient_checkpointing
        )

    def training_step(self, batch, batch_idx):
        x0 = batch["latents"]  # B, C, f, h, w
        noise, t = per_sample_noise(
            x0, batch["index"], self.hparams.seed, self.current_epoch, self.hparams.timestep_sampling
        )
        tb = t.view(-1, 1, 1, 1, 1)
        xt = (1 - tb) * x0 + tb * noise
        # Wan's scheduler counts timesteps in [0, 1000]
        pred = self.transformer(
            hidden_states=xt, timestep=t * 1000, encoder_hidden_states=batch["prompt_embeds"], return_dict=False
        )[0]
        loss = F.mse_loss(pred.float(), (noise - x0).float())
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"non-finite loss {loss.item()} at step {self.global_step}")
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        params = [p for p in self.transformer.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.hparams.learning_rate, weight_decay=1e-4)


def main(args=None) -> LightningCLI:
    return LightningCLI(
        WanFineTune, WanData, seed_everything_default=0, save_config_kwargs={"overwrite": True}, args=args
    )


if __name__ == "__main__":
    main()

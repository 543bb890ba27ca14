"""Flux text-to-image fine-tuning (LoRA or full) with flow matching; a LightningModule and its CLI.

    python -m recipes.flux fit --config configs/tiny_flux_cp2.yaml

The module carries no context-parallel code: ContextParallelStrategy (chosen in the config)
parallelizes the transformer, and ``loss_shard`` is a no-op unless the strategy runs loss-parallel.
Noise and timesteps are drawn per sample from a generator seeded by (seed, epoch, sample index), so a
run gives the same losses at any dp x cp layout.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI

from cp_lightning import loss_shard
from recipes.components import load_transformer
from recipes.data import FluxData

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


def prepare_for_training(transformer, lora_rank: int, targets: list[str], seed: int, checkpointing: bool):
    """Add a LoRA adapter (``lora_rank > 0``, base frozen) with a layout-independent init; trainable
    weights in fp32; optional gradient checkpointing."""
    if lora_rank:
        from peft import LoraConfig

        transformer.requires_grad_(False)
        with torch.random.fork_rng():  # the same adapter init at every layout
            torch.manual_seed(seed)
            transformer.add_adapter(
                LoraConfig(r=lora_rank, lora_alpha=lora_rank, init_lora_weights="gaussian", target_modules=targets)
            )
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # trainable weights (and so their AdamW state) in fp32
    if checkpointing:
        transformer.enable_gradient_checkpointing()
    return transformer


def per_sample_noise(latents: torch.Tensor, index: torch.Tensor, seed: int, epoch: int, sampling: str):
    """Noise and flow-matching times t in (0, 1) per sample, from a generator seeded by (seed, epoch,
    sample index): the same draws whatever the dp x cp layout or batch composition."""
    noise, t = torch.empty_like(latents), torch.empty(latents.shape[0], dtype=latents.dtype)
    for i, item in enumerate(index.tolist()):
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch * 100_003 + item)
        noise[i] = torch.randn(latents.shape[1:], generator=g, dtype=latents.dtype)
        t[i] = (
            torch.sigmoid(torch.randn((), generator=g)) if sampling == "logit_normal" else torch.rand((), generator=g)
        )
    return noise, t.to(latents.device)


class FluxFineTune(L.LightningModule):
    """Flow-matching fine-tuning of a ``FluxTransformer2DModel``.

    Args:
        pretrained: ``tiny`` (random-init tiny architecture) or a Flux checkpoint path / hub id.
        cache_dir: where the tiny pipeline is built.
        lora_rank: LoRA rank on the attention projections; 0 fine-tunes every weight.
        learning_rate: AdamW learning rate.
        guidance_scale: value fed to Flux's guidance embedding (for guidance-distilled checkpoints).
        timestep_sampling: ``logit_normal`` (SD3/Flux practice) or ``uniform``.
        gradient_checkpointing: recompute each block in backward.
        weights_dtype: dtype the (frozen) weights load in, e.g. ``bfloat16`` for LoRA on large models;
            trainable parameters are kept in float32.
        seed: seeds LoRA initialisation and the per-sample noise.
    """

    def __init__(
        self,
        pretrained: str = "tiny",
        cache_dir: str = "outputs/cache",
        lora_rank: int = 4,
        learning_rate: float = 1e-3,
        guidance_scale: float = 1.0,
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
        if lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0: full fine-tuning), got {lora_rank}.")
        self.save_hyperparameters()
        self.transformer = None

    def configure_model(self) -> None:
        if self.transformer is not None:
            return
        h = self.hparams
        transformer = load_transformer("flux", h.pretrained, h.cache_dir, torch_dtype=getattr(torch, h.weights_dtype))
        self.transformer = prepare_for_training(
            transformer, h.lora_rank, LORA_TARGETS, h.seed, h.gradient_checkpointing
        )

    def training_step(self, batch, batch_idx):
        from diffusers import FluxPipeline

        x0 = batch["latents"]  # B, C, h, w
        b, c, h, w = x0.shape
        noise, t = per_sample_noise(
            x0, batch["index"], self.hparams.seed, self.current_epoch, self.hparams.timestep_sampling
        )
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
        loss = F.mse_loss(pred.float(), loss_shard(target, self.transformer).float())
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"non-finite loss {loss.item()} at step {self.global_step}")
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        params = [p for p in self.transformer.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.hparams.learning_rate, weight_decay=1e-4)


def main(args=None) -> LightningCLI:
    return LightningCLI(
        FluxFineTune, FluxData, seed_everything_default=0, save_config_kwargs={"overwrite": True}, args=args
    )


if __name__ == "__main__":
    main()

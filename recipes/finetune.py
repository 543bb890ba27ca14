"""What the fine-tuning recipes share: LoRA set-up, per-sample noise, the flow-matching step's frame.

A recipe subclasses :class:`FlowMatchingFineTune` with its model family and ``predict`` (model output
and flow-matching target for a batch); it carries no context-parallel code.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI

from cp_lightning import loss_shard
from recipes.components import load_transformer


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


def flow_matching_loss(pred: torch.Tensor, target: torch.Tensor, transformer, step: int) -> torch.Tensor:
    """MSE in fp32 between the model output and the flow-matching target; a non-finite loss is an error."""
    # loss_shard: the target's shard in loss-parallel mode, the target itself otherwise
    loss = F.mse_loss(pred.float(), loss_shard(target, transformer).float())
    if not math.isfinite(loss.item()):
        raise FloatingPointError(f"non-finite loss {loss.item()} at step {step}")
    return loss


class FlowMatchingFineTune(L.LightningModule):
    """Flow matching: x_t = (1 - t) x_0 + t noise, the model predicts noise - x_0 (MSE).

    Args:
        pretrained: ``tiny`` (random-init tiny architecture) or a checkpoint path / hub id.
        cache_dir: where the tiny pipeline is built.
        lora_rank: LoRA rank on the attention projections; 0 fine-tunes every weight.
        learning_rate: AdamW learning rate.
        timestep_sampling: ``logit_normal`` (SD3/Flux practice) or ``uniform``.
        gradient_checkpointing: recompute each block in backward.
        weights_dtype: dtype the (frozen) weights load in, e.g. ``bfloat16`` for LoRA on large models;
            trainable parameters are kept in float32.
        seed: seeds LoRA initialisation and the per-sample noise.
    """

    family = ""
    lora_targets: list[str] = []

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
        if lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0: full fine-tuning), got {lora_rank}.")
        self.save_hyperparameters()
        self.transformer = None

    def configure_model(self) -> None:
        if self.transformer is not None:
            return
        h = self.hparams
        dtype = getattr(torch, h.weights_dtype)
        transformer = load_transformer(self.family, h.pretrained, h.cache_dir, torch_dtype=dtype)
        self.transformer = prepare_for_training(
            transformer, h.lora_rank, self.lora_targets, h.seed, h.gradient_checkpointing
        )

    def noise_and_t(self, x0: torch.Tensor, index: torch.Tensor):
        return per_sample_noise(x0, index, self.hparams.seed, self.current_epoch, self.hparams.timestep_sampling)

    def predict(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(model output, flow-matching target) for a batch."""
        raise NotImplementedError

    def training_step(self, batch, batch_idx):
        pred, target = self.predict(batch)
        loss = flow_matching_loss(pred, target, self.transformer, self.global_step)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        params = [p for p in self.transformer.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.hparams.learning_rate, weight_decay=1e-4)


def cli(module_class, data_class, args=None) -> LightningCLI:
    return LightningCLI(
        module_class, data_class, seed_everything_default=0, save_config_kwargs={"overwrite": True}, args=args
    )

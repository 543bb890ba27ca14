"""A tiny flow-matching LightningModule, its data, and a plain single-process reference loop.

Importable by spawned workers. Samples are fully determined by their index (latents, text, noise,
timestep), so a dp x cp run and the one-process reference see the same global batches; the
``noise="rng"`` variant draws noise from torch's global RNG instead, to test the strategy's seeding.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, DistributedSampler

from cp_lightning import loss_shard
from cp_lightning.tiny import tiny_inputs, tiny_model

TOKENS, TEXT_TOKENS = 16, 8


class Samples(Dataset):
    def __init__(self, n: int = 12, tokens: int = TOKENS, text_tokens: int = TEXT_TOKENS):
        self.n, self.tokens, self.text_tokens = n, tokens, text_tokens

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(1000 + index)
        return {
            "latents": torch.randn(self.tokens, 16, generator=g),
            "text": torch.randn(self.text_tokens, 32, generator=g),
            "pooled": torch.randn(32, generator=g),
            "noise": torch.randn(self.tokens, 16, generator=g),
            "t": torch.rand((), generator=g),
            "index": torch.tensor(index),
        }


class FlowMatching(L.LightningModule):
    def __init__(
        self,
        optimizer: str = "sgd",
        lr: float = 0.05,
        checkpointing: bool = False,
        lora: bool = False,
        noise: str = "sample",
        record_dir: str | None = None,
        fail_at_step: int | None = None,
        fail_rank: int | None = None,
        tokens: int = TOKENS,
        text_tokens: int = TEXT_TOKENS,
        pretrained: str | None = None,
        meta: bool = False,
    ):
        """``pretrained``: a diffusers folder of the tiny Flux to load (``from_pretrained``, or with ``meta`` built
        on the meta device and loaded by the strategy, cp_lightning.loading); LoRA then starts from
        ``loading.init_lora``'s seeded values."""
        super().__init__()
        self.save_hyperparameters()
        if pretrained is None:
            self.transformer = tiny_model("flux")
        else:
            from diffusers import FluxTransformer2DModel

            from cp_lightning import loading

            if meta:
                self.transformer = loading.empty_model(FluxTransformer2DModel, pretrained)
            else:
                self.transformer = FluxTransformer2DModel.from_pretrained(pretrained).train()
        if lora:
            from peft import LoraConfig

            self.transformer.requires_grad_(False)
            self.transformer.add_adapter(
                LoraConfig(
                    r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_q", "to_k", "to_v", "to_out.0"]
                )
            )
            if pretrained is not None:
                loading.init_lora(self.transformer, seed=0)
        ids = tiny_inputs("flux", self.transformer, batch=1, tokens=tokens, text_tokens=text_tokens)
        self.register_buffer("img_ids", ids["img_ids"], persistent=False)
        self.register_buffer("txt_ids", ids["txt_ids"], persistent=False)

    def configure_model(self):
        # here, not in __init__: the checkpointing function does not pickle into spawned workers
        if self.hparams.checkpointing:
            self.transformer.enable_gradient_checkpointing()

    def loss(self, batch):
        x0 = batch["latents"]
        if self.hparams.noise == "rng":
            noise = torch.randn_like(x0)
        elif self.hparams.noise == "per_rank":  # deliberately wrong: every rank draws its own noise
            noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(self.global_rank))
        else:
            noise = batch["noise"]
        t = batch["t"].view(-1, 1, 1)
        xt = (1 - t) * x0 + t * noise
        pred = self.transformer(
            hidden_states=xt,
            encoder_hidden_states=batch["text"],
            pooled_projections=batch["pooled"],
            timestep=batch["t"],
            img_ids=self.img_ids,
            txt_ids=self.txt_ids,
            return_dict=False,
        )[0]
        return F.mse_loss(pred, loss_shard(noise - x0, self.transformer)), noise

    def training_step(self, batch, batch_idx):
        if self.hparams.fail_at_step == self.global_step and self.global_rank == self.hparams.fail_rank:
            raise RuntimeError(f"deliberate failure at step {self.global_step}")
        loss, noise = self.loss(batch)
        self.log("loss", loss, sync_dist=True)
        if self.hparams.record_dir:
            self._record(loss, noise)
        return loss

    def _record(self, loss, noise):
        strategy = self.trainer.strategy
        mean_loss = strategy.reduce(loss.detach(), reduce_op="mean").item()
        row = {
            "step": self.global_step,
            "rank": self.global_rank,
            "loss": mean_loss,
            "noise_sum": noise.double().sum().item(),
            "dp_rank": getattr(strategy, "dp_rank", None),
            "cp_rank": getattr(strategy, "cp_rank", None),
        }
        if hasattr(strategy, "device_mesh"):
            row["cp_group"] = strategy.device_mesh["cp"].mesh.tolist()
        path = Path(self.hparams.record_dir) / f"rank{self.global_rank}.jsonl"
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        if self.hparams.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=0.01)
        return torch.optim.SGD(params, lr=self.hparams.lr)


def read_records(record_dir) -> list[dict]:
    rows = []
    for path in sorted(Path(record_dir).glob("rank*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines()]
    return rows


def reference_params(
    module: FlowMatching, dataset: Samples, global_batch: int, steps: int, clip: float | None, seed: int | None = None
) -> dict[str, torch.Tensor]:
    """Train a copy of ``module`` in one process on the global batches a DistributedSampler makes."""
    module = copy.deepcopy(module)
    module.configure_model()
    optimizer = module.configure_optimizers()
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else seed
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
    step = 0
    for epoch in range(math.ceil(steps * global_batch / len(dataset))):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for start in range(0, len(order) - global_batch + 1, global_batch):
            if step == steps:
                break
            batch = torch.utils.data.default_collate([dataset[i] for i in order[start : start + global_batch]])
            optimizer.zero_grad()
            module.loss(batch)[0].backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.requires_grad], clip)
            optimizer.step()
            step += 1
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def param_rel_err(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """max over parameters of max|p - ref| / max|ref|."""
    return max(
        ((params[n] - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item() for n, ref in reference.items()
    )


def update_rel_err(params, reference, start) -> float:
    """|p - ref| / |ref - start| over all parameters (2-norms): the error relative to what training changed."""
    err = sum(((params[n] - ref) ** 2).sum() for n, ref in reference.items()).sqrt()
    moved = sum(((ref - start[n]) ** 2).sum() for n, ref in reference.items()).sqrt()
    return (err / moved).item()

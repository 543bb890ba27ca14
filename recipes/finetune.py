"""What the fine-tuning recipes share: LoRA set-up, the flow-matching step, schedules, EMA, light checkpoints.

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
from recipes import training
from recipes.components import load_transformer
from recipes.console import quiet

quiet()


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
    return transformer.train()  # from_pretrained returns eval mode; training runs every module in train mode


def flow_matching_loss(pred, target, transformer, step: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """MSE in fp32 between the model output and the flow-matching target, optionally weighted per
    sample; a non-finite loss is an error."""
    # loss_shard: the target's shard in loss-parallel mode, the target itself otherwise
    target = loss_shard(target, transformer).float()
    if weights is None:
        loss = F.mse_loss(pred.float(), target)
    else:
        squared = (pred.float() - target) ** 2
        loss = (weights.view(-1, *[1] * (squared.ndim - 1)).to(squared) * squared).mean()
    if not math.isfinite(loss.item()):
        raise FloatingPointError(f"non-finite loss {loss.item()} at step {step}")
    return loss


class FlowMatchingFineTune(L.LightningModule):
    """Flow matching: x_t = (1 - t) x_0 + t noise, the model predicts noise - x_0 (MSE).

    Args:
        pretrained: ``tiny`` (the embedded tiny model) or a checkpoint path / hub id.
        cache_dir: where the tiny pipeline is built.
        lora_rank: LoRA rank; 0 fine-tunes every weight.
        lora_targets: module names LoRA adapts (peft's ``target_modules``); by default the family's attention
            projections.
        learning_rate: AdamW peak learning rate.
        lr_scheduler: ``constant``, ``cosine`` (to 0 at max_steps) or ``linear`` (to 0 at max_steps).
        warmup_steps: linear warm-up from 0 over this many optimizer steps.
        timestep_sampling: ``logit_normal`` (SD3/Flux practice) or ``uniform``.
        sigmoid_scale: scale of the normal draw inside logit-normal sampling (t = sigmoid(scale * z)).
        shift: fixed time shift s (t <- s t / (1 + (s - 1) t); SD3/Wan-style; 1.0 is none).
        resolution_shift: Flux's resolution-dependent shift from the full image token count (replaces ``shift``).
        min_timestep, max_timestep: t is mapped into this range after the shift (e.g. one Wan2.2 expert's).
        loss_weighting: ``none``, ``sigma_sqrt`` or ``cosmap`` (SD3 paper's weighting schemes).
        ema_decay: keep an EMA of the trainable parameters with this decay (e.g. 0.999); 0 disables.
        gradient_checkpointing: recompute each block in backward.
        weights_dtype: dtype the (frozen) weights load in, e.g. ``bfloat16`` for LoRA on large models;
            trainable parameters are kept in float32.
        seed: seeds LoRA initialisation and the per-sample noise.
    """

    family = ""
    lora_targets: list[str] = []
    transformer_subfolder = "transformer"

    def __init__(
        self,
        pretrained: str = "tiny",
        *,
        cache_dir: str = "outputs/cache",
        lora_rank: int = 4,
        lora_targets: list[str] | None = None,
        learning_rate: float = 1e-3,
        lr_scheduler: str = "constant",
        warmup_steps: int = 0,
        timestep_sampling: str = "logit_normal",
        sigmoid_scale: float = 1.0,
        shift: float = 1.0,
        resolution_shift: bool = False,
        min_timestep: float = 0.0,
        max_timestep: float = 1.0,
        loss_weighting: str = "none",
        ema_decay: float = 0.0,
        gradient_checkpointing: bool = False,
        weights_dtype: str = "float32",
        seed: int = 0,
    ):
        super().__init__()
        training.check_timestep_options(
            timestep_sampling, shift, sigmoid_scale, min_timestep, max_timestep, loss_weighting
        )
        training.check_schedule(lr_scheduler, warmup_steps, None)
        if not isinstance(getattr(torch, weights_dtype, None), torch.dtype):
            raise ValueError(f"weights_dtype must name a torch dtype such as 'bfloat16', got {weights_dtype!r}.")
        if lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0: full fine-tuning), got {lora_rank}.")
        if ema_decay and not 0.0 < ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1) (e.g. 0.999), or 0 to disable EMA; got {ema_decay}.")
        self.save_hyperparameters()
        self.transformer = None
        self.ema: training.TrainableEMA | None = None
        self.strict_loading = False  # checkpoints hold the trainable parameters only (see on_save_checkpoint)

    def configure_model(self) -> None:
        if self.transformer is not None:
            return
        h = self.hparams
        dtype = getattr(torch, h.weights_dtype)
        transformer = load_transformer(
            self.family, h.pretrained, h.cache_dir, dtype=dtype, subfolder=self.transformer_subfolder
        )
        targets = list(h.lora_targets or self.lora_targets)
        self.transformer = prepare_for_training(transformer, h.lora_rank, targets, h.seed, h.gradient_checkpointing)
        if h.ema_decay:
            self.ema = training.TrainableEMA(self.trainable_parameters(), h.ema_decay)

    def planner_model(self):
        """The full-size model for the layout planner (``cp: auto``): a built-in config for a known hub id,
        else the pipeline's ``transformer/config.json``."""
        from cp_lightning.planner.recipe import HUB
        from recipes.components import resolve_pretrained
        from recipes.planning import model_spec

        h = self.hparams
        if h.pretrained.lower() in HUB:
            return model_spec(h.pretrained)
        path = resolve_pretrained(self.family, h.pretrained, h.cache_dir)
        return model_spec(h.pretrained, path, subfolder=self.transformer_subfolder)

    def trainable_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(name, p) for name, p in self.named_parameters() if p.requires_grad]

    # -- the training step ------------------------------------------------------------------------
    def image_tokens(self, x0: torch.Tensor) -> int:
        """Image (or video) tokens of one full sample, for Flux's resolution-dependent shift."""
        raise NotImplementedError

    def noise_and_t(self, x0: torch.Tensor, index: torch.Tensor):
        h = self.hparams
        shift = training.flux_shift(self.image_tokens(x0)) if h.resolution_shift else h.shift
        return training.sample_noise_and_t(
            x0,
            index,
            seed=h.seed,
            epoch=self.current_epoch,
            sampling=h.timestep_sampling,
            sigmoid_scale=h.sigmoid_scale,
            shift=shift,
            min_t=h.min_timestep,
            max_t=h.max_timestep,
        )

    def predict(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(model output, flow-matching target, t per sample) for a batch."""
        raise NotImplementedError

    def training_step(self, batch, batch_idx):
        pred, target, t = self.predict(batch)
        weights = training.loss_weights(self.hparams.loss_weighting, t)
        loss = flow_matching_loss(pred, target, self.transformer, self.global_step, weights)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.log("train_t", t.float().mean(), sync_dist=True)  # the drawn times, layout-independent
        return loss

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        # here, not in on_train_batch_end: checkpoint callbacks run before the module's batch-end hook,
        # and a checkpoint must hold the EMA of the step it records
        if self.ema is not None:
            self.ema.update()

    def make_optimizer(self, total_steps: int):
        """AdamW over the trainable parameters and its per-step learning-rate schedule."""
        h = self.hparams
        params = [p for _, p in self.trainable_parameters()]
        if self.ema is not None:  # (created in configure_model, before FSDP replaced the parameters by shards)
            self.ema.follow(self.trainable_parameters())
        optimizer = torch.optim.AdamW(params, lr=h.learning_rate, weight_decay=1e-4)
        return optimizer, training.lr_schedule(optimizer, h.lr_scheduler, h.warmup_steps, total_steps)

    def configure_optimizers(self):
        # built here, not by LightningCLI's --optimizer wiring, which runs before configure_model creates
        # the transformer (and so would see no trainable parameters)
        optimizer, scheduler = self.make_optimizer(self.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- light checkpoints --------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Keep only the trainable parameters (DDP and FSDP): the frozen base is reloaded from ``pretrained``.
        A full fine-tune trains every parameter, so it keeps them all."""
        trainable = {name for name, _ in self.trainable_parameters()}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        checkpoint["recipe"] = self.checkpoint_identity()
        if self.ema is not None:  # FSDP: sharded like the parameters, written by every rank
            checkpoint["ema"] = self.ema.state_dict()

    def check_checkpoint(self, checkpoint: dict) -> None:
        """Refuse a checkpoint this run cannot resume from, naming the fix (ContextParallelStrategy calls it
        before any weight loads; an FSDP checkpoint's tensors are not in ``checkpoint`` then)."""
        from recipes.checkpoints import check_identity

        check_identity(checkpoint.get("recipe"), self.checkpoint_identity(), checkpoint.get("state_dict"))

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.check_checkpoint(checkpoint)  # (again, for strategies that do not call it first)
        if self.ema is not None and "ema" in checkpoint:
            self.ema.load_state_dict(checkpoint["ema"])

    def checkpoint_identity(self) -> dict:
        """What a checkpoint must agree on to resume this run."""
        strategy = self.trainer.strategy
        dp = getattr(strategy, "dp_size", None) or getattr(strategy, "world_size", 1)
        h = self.hparams
        return {
            "family": self.family,
            "pretrained": h.pretrained,
            "lora_rank": h.lora_rank,
            "trainable": {name: list(p.shape) for name, p in self.trainable_parameters()},
            "dp": dp,
            "cp": getattr(strategy, "cp", 1),
        }


class RecipeCLI(LightningCLI):
    """LightningCLI plus the recipe's own sections, all writing under one ``out_dir``:

    ``samples`` (validation samples, :mod:`recipes.sampling`), ``checkpoint`` (light checkpoints,
    :mod:`recipes.checkpoints`), ``export`` (the final LoRA, ``--export.format comfyui``) and
    ``loss_curve``. It checks the schedule against the run's length before any process starts.
    """

    def add_arguments_to_parser(self, parser) -> None:
        from recipes.callbacks import Export, LossCurve
        from recipes.checkpoints import LightCheckpoint
        from recipes.sampling import SAMPLERS

        parser.add_argument("--out_dir", type=str, default="outputs/run", help="the run's folder")
        sections = {
            "samples": SAMPLERS[self.model_class.family],
            "checkpoint": LightCheckpoint,
            "export": Export,
            "loss_curve": LossCurve,
        }
        for key, callback in sections.items():
            parser.add_lightning_class_args(callback, key)
            parser.link_arguments("out_dir", f"{key}.out_dir")

    def before_instantiate_classes(self) -> None:
        # the dry run plans on the CPU from the YAML alone: no Trainer (whose CUDA accelerator a CPU machine
        # refuses), no processes (recipes/planning.py)
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config["data"].get("dry_run"):
            from recipes.planning import dry_run

            dry_run(config, self.model_class, self.datamodule_class)
            raise SystemExit(0)

    def before_fit(self) -> None:
        from recipes import lora

        h = self.model.hparams
        training.check_schedule(h.lr_scheduler, h.warmup_steps, self.trainer.max_steps)
        family = self.model_class.family
        for section in ("export", "checkpoint"):
            key = "format" if section == "export" else "export_format"
            fmt = self.config[self.subcommand][section][key]
            if fmt == "comfyui" and family not in lora.COMFYUI_FAMILIES:
                raise ValueError(
                    f"{section}.{key}=comfyui: there is no ComfyUI LoRA layout for the {family} recipe (only for "
                    f"{', '.join(lora.COMFYUI_FAMILIES)}); export in the diffusers format (the default, which "
                    "pipeline.load_lora_weights reads)."
                )


def cli(module_class, data_class, args=None, **kwargs) -> LightningCLI:
    kwargs = {"seed_everything_default": 0, "save_config_kwargs": {"overwrite": True}, **kwargs}
    return RecipeCLI(module_class, data_class, args=args, **kwargs)

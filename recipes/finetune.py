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

from cp_lightning import loading, loss_shard, offload
from cp_lightning.fp8 import FP8_DTYPES, to_fp8_base
from recipes import training
from recipes.components import empty_transformer, load_transformer
from recipes.console import quiet

quiet()


LORA_TYPES = ("lora", "dora", "lokr")


def adapter_config(lora_type: str, rank: int, targets: list[str], exclude: list[str] = ()):
    """peft's config for ``lora_type``: LoRA, DoRA (LoRA with a learned magnitude per output row, peft's
    ``use_dora``) or LoKr (a Kronecker-product update, peft's ``LoKrConfig``); alpha = rank (scale 1). The
    modules named in ``exclude`` (full names) get no adapter."""
    from peft import LoKrConfig, LoraConfig

    if lora_type not in LORA_TYPES:
        raise ValueError(f"model.lora_type must be one of {LORA_TYPES}, got {lora_type!r}.")
    kwargs = {"target_modules": targets, "exclude_modules": list(exclude) or None}
    if lora_type == "lokr":
        return LoKrConfig(r=rank, alpha=rank, **kwargs)
    return LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", use_dora=lora_type == "dora", **kwargs)


def prepare_for_training(
    transformer,
    lora_rank: int,
    targets: list[str],
    seed: int,
    checkpointing: bool,
    base_dtype: str | None = None,
    lora_type: str = "lora",
    unused: list[str] = (),
):
    """Add a LoRA adapter (``lora_rank > 0``, base frozen, optionally stored in float8: ``base_dtype``; a DoRA or
    LoKr one with ``lora_type``) with a layout-independent init; trainable weights in fp32; optional gradient
    checkpointing. ``transformer`` may be on the meta device (cp_lightning.loading.empty_model): its fp8 weights
    are then quantized and its adapter initialised when its weights load. ``unused`` names modules whose output
    never reaches the model's output (QwenImage's last text stream): they get no adapter and, in a full
    fine-tune, stay frozen (DDP refuses parameters that get no gradient)."""
    if lora_rank:
        # peft matches exact names: each unused module and everything inside it
        inside = [n for n, _ in transformer.named_modules() if any(n == u or n.startswith(u + ".") for u in unused)]
        config = adapter_config(lora_type, lora_rank, targets, inside)
        transformer.requires_grad_(False)
        if base_dtype is not None:  # the frozen linears to float8 before PEFT wraps them
            transformer = to_fp8_base(transformer, dtype=getattr(torch, base_dtype))
        with torch.random.fork_rng():  # the same adapter init at every layout
            torch.manual_seed(seed)
            transformer.add_adapter(config)
        # seeded by (seed, layer name): the same values built eagerly or on the meta device and sharded
        loading.init_lora(transformer, seed)
    else:
        for name in unused:
            transformer.get_submodule(name).requires_grad_(False)
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # trainable weights (and so their AdamW state) in fp32
    if checkpointing:
        transformer.enable_gradient_checkpointing()
    return transformer.train()  # from_pretrained returns eval mode; training runs every module in train mode


def check_weights_dtype(weights_dtype: str, precision) -> None:
    """Half-precision frozen weights need autocast: under ``32-true`` they would meet fp32 activations and fp32
    LoRA weights inside ``F.linear`` ("expected m1 and m2 to have the same dtype")."""
    if weights_dtype in ("bfloat16", "float16") and str(precision) in ("32-true", "32", "64-true", "64"):
        raise ValueError(
            f"model.weights_dtype={weights_dtype!r} with trainer.precision={str(precision)!r}: the {weights_dtype} "
            "weights would meet float32 activations unconverted. Use --trainer.precision=bf16-mixed (autocast), "
            "or keep model.weights_dtype=float32."
        )


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
        lora_type: ``lora``, ``dora`` (weight-decomposed LoRA) or ``lokr`` (Kronecker product), through peft.
            Exports: LoRA in the diffusers, ComfyUI and peft formats; DoRA in the diffusers and peft formats;
            LoKr in the peft format (recipes/lora.py says why).
        lora_targets: module names LoRA adapts (peft's ``target_modules``); by default the family's attention
            projections.
        learning_rate: AdamW peak learning rate.
        lr_scheduler: ``constant``, ``cosine`` (to 0 at max_steps) or ``linear`` (to 0 at max_steps).
        warmup_steps: linear warm-up from 0 over this many optimizer steps.
        timestep_sampling: ``logit_normal`` (SD3/Flux practice) or ``uniform``.
        sigmoid_scale: scale of the normal draw inside logit-normal sampling (t = sigmoid(scale * z)).
        shift: fixed time shift s (t <- s t / (1 + (s - 1) t); SD3/Wan-style; 1.0 is none).
        resolution_shift: Flux's resolution-dependent shift from the full image token count (replaces ``shift``;
            the family's own ends where it has them: QwenImage's scheduler).
        min_timestep, max_timestep: t is mapped into this range after the shift (e.g. one Wan2.2 expert's).
        loss_weighting: ``none``, ``sigma_sqrt`` or ``cosmap`` (SD3 paper's weighting schemes).
        ema_decay: keep an EMA of the trainable parameters with this decay (e.g. 0.999); 0 disables.
        gradient_checkpointing: recompute each block in backward.
        activation_offload: with ``gradient_checkpointing``, keep each block's inputs in CPU memory until backward
            and recompute without repeating CP communication (``cp_lightning.offload``; set in configure_model,
            so every strategy and the Accelerate recipe take the same path). Not with the strategy's ``compile``.
        weights_dtype: dtype the (frozen) weights load in, e.g. ``bfloat16`` for LoRA on large models;
            trainable parameters are kept in float32.
        base_dtype: ``float8_e4m3fn`` (or ``float8_e5m2``) stores the frozen base's linear weights in float8 with
            one power-of-two scale per output channel (half the bytes of bf16; cp_lightning.fp8), computed in
            ``weights_dtype`` or the autocast dtype; LoRA only. None keeps them in ``weights_dtype``.
        seed: seeds LoRA initialisation and the per-sample noise.
    """

    family = ""
    lora_targets: list[str] = []
    transformer_subfolder = "transformer"
    shift_range = training.FLUX_SHIFT_RANGE  # resolution_shift's (base tokens, max tokens, base mu, max mu)

    def __init__(
        self,
        pretrained: str = "tiny",
        *,
        cache_dir: str = "outputs/cache",
        lora_rank: int = 4,
        lora_type: str = "lora",
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
        activation_offload: bool = False,
        weights_dtype: str = "float32",
        base_dtype: str | None = None,
        seed: int = 0,
    ):
        super().__init__()
        training.check_timestep_options(
            timestep_sampling, shift, sigmoid_scale, min_timestep, max_timestep, loss_weighting
        )
        training.check_schedule(lr_scheduler, warmup_steps, None)
        if not isinstance(getattr(torch, weights_dtype, None), torch.dtype):
            raise ValueError(f"weights_dtype must name a torch dtype such as 'bfloat16', got {weights_dtype!r}.")
        offload.check_offload_option(activation_offload)
        if activation_offload and not gradient_checkpointing:
            raise ValueError(
                "model.activation_offload offloads the inputs of checkpointed blocks: set "
                "model.gradient_checkpointing: true as well, or drop activation_offload."
            )
        if lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0: full fine-tuning), got {lora_rank}.")
        if lora_type not in LORA_TYPES:
            raise ValueError(f"model.lora_type must be one of {LORA_TYPES}, got {lora_type!r}.")
        if lora_type == "dora" and base_dtype is not None:
            raise ValueError(
                f"model.lora_type=dora normalises the adapted weight by its row norms, which a float8 base "
                f"(base_dtype={base_dtype!r}) does not hold unscaled: drop base_dtype, or use lora_type lora or lokr."
            )
        if base_dtype is not None:
            if getattr(torch, str(base_dtype), None) not in FP8_DTYPES:
                names = [str(d).removeprefix("torch.") for d in FP8_DTYPES]
                raise ValueError(
                    f"base_dtype must be one of {names} (a float8 frozen base) or unset, got {base_dtype!r}."
                )
            if not lora_rank:
                raise ValueError(
                    f"base_dtype={base_dtype!r} stores a frozen base in float8, but lora_rank=0 trains every weight "
                    "(a full fine-tune has no frozen base). Set lora_rank > 0, or drop base_dtype."
                )
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
        strategy = self._trainer.strategy if self._trainer is not None else None
        check_weights_dtype(h.weights_dtype, getattr(self._trainer, "precision", None))
        # Built on the meta device, then loaded one tensor at a time: under FSDP by the strategy after sharding
        # (each rank reads only its slices), otherwise here, straight onto this rank's device.
        transformer = empty_transformer(
            self.family, h.pretrained, h.cache_dir, subfolder=self.transformer_subfolder, dtype=dtype
        )
        if transformer is None:
            transformer = load_transformer(
                self.family, h.pretrained, h.cache_dir, dtype=dtype, subfolder=self.transformer_subfolder
            )
        targets = list(h.lora_targets or self.lora_targets)
        self.transformer = prepare_for_training(
            transformer,
            h.lora_rank,
            targets,
            h.seed,
            h.gradient_checkpointing,
            h.base_dtype,
            h.lora_type,
            self.unused_modules(transformer),
        )
        if h.activation_offload:
            offload.apply_activation_offload(self.transformer)
        if not getattr(strategy, "fsdp", False):
            loading.materialize(self.transformer, getattr(strategy, "root_device", None))
        if h.ema_decay and not loading.pending(self.transformer):  # (else in make_optimizer, once loaded)
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

    def unused_modules(self, transformer) -> list[str]:
        """Modules whose output never reaches the model's output: left untrained (see prepare_for_training)."""
        return []

    def trainable_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(name, p) for name, p in self.named_parameters() if p.requires_grad]

    # -- the training step ------------------------------------------------------------------------
    def image_tokens(self, x0: torch.Tensor) -> int:
        """Image (or video) tokens of one full sample, for Flux's resolution-dependent shift."""
        raise NotImplementedError

    def noise_and_t(self, x0: torch.Tensor, index: torch.Tensor):
        h = self.hparams
        shift = training.flux_shift(self.image_tokens(x0), self.shift_range) if h.resolution_shift else h.shift
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

    def draws(self, x0: torch.Tensor, batch: dict):
        """(noise, t) for a batch: the batch's own fixed ones (the validation loss, recipes/validation.py), else
        drawn per sample by ``noise_and_t``."""
        if "noise" in batch:
            return batch["noise"], batch["t"]
        return self.noise_and_t(x0, batch["index"])

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

    def dynamic_cp_step(self, batch):
        """Dynamic CP: the micro-batch's tokens per sample and the step's total W (from the bucket sampler)."""
        from cp_lightning.dynamic import DynamicStep

        return DynamicStep(int(batch["cp_tokens"][0]), len(batch["index"]), float(batch["step_total"][0]))

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
        elif h.ema_decay:  # the transformer was meta-built and loaded by the strategy
            self.ema = training.TrainableEMA(self.trainable_parameters(), h.ema_decay)
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
        from recipes.checkpoints import schedule_change

        self.check_checkpoint(checkpoint)  # (again, for strategies that do not call it first)
        message = schedule_change(
            (checkpoint.get("recipe") or {}).get("schedule"), self.checkpoint_identity()["schedule"]
        )
        if message:
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(message)
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
            # not checked: a resumed run may change its length, with a warning when that reshapes the schedule
            "schedule": {
                "lr_scheduler": h.lr_scheduler,
                "warmup_steps": h.warmup_steps,
                "max_steps": getattr(self.trainer, "max_steps", None),
            },
        }


class RecipeCLI(LightningCLI):
    """LightningCLI plus the recipe's own sections, all writing under one ``out_dir``:

    ``samples`` (validation samples, :mod:`recipes.sampling`), ``checkpoint`` (light checkpoints,
    :mod:`recipes.checkpoints`), ``export`` (the final LoRA, ``--export.format comfyui``), ``validation``
    (the held-out ``val_loss``, :mod:`recipes.validation`) and ``loss_curve``. It checks the schedule against
    the run's length before any process starts.
    """

    def add_arguments_to_parser(self, parser) -> None:
        from recipes.callbacks import Export, LossCurve
        from recipes.checkpoints import LightCheckpoint
        from recipes.sampling import SAMPLERS
        from recipes.validation import Validation

        parser.add_argument("--out_dir", type=str, default="outputs/run", help="the run's folder")
        sections = {
            "samples": getattr(self.model_class, "sampler", None) or SAMPLERS[self.model_class.family],
            "checkpoint": LightCheckpoint,
            "export": Export,
            "validation": Validation,  # before loss_curve: its last val_loss is drawn in loss.png
            "loss_curve": LossCurve,
        }
        for key, callback in sections.items():
            parser.add_lightning_class_args(callback, key)
            parser.link_arguments("out_dir", f"{key}.out_dir")

    def before_instantiate_classes(self) -> None:
        # the dry run plans on the CPU from the YAML alone: no Trainer (whose CUDA accelerator a CPU machine
        # refuses), no processes (recipes/planning.py)
        from recipes.loggers import check_logger_packages

        config = self.config[self.subcommand] if self.subcommand else self.config
        check_logger_packages(config["trainer"].get("logger"))
        if config["data"].get("dry_run"):
            from recipes.planning import dry_run

            dry_run(config, self.model_class, self.datamodule_class)
            raise SystemExit(0)

    def before_fit(self) -> None:
        from recipes import lora
        from recipes.sampling import Samples

        h = self.model.hparams
        training.check_schedule(h.lr_scheduler, h.warmup_steps, self.trainer.max_steps)
        check_weights_dtype(h.weights_dtype, self.trainer.precision)
        for callback in self.trainer.callbacks:  # a missing samples.images file, before any process starts
            if isinstance(callback, Samples):
                callback.check_images()
        family = self.model_class.family
        for section in ("export", "checkpoint"):
            key = "format" if section == "export" else "export_format"
            fmt = self.config[self.subcommand][section][key]
            if h.lora_rank:
                lora.check_format(h.lora_type, fmt, where=f"{section}.{key}")
            if fmt == "comfyui" and family not in lora.COMFYUI_FAMILIES:
                raise ValueError(
                    f"{section}.{key}=comfyui: there is no ComfyUI LoRA layout for the {family} recipe (only for "
                    f"{', '.join(lora.COMFYUI_FAMILIES)}); export in the diffusers format (the default, which "
                    "pipeline.load_lora_weights reads)."
                )


def cli(module_class, data_class, args=None, **kwargs) -> LightningCLI:
    kwargs = {"seed_everything_default": 0, "save_config_kwargs": {"overwrite": True}, **kwargs}
    return RecipeCLI(module_class, data_class, args=args, **kwargs)

"""The recipes' link to the layout planner (cp_lightning/planner/): per-bucket memory estimates for the dry run,
and a dry run that needs no GPU and launches no process (``--data.dry_run=true`` on any recipe YAML).

The dry run runs in the CLI before the Trainer exists (so ``accelerator: cuda`` on a CPU machine and
``devices: 8`` start nothing): it builds the data module from the YAML, scans ``data_dir`` into buckets and adds
``est_gib_per_gpu`` for the recipe's own layout (dp, cp, ring, DDP/FSDP/HSDP, checkpointing, LoRA) to each row.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from cp_lightning.planner import Hardware, Layout, Training, estimate, resolve_model
from cp_lightning.planner.recipe import GEOMETRY, GEOMETRY_TI2V, HUB


def model_spec(pretrained: str, pipeline_path: str | None = None, subfolder: str = "transformer"):
    """The planner's model: a built-in config for a known hub id, else the pipeline's transformer config."""
    if pretrained.lower() in HUB:
        return resolve_model(HUB[pretrained.lower()])
    path = Path(pipeline_path or pretrained) / subfolder / "config.json"
    return resolve_model(str(path))


def builtin_geometry(pretrained: str):
    """(pixels per token side, frames per latent frame, latent frames per token) of a known hub id, or None."""
    name = HUB.get(pretrained.lower())
    if name is None:
        return None
    return GEOMETRY_TI2V if name == "wan2.2-ti2v-5b" else GEOMETRY[resolve_model(name).config["_class_name"]]


def add_estimates(
    rows: list[dict],
    spec,
    tokens,
    *,
    world: int,
    cp: int,
    ring: int = 1,
    fsdp: bool = False,
    hsdp: bool = False,
    checkpointing: bool = False,
    lora_rank: int = 0,
    weights_dtype: str = "float32",
    ema: bool = False,
    batch_size: int = 1,
    base_dtype: str | None = None,
    offload: bool = False,
) -> None:
    """Adds the planner's ``est_gib_per_gpu`` (states + activations + CP buffers + fixed) to each bucket row;
    ``tokens(bucket)`` -> (split tokens, text tokens split with them) as the data module's ``tokens``."""
    sharding = ("hsdp" if hsdp and world > cp else "full") if fsdp else "off"
    base = (base_dtype or weights_dtype) if lora_rank else "bfloat16"  # base_dtype: a float8 frozen base
    layout = Layout(world // cp, cp, ring, sharding, checkpointing, offload and checkpointing, base, batch_size)
    training = Training(lora_rank=lora_rank, params_dtype="float32", ema=ema)  # trainable weights are fp32
    hw = Hardware(gpus=world, gpu_memory_gib=1e6)  # no budget: the estimate only
    for row in rows:
        split, text = tokens(_Bucket(row))
        layout = replace(layout, batch=int(row.get("batch", batch_size)))
        # Wan's text is not split (cross-attention): the planner's default text length stands for it
        e = estimate(spec, layout, hw, training, split, text if spec.family.joint else None)
        row["est_gib_per_gpu"] = float(f"{e.gib_per_gpu:.4g}")  # tiny models need the digits


def memory_check(datamodule, world: int, cp: int):
    """``fits(row, batch)`` for ``batch_size: auto``: the planner's estimate for the Trainer's layout within the
    budget (the strategy's ``gpu_memory=``, else the CUDA device's memory), or None when no budget is known."""
    trainer = datamodule.trainer
    strategy = trainer.strategy if trainer is not None else None
    budget = (getattr(strategy, "_plan_hints", None) or {}).get("gpu_memory")
    if budget is None and strategy is not None and strategy.root_device.type == "cuda":
        import torch

        budget = torch.cuda.get_device_properties(strategy.root_device).total_memory / 2**30
    module = trainer.lightning_module if trainer is not None else None
    if budget is None or module is None or not hasattr(module, "planner_model"):
        return None
    h = dict(module.hparams)
    spec = module.planner_model()

    def fits(row: dict, batch: int) -> bool:
        probe = [dict(row, batch=batch)]
        add_estimates(
            probe,
            spec,
            datamodule.tokens,
            world=world,
            cp=cp,
            **layout_options(strategy, h),
        )
        return probe[0]["est_gib_per_gpu"] <= budget

    return fits


def _strategy_args(trainer: dict) -> dict:
    strategy = trainer.get("strategy")
    if isinstance(strategy, dict) or hasattr(strategy, "init_args"):
        args = strategy.get("init_args", {}) if isinstance(strategy, dict) else strategy.init_args
        return dict(args or {})
    return {}


def dry_run(config, model_class, data_class) -> None:
    """The dry run from a parsed recipe config (LightningCLI's namespace), before any Trainer or process."""
    from recipes.buckets import format_table, write_csv

    def plain(ns):
        return ns.as_dict() if hasattr(ns, "as_dict") else dict(ns)

    trainer, model, data = plain(config["trainer"]), plain(config["model"]), plain(config["data"])
    args = _strategy_args(trainer)
    cp = args.get("cp", 1)
    devices = trainer.get("devices", 1)
    world = (devices if isinstance(devices, int) else 1) * int(trainer.get("num_nodes") or 1)
    module = data_class(**{k: v for k, v in data.items() if k != "dry_run"})
    geometry = builtin_geometry(str(data.get("pretrained", "tiny")))
    if geometry is not None:
        module.geometry = lambda: geometry  # the built-in model's geometry: no pipeline download
    module.prepare_data()
    samples = module.plan(cp if isinstance(cp, int) else 1)
    spec = model_spec(str(model.get("pretrained", data.get("pretrained", "tiny"))), module._pipeline_path())
    add_estimates(
        module.table,
        spec,
        module.tokens,
        world=world,
        cp=cp if isinstance(cp, int) else 1,
        ring=int(args.get("ring", 1)),
        fsdp=bool(args.get("fsdp", False)),
        hsdp=bool(args.get("hsdp", False)),
        checkpointing=bool(model.get("gradient_checkpointing", False)),
        lora_rank=int(model.get("lora_rank", 0)),
        weights_dtype=str(model.get("weights_dtype", "float32")),
        ema=bool(model.get("ema_decay", 0.0)),
        batch_size=1 if data.get("batch_size") == "auto" else int(data.get("batch_size", 1)),
        base_dtype=model.get("base_dtype"),
        offload=bool(model.get("activation_offload") or args.get("activation_offload")),
    )
    print(f"buckets ({len(samples)} samples, batch_size {data.get('batch_size')} per dp rank, cp={cp}):")
    print(format_table(module.table))
    root = trainer.get("default_root_dir")
    if root:
        write_csv(module.table, Path(root) / "buckets.csv")
    sampling = plain(config["samples"]) if "samples" in config else {}
    if "images" in sampling:  # an image-conditioned sampler: what each prompt starts from (given, or the data's)
        sampler = model_class.sampler(**sampling)
        print("samples (prompt <- samples.images, or the data's first samples when not given):")
        try:
            for prompt, source in zip(sampler.prompts, sampler.sample_images(module), strict=True):
                sources = source if isinstance(source, list) else [source]  # (an edit may take several)
                print(f"  {prompt!r} <- {', '.join(s.path for s in sources)}")
        except ValueError as err:  # the plan above stands; training would stop here (before any process)
            print(f"  {err}")


class _Bucket:
    def __init__(self, row: dict) -> None:
        self.frames, self.height, self.width = row["frames"], row["height"], row["width"]


def layout_options(strategy, hparams: dict) -> dict:
    """The planner's keyword arguments that the strategy (ring, FSDP/HSDP) and the module's hyperparameters
    (checkpointing, LoRA, dtype, EMA) fix; ``strategy`` may be None (one process)."""
    return dict(
        ring=getattr(strategy, "ring", 1),
        fsdp=bool(getattr(strategy, "fsdp", False)),
        hsdp=bool(getattr(getattr(strategy, "fsdp_options", None), "hsdp", False)),
        checkpointing=bool(hparams.get("gradient_checkpointing", False)),
        lora_rank=int(hparams.get("lora_rank", 0)),
        weights_dtype=hparams.get("weights_dtype", "float32"),
        ema=bool(hparams.get("ema_decay", 0.0)),
        base_dtype=hparams.get("base_dtype"),
        offload=bool(hparams.get("activation_offload") or getattr(strategy, "activation_offload", False)),
    )

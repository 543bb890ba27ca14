"""Flux LoRA fine-tuning in a plain Accelerate loop, with cp_lightning's context parallelism.

    accelerate launch --multi_gpu --num_processes 2 -m recipes.accelerate_flux_lora --cpu --cp 2

The defaults are the main job's (configs/tiny_flux_cp2.yaml): the tiny Flux, 64 generated shape images at
32 px, LoRA rank 4, 30 steps at cp=2. The model, its LoRA set-up, the per-sample noise and the loss are
the Lightning recipe's (recipes/flux.py, recipes/finetune.py); the data is recipes/data.py's; only the
loop is Accelerate's. Writes ``loss.csv``/``loss.png``, ``lora/pytorch_lora_weights.safetensors``
(diffusers format) and ``samples.png`` to ``--output_dir``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from cp_lightning.accelerate import ContextParallel
from recipes.callbacks import Export, LossCurve
from recipes.components import load_pipeline
from recipes.data import FluxData
from recipes.finetune import flow_matching_loss
from recipes.flux import FluxFineTune
from recipes.sampling import SampleFlux, render_grid


class FluxLoRA(FluxFineTune):
    """FluxFineTune as a plain module: ``forward(batch)`` is the flow-matching loss (what DDP wraps)."""

    epoch = 0  # the loop sets it; seeds the per-sample noise as Lightning's current_epoch does

    @property
    def current_epoch(self) -> int:
        return self.epoch

    def forward(self, batch):
        pred, target, _ = self.predict(batch)
        return flow_matching_loss(pred, target, self.transformer, self.epoch)


def parse_args(args=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2, help="context-parallel degree (divides the number of processes)")
    p.add_argument("--ring", type=int, default=1, help="ring degree inside cp (cp = ring x ulysses)")
    p.add_argument("--pretrained", default="tiny", help="'tiny' or a Flux checkpoint path / hub id")
    p.add_argument("--cache_dir", default="outputs/cache")
    p.add_argument(
        "--data_dir", "--image_dir", default="outputs/data/shapes", help="images + captions (docs/recipes/data.md)"
    )
    p.add_argument("--synthetic_samples", type=int, default=64, help="generate this many shapes if data_dir is absent")
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--batch_size", type=int, default=4, help="samples per data-parallel rank and step")
    p.add_argument("--lora_rank", type=int, default=4)
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--max_steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--mixed_precision", default="no", choices=["no", "bf16", "fp16"])
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--weights_dtype", default="float32", help="dtype the frozen weights load in, e.g. bfloat16")
    p.add_argument("--base_dtype", default=None, help="float8_e4m3fn: the frozen base in fp8 (cp_lightning.fp8)")
    p.add_argument(
        "--activation_offload",
        action="store_true",
        help="with --gradient_checkpointing: checkpointed blocks' inputs in CPU memory until backward",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="train on CPU processes (gloo) even if GPUs are present")
    p.add_argument("--output_dir", default="outputs/accelerate_flux_lora")
    parsed = p.parse_args(args)
    if parsed.activation_offload and not parsed.gradient_checkpointing:  # before anything communicates
        p.error("--activation_offload offloads the inputs of checkpointed blocks: add --gradient_checkpointing.")
    return parsed


def main(args=None) -> list[tuple[int, float]]:
    args = parse_args(args)
    accelerator = Accelerator(
        cpu=args.cpu,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
    )
    set_seed(args.seed)
    cp = ContextParallel(accelerator, cp=args.cp, ring=args.ring, seed=args.seed)  # checks the layout first

    data = FluxData(
        data_dir=args.data_dir,
        aspect_ratios=[1.0],  # one square bucket: this loop batches with a plain shuffled DataLoader
        cache_dir=args.cache_dir,
        pretrained=args.pretrained,
        resolution=args.resolution,
        batch_size=args.batch_size,
        synthetic_samples=args.synthetic_samples,
        seed=args.seed,
    )
    module = FluxLoRA(
        pretrained=args.pretrained,
        cache_dir=args.cache_dir,
        lora_rank=args.lora_rank,
        learning_rate=args.learning_rate,
        gradient_checkpointing=args.gradient_checkpointing,
        weights_dtype=args.weights_dtype,
        base_dtype=args.base_dtype,
        activation_offload=args.activation_offload,
        seed=args.seed,
    )
    data.set_layout(cp=cp.cp, run_dir=args.output_dir)  # no Trainer tells it: the bucket table's cp and tokens
    with accelerator.main_process_first():  # rank 0 builds the tiny pipeline and the encoded cache once
        data.prepare_data()
        module.configure_model()
    data.setup("fit")
    loader = DataLoader(data.dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
    optimizer, _ = module.make_optimizer(args.max_steps)  # constant learning rate
    model, optimizer, loader = cp.prepare(module, optimizer, loader)

    trainable = [p for p in model.parameters() if p.requires_grad]
    accelerator.print(
        f"dp={cp.dp_size} x cp={cp.cp}: {len(data.dataset)} samples, {args.batch_size} per dp rank and step, "
        f"{sum(p.numel() for p in trainable)} trainable parameters"
    )
    rows: list[tuple[int, float]] = []
    step, epoch, running = 0, 0, 0.0
    bar = tqdm(total=args.max_steps, desc="train", disable=not accelerator.is_local_main_process)
    while step < args.max_steps:
        loader.set_epoch(epoch)
        module.epoch = epoch
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(trainable, args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            # CP peers hold the same loss, so the mean over all processes is the global mean
            running += accelerator.gather(loss.detach()).mean().item() / args.gradient_accumulation_steps
            if accelerator.sync_gradients:
                step += 1
                rows.append((step, running))
                bar.update(1)
                bar.set_postfix(loss=f"{running:.4f}")
                running = 0.0
                if step == args.max_steps:
                    break
        epoch += 1
    bar.close()

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        rank_zero = SimpleNamespace(is_global_zero=True)  # all the recipe callbacks read of a Trainer
        curve = LossCurve(args.output_dir)
        curve.rows = rows
        curve.on_train_end(rank_zero, module)
        Export(args.output_dir).export(module, step=step, epoch=epoch)  # the LoRA, diffusers format
        pipeline = load_pipeline("flux", args.pretrained, args.cache_dir)
        pipeline.load_lora_weights(f"{args.output_dir}/lora")
        render_grid(SampleFlux(resolution=args.resolution), pipeline, Path(args.output_dir) / "samples.png")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return rows


if __name__ == "__main__":
    main()

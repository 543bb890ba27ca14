"""Recipe callbacks: the loss curve (CSV and PNG), and the trained weights with sample images."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import torch


class LossCurve(L.Callback):
    """Writes ``loss.csv`` (step, loss: the global mean over ranks) and ``loss.png`` on rank 0."""

    def __init__(self, out_dir: str = "outputs/run"):
        self.out_dir = Path(out_dir)
        self.rows: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = trainer.callback_metrics.get("train_loss")
        if loss is not None:
            self.rows.append((trainer.global_step, float(loss)))

    def on_train_end(self, trainer, pl_module):
        if not trainer.is_global_zero:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with (self.out_dir / "loss.csv").open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["step", "loss"])
            writer.writerows(self.rows)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([s for s, _ in self.rows], [v for _, v in self.rows], marker=".")
        ax.set(xlabel="optimizer step", ylabel="flow-matching loss", title="training loss")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.out_dir / "loss.png", dpi=120)
        plt.close(fig)


class ExportFlux(L.Callback):
    """On rank 0 at the end of training: save the LoRA weights in the diffusers format (or the full
    transformer), then render ``samples.png`` with the real FluxPipeline loaded from those files."""

    def __init__(
        self,
        out_dir: str = "outputs/run",
        prompts: list[str] | None = None,
        resolution: int = 32,
        num_inference_steps: int = 8,
        max_sequence_length: int = 32,
        seed: int = 0,
    ):
        self.out_dir = Path(out_dir)
        self.prompts = prompts or ["a red circle", "a blue square", "a green triangle", "a yellow circle"]
        self.resolution, self.steps, self.max_sequence_length, self.seed = (
            resolution,
            num_inference_steps,
            max_sequence_length,
            seed,
        )

    def on_train_end(self, trainer, pl_module):
        if not trainer.is_global_zero:
            return
        from diffusers import FluxPipeline
        from peft.utils import get_peft_model_state_dict

        from recipes.flux_components import load_pipeline

        h = pl_module.hparams
        self.out_dir.mkdir(parents=True, exist_ok=True)
        pipeline = load_pipeline(h.pretrained, h.cache_dir)
        if h.lora_rank:
            lora_dir = self.out_dir / "lora"
            state = get_peft_model_state_dict(pl_module.transformer)
            FluxPipeline.save_lora_weights(lora_dir, transformer_lora_layers=state, safe_serialization=True)
            pipeline.load_lora_weights(lora_dir)
        else:
            pl_module.transformer.save_pretrained(self.out_dir / "transformer")
            pipeline.transformer.load_state_dict(pl_module.transformer.state_dict())
        self.render(pipeline, self.out_dir / "samples.png")

    @torch.no_grad()
    def render(self, pipeline, path: Path) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        images = pipeline(
            self.prompts,
            height=self.resolution,
            width=self.resolution,
            num_inference_steps=self.steps,
            guidance_scale=pl_guidance(pipeline),
            max_sequence_length=self.max_sequence_length,
            generator=generator,
        ).images
        save_grid(images, self.prompts, path)


def pl_guidance(pipeline) -> float:
    return 3.5 if pipeline.transformer.config.guidance_embeds else 1.0


def save_grid(images, captions, path: Path, scale: int = 4) -> None:
    from PIL import Image, ImageDraw

    w, h = images[0].size
    cell_w, cell_h = w * scale, h * scale + 14
    grid = Image.new("RGB", (cell_w * len(images), cell_h), "white")
    draw = ImageDraw.Draw(grid)
    for i, (image, caption) in enumerate(zip(images, captions, strict=True)):
        grid.paste(image.resize((w * scale, h * scale), Image.NEAREST), (i * cell_w, 0))
        draw.text((i * cell_w + 2, h * scale + 1), caption, fill="black")
    grid.save(path)

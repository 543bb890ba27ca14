"""Recipe callbacks: the loss curve (CSV and PNG), and the trained weights with sample images."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import torch


class LossCurve(L.Callback):
    """Writes ``loss.csv`` (step, loss and the batch's mean time t: global means over ranks) and
    ``loss.png`` on rank 0."""

    def __init__(self, out_dir: str = "outputs/run"):
        self.out_dir = Path(out_dir)
        self.rows: list[tuple] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        if "train_loss" in metrics:
            self.rows.append((trainer.global_step, float(metrics["train_loss"]), float(metrics.get("train_t", "nan"))))

    def on_train_end(self, trainer, pl_module):
        if not trainer.is_global_zero:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with (self.out_dir / "loss.csv").open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["step", "loss", "t"][: len(self.rows[0]) if self.rows else 3])
            writer.writerows(self.rows)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([row[0] for row in self.rows], [row[1] for row in self.rows], marker=".")
        ax.set(xlabel="optimizer step", ylabel="flow-matching loss", title="training loss")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.out_dir / "loss.png", dpi=120)
        plt.close(fig)


class Export(L.Callback):
    """On rank 0 at the end of training: save the LoRA weights in the diffusers format (or the full
    transformer), then render ``samples.png`` with the family's real diffusers pipeline loaded from
    those files (one row per prompt; a video row shows its frames)."""

    family = ""

    def __init__(
        self,
        out_dir: str = "outputs/run",
        prompts: list[str] | None = None,
        resolution: int = 32,
        width: int | None = None,
        num_inference_steps: int = 8,
        max_sequence_length: int = 32,
        num_frames: int = 1,
        seed: int = 0,
    ):
        self.out_dir = Path(out_dir)
        self.prompts = prompts or ["a red circle", "a blue square", "a green triangle", "a yellow circle"]
        self.height, self.width = resolution, width or resolution
        self.steps, self.max_sequence_length, self.num_frames, self.seed = (
            num_inference_steps,
            max_sequence_length,
            num_frames,
            seed,
        )

    def on_train_end(self, trainer, pl_module):
        from cp_lightning.data_parallel import full_state_dict, lora_state_dict, write_pretrained

        h = pl_module.hparams
        # consolidated on every rank (a collective when the model is FSDP-sharded); rank 0 writes and renders
        state = (lora_state_dict if h.lora_rank else full_state_dict)(pl_module.transformer)
        if not trainer.is_global_zero:
            return
        from recipes.components import load_pipeline

        self.out_dir.mkdir(parents=True, exist_ok=True)
        pipeline = load_pipeline(self.family, h.pretrained, h.cache_dir)
        if h.lora_rank:
            lora_dir = self.out_dir / "lora"
            type(pipeline).save_lora_weights(lora_dir, transformer_lora_layers=state, safe_serialization=True)
            pipeline.load_lora_weights(lora_dir)
        else:
            write_pretrained(pl_module.transformer, state, self.out_dir / "transformer")
            pipeline.transformer.load_state_dict(state)
        with torch.no_grad():
            rows = self.render(pipeline)
        save_grid(rows, self.prompts, self.out_dir / "samples.png")

    def render(self, pipeline) -> list[list]:
        raise NotImplementedError


class ExportFlux(Export):
    __doc__ = Export.__doc__
    family = "flux"

    def render(self, pipeline):
        generator = torch.Generator().manual_seed(self.seed)
        guidance = 3.5 if pipeline.transformer.config.guidance_embeds else 1.0
        images = pipeline(
            self.prompts,
            height=self.height,
            width=self.width,
            num_inference_steps=self.steps,
            guidance_scale=guidance,
            max_sequence_length=self.max_sequence_length,
            generator=generator,
        ).images
        return [[image] for image in images]


class ExportWan(Export):
    __doc__ = Export.__doc__
    family = "wan"

    def render(self, pipeline):
        generator = torch.Generator().manual_seed(self.seed)
        videos = pipeline(
            self.prompts,
            height=self.height,
            width=self.width,
            num_frames=self.num_frames,
            num_inference_steps=self.steps,
            guidance_scale=1.0,
            max_sequence_length=self.max_sequence_length,
            generator=generator,
            output_type="pil",
        ).frames
        return [list(frames) for frames in videos]


def save_grid(rows, captions, path: Path, scale: int = 4) -> None:
    """One row per caption: its images (or video frames) side by side, the caption underneath."""
    from PIL import Image, ImageDraw

    w, h = rows[0][0].size
    columns = max(len(row) for row in rows)
    cell_w, cell_h = w * scale, h * scale + 14
    grid = Image.new("RGB", (cell_w * columns, cell_h * len(rows)), "white")
    draw = ImageDraw.Draw(grid)
    for r, (row, caption) in enumerate(zip(rows, captions, strict=True)):
        for c, image in enumerate(row):
            grid.paste(image.resize((w * scale, h * scale), Image.NEAREST), (c * cell_w, r * cell_h))
        draw.text((2, r * cell_h + h * scale + 1), caption, fill="black")
    grid.save(path)

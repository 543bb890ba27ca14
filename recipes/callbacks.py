"""Recipe callbacks: the loss curve (CSV and PNG), and the trained weights with sample images."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L


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
    """At the end of training: the LoRA weights in ``<out_dir>/lora`` (diffusers format by default,
    ``format: comfyui`` for ComfyUI's), with training metadata in the safetensors header, and the EMA of
    the LoRA beside it in ``lora_ema`` when the module keeps one; with ``lora_rank: 0`` the whole
    transformer in ``<out_dir>/transformer`` (``from_pretrained`` layout). Every rank takes part (FSDP
    shards are gathered); rank 0 writes.

    Args:
        out_dir: the run's folder.
        format: ``diffusers`` (``pipeline.load_lora_weights``) or ``comfyui``.
    """

    def __init__(self, out_dir: str = "outputs/run", format: str = "diffusers"):
        from recipes import lora

        if format not in lora.FORMATS:
            raise ValueError(f"export format must be one of {lora.FORMATS}, got {format!r}.")
        self.out_dir, self.format = Path(out_dir), format

    def on_train_end(self, trainer, pl_module):
        self.export(pl_module, step=trainer.global_step, epoch=trainer.current_epoch)

    def export(self, pl_module, *, step: int, epoch: int) -> None:
        """Every rank calls it (a collective when the model is sharded)."""
        from cp_lightning.data_parallel import export_pretrained
        from recipes import lora

        if pl_module.hparams.lora_rank:
            lora.export(pl_module, self.out_dir / "lora", fmt=self.format, step=step, epoch=epoch)
        else:
            export_pretrained(pl_module.transformer, self.out_dir / "transformer")

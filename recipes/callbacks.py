"""Recipe callbacks: the loss curve (CSV and PNG, with the held-out val_loss), the trained weights."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L


class LossCurve(L.Callback):
    """Writes ``loss.csv`` (step, loss and the batch's mean time t: global means over ranks) and
    ``loss.png`` on rank 0: the training loss, its smoothed curve and the held-out ``val_loss`` when the run
    has a validation split (recipes/validation.py).

    Args:
        out_dir: the run's folder.
        smoothing: weight of the past in the training curve's exponential moving average (TensorBoard's
            smoothing, bias-corrected); 0 draws the raw losses only.
    """

    def __init__(self, out_dir: str = "outputs/run", smoothing: float = 0.9):
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"loss_curve.smoothing must be in [0, 1), got {smoothing}.")
        self.out_dir = Path(out_dir)
        self.smoothing = smoothing
        self.rows: list[tuple] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        if "train_loss" in metrics:
            self.rows.append((trainer.global_step, float(metrics["train_loss"]), float(metrics.get("train_t", "nan"))))

    def on_train_end(self, trainer, pl_module):
        if not trainer.is_global_zero:
            return
        from recipes.validation import find

        self.out_dir.mkdir(parents=True, exist_ok=True)
        with (self.out_dir / "loss.csv").open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["step", "loss", "t"][: len(self.rows[0]) if self.rows else 3])
            writer.writerows(self.rows)
        validation = find(trainer)
        self.plot(validation.history if validation is not None else {})

    def plot(self, val_loss: dict[int, float]) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps, loss = [row[0] for row in self.rows], [row[1] for row in self.rows]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        if self.smoothing:
            ax.plot(steps, loss, color="tab:blue", alpha=0.25, lw=0.8, label="training loss")
            ax.plot(steps, smooth(loss, self.smoothing), color="tab:blue", label=f"smoothed ({self.smoothing})")
        else:
            ax.plot(steps, loss, color="tab:blue", marker=".", label="training loss")
        if val_loss:
            points = sorted(val_loss.items())
            ax.plot(*zip(*points, strict=True), color="tab:orange", marker="o", label="val_loss (held out)")
        title = "training and held-out loss" if val_loss else "training loss"
        ax.set(xlabel="optimizer step", ylabel="flow-matching loss", title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(self.out_dir / "loss.png", dpi=120)
        plt.close(fig)


def smooth(values: list[float], weight: float) -> list[float]:
    """Bias-corrected exponential moving average (TensorBoard's scalar smoothing)."""
    out, last = [], 0.0
    for i, value in enumerate(values, start=1):
        last = weight * last + (1 - weight) * value
        out.append(last / (1 - weight**i))
    return out


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
        from cp_lightning.sharding import export_pretrained
        from recipes import lora

        if pl_module.hparams.lora_rank:
            lora.export(pl_module, self.out_dir / "lora", fmt=self.format, step=step, epoch=epoch)
        else:
            export_pretrained(pl_module.transformer, self.out_dir / "transformer")

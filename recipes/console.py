"""A clean console for the recipes: our progress bar and messages, not known-harmless library noise.

Each filter names one message that is harmless here and why; anything else still reaches the console.
``quiet()`` runs when a recipe is imported, so every launched rank installs the same filters.
"""

from __future__ import annotations

import datetime
import logging
import re
import sys
import time
import warnings

from lightning.pytorch.callbacks import RichProgressBar


class _Drop(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def quiet() -> None:
    # lightning 2.6 calls a pytree API that torch 2.13 deprecates; nothing for a user to do
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # an advertisement, printed by every Trainer without a LitLogger
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_Drop(r"^💡 Tip"))
    import datasets
    import diffusers
    import transformers

    # the recipes use no image processor; the PIL fallback transformers picks is fine
    transformers.utils.logging.get_logger("transformers.utils.import_utils").addFilter(
        _Drop(r"requires torchvision \(not installed\)")
    )
    # a transformer-only LoRA loaded into a pipeline with text encoders: nothing is wrong
    diffusers.utils.logging.get_logger("diffusers.loaders.lora_base").addFilter(_Drop(r"^No LoRA keys associated"))
    # FLUX.3's modular pipeline (recipes/flux3_pipeline.py), built from loaded modules: its guider announces that
    # guiders are new, and each module handed over without a ComponentSpec is said to be recreatable from its config
    diffusers.utils.logging.get_logger("diffusers.guiders.guider_utils").addFilter(_Drop(r"^Guiders are currently"))
    diffusers.utils.logging.get_logger("diffusers.modular_pipelines.modular_pipeline_utils").addFilter(
        _Drop(r"^Component was not created using `ComponentSpec`")
    )
    # per-file loading/saving bars of the tiny pipeline and the cache flash by and bury the training bar
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()


class StepProgressBar(RichProgressBar):
    """Lightning's rich bar, labelled for step-based runs: ``Epoch 1`` and ``step 14/30``, never
    Lightning's ``Epoch 1/-2`` (its max_epochs - 1 when only max_steps is set).

    When stdout is not a terminal (SLURM, nohup, a pipe), a live bar shows nothing useful in the log file:
    the bar is then replaced by one plain line every ``every_n_steps`` optimizer steps and at the last one::

        step 120/4000  train_loss 0.4312  2.31 it/s  ETA 0:28:01

    (rank 0; it/s over the steps since the previous line).

    Args:
        every_n_steps: steps between plain lines.
        plain: force plain lines (True) or the live bar (False); None picks by whether stdout is a terminal.
    """

    def __init__(self, *args, every_n_steps: int = 50, plain: bool | None = None, **kwargs):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1 (steps between plain progress lines), got {every_n_steps}.")
        super().__init__(*args, **kwargs)
        self.every_n_steps, self.plain = every_n_steps, plain
        self._mark: tuple[int, float] | None = None  # (step, time) of the previous plain line

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.plain is None:
            self.plain = not sys.stdout.isatty()
        if self.plain:
            self.disable()  # no live display; on_train_batch_end prints the lines

    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        self._mark = (trainer.global_step, time.monotonic())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        step, last = trainer.global_step, trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if not self.plain or not trainer.is_global_zero or self._mark is None or step == self._mark[0]:
            return
        if step % self.every_n_steps and step != last:
            return
        print(self.line(trainer, pl_module), flush=True)

    def line(self, trainer, pl_module) -> str:
        """One plain progress line: step, the progress-bar metrics, it/s since the last line and the ETA."""
        step, now = trainer.global_step, time.monotonic()
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        rate = (step - self._mark[0]) / max(now - self._mark[1], 1e-9)
        self._mark = (step, now)
        parts = [f"step {step}/{total}" if total else f"step {step}"]
        for key, value in self.get_metrics(trainer, pl_module).items():
            if key != "step":
                parts.append(f"{key} {value:.4f}" if isinstance(value, float) else f"{key} {value}")
        parts.append(f"{rate:.2f} it/s")
        if total:
            parts.append(f"ETA {datetime.timedelta(seconds=round((total - step) / max(rate, 1e-9)))}")
        return "  ".join(parts)

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs > 0:
            return super()._get_train_description(current_epoch)
        return f"Epoch {current_epoch}"

    @property
    def total_train_batches(self) -> int | float:
        """The batches this epoch runs: those already run in it plus what the remaining steps need.

        Lightning's own total is ``min(epoch length, remaining steps)``; a run resumed inside an epoch creates
        its bar after the first resumed batch, when the steps left are fewer than the batches that epoch has
        already counted (``6/2`` instead of ``6/6``).
        """
        trainer = self.trainer
        total = trainer.num_training_batches
        if trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0:
            done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
            remaining = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
            return min(total, done + remaining)
        return total

    def get_metrics(self, trainer, pl_module):
        items = super().get_metrics(trainer, pl_module)
        if trainer.max_steps and trainer.max_steps > 0:
            items = {"step": f"{trainer.global_step}/{trainer.max_steps}", **items}
        items.pop("v_num", None)
        return items

"""A clean console for the recipes: our progress bar and messages, not known-harmless library noise.

Each filter names one message that is harmless here and why; anything else still reaches the console.
``quiet()`` runs when a recipe is imported, so every launched rank installs the same filters.
"""

from __future__ import annotations

import logging
import re
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
    # per-file loading/saving bars of the tiny pipeline and the cache flash by and bury the training bar
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()


class StepProgressBar(RichProgressBar):
    """Lightning's rich bar, labelled for step-based runs: ``Epoch 1`` and ``step 14/30``, never
    Lightning's ``Epoch 1/-2`` (its max_epochs - 1 when only max_steps is set)."""

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

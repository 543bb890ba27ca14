"""Light checkpoints for the recipes: trainable parameters, optimizer, scheduler, loops, data order, RNG.

The frozen base is never written (it is reloaded from ``pretrained``), so a Flux LoRA checkpoint is
megabytes, not the 24 GB of Lightning's default. :class:`LightCheckpoint` saves every N steps, keeps the
last K, writes ``last.ckpt`` for ``--ckpt_path last`` and a LoRA export beside each checkpoint.
:func:`check_identity` turns a checkpoint of another model, LoRA rank or data-parallel layout into an
error that says what to do, before any weight is loaded.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from recipes import lora


def check_identity(saved: dict | None, current: dict, state_dict: dict | None) -> None:
    """Raise ValueError when a checkpoint cannot resume this run exactly."""
    if saved is None:
        raise ValueError(
            "this checkpoint was not written by a cp_lightning recipe (no 'recipe' entry): resume from a "
            "recipe checkpoint (checkpoints/last.ckpt), or load its weights into the model yourself."
        )
    for key, what in (("family", "model family"), ("pretrained", "base model")):
        if saved[key] != current[key]:
            raise ValueError(
                f"the checkpoint was trained on {what} {saved[key]!r}, this run is {current[key]!r}: resume with "
                f"--model.pretrained {saved['pretrained']} (the same recipe), or start a fresh run without --ckpt_path."
            )
    if saved["lora_rank"] != current["lora_rank"]:
        raise ValueError(
            f"the checkpoint holds a LoRA of rank {saved['lora_rank']}, this run trains rank {current['lora_rank']}: "
            f"resume with --model.lora_rank {saved['lora_rank']}, or start a fresh run without --ckpt_path."
        )
    keys = sorted(current["trainable"]) if state_dict is None else sorted(state_dict)
    if saved["trainable"] != current["trainable"] or keys != sorted(current["trainable"]):
        missing = sorted(set(current["trainable"]) ^ set(saved["trainable"]))[:3]
        raise ValueError(
            f"the checkpoint's trainable parameters differ from this run's (e.g. {missing or 'shapes'}): it was "
            "written with other LoRA targets or another architecture; resume with the checkpoint's settings."
        )
    if saved["dp"] != current["dp"]:
        raise ValueError(
            f"the checkpoint was written with {saved['dp']} data-parallel groups (dp={saved['dp']}, cp={saved['cp']}), "
            f"this run has dp={current['dp']} (cp={current['cp']}). The data order and the per-dp-rank random "
            f"states depend on dp: resume with devices x num_nodes = {saved['dp']} x cp, or start a fresh run "
            "(the LoRA export beside the checkpoint can seed it). Changing cp alone is fine."
        )


def schedule_change(saved: dict | None, current: dict) -> str | None:
    """A warning when a resumed run's learning-rate schedule takes another shape than the checkpoint's: a cosine
    or linear decay reaches 0 at ``max_steps``, so a new ``max_steps`` bends the rest of the curve (the
    scheduler's state holds only the step count). None when nothing changes (a constant schedule has no end)."""
    if not saved or saved == current:
        return None
    kind, before, after = current["lr_scheduler"], saved.get("max_steps"), current["max_steps"]
    if saved.get("lr_scheduler") != kind or saved.get("warmup_steps") != current["warmup_steps"]:
        return (
            f"resuming a run trained with lr_scheduler={saved.get('lr_scheduler')!r}, warmup_steps="
            f"{saved.get('warmup_steps')} under lr_scheduler={kind!r}, warmup_steps={current['warmup_steps']}: the "
            "learning-rate schedule changes shape from the resumed step on."
        )
    if kind == "constant" or before == after:
        return None
    return (
        f"resuming a {kind} schedule written for max_steps={before} with max_steps={after}: the learning rate now "
        f"decays to 0 at step {after} instead of {before}, so the schedule's shape changes from the resumed step "
        f"on (the curve is not the one a {after}-step run follows). Resume with --trainer.max_steps {before} to keep "
        "it, or start a fresh run for a different length."
    )


class _SkipBatches(torch.utils.data.Sampler):
    """A batch sampler that skips the first ``skip`` batches of its next pass (indices only, no data read)."""

    def __init__(self, batch_sampler):
        self.batch_sampler, self.skip = batch_sampler, 0

    def set_epoch(self, epoch: int) -> None:  # Lightning sets the epoch through the loader's batch sampler
        self.batch_sampler.set_epoch(epoch)

    def __iter__(self):
        batches, skip = iter(self.batch_sampler), self.skip
        self.skip = 0
        for _ in range(skip):
            next(batches, None)
        yield from batches

    def __len__(self) -> int:
        return len(self.batch_sampler)


class ResumableLoader(DataLoader):
    """A DataLoader whose position Lightning checkpoints (its ``state_dict``): the epoch and the batches the
    training loop has consumed in it. A resumed run sets the batch sampler's epoch and skips those
    batches, so it sees exactly the batches the uninterrupted run would have seen.

    The position comes from the Trainer's loop, not from counting batches handed out: the loop and the
    loader's workers fetch ahead. ``batch_sampler`` needs ``set_epoch`` (it shuffles per epoch).
    """

    def __init__(self, dataset, *, batch_sampler, trainer=None, **kwargs):
        super().__init__(dataset, batch_sampler=_SkipBatches(batch_sampler), **kwargs)
        self.trainer = trainer

    def state_dict(self) -> dict:
        if self.trainer is None:
            return {}
        progress = self.trainer.fit_loop.epoch_loop.batch_progress.current
        return {"epoch": self.trainer.current_epoch, "batches": progress.processed}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        epoch, batches = state["epoch"], state["batches"]
        if batches >= len(self.batch_sampler):  # saved at the end of an epoch: the next one starts afresh
            epoch, batches = epoch + 1, 0
        # Lightning creates the resumed epoch's iterator before it sets the sampler's epoch: set it here
        self.batch_sampler.set_epoch(epoch)
        self.batch_sampler.skip = batches


class LightCheckpoint(ModelCheckpoint):
    """Every ``every_n_steps`` optimizer steps: ``<out_dir>/checkpoints/step_<N>.ckpt`` with the trainable
    parameters, optimizer, scheduler, loop progress, data order and RNG states (the module leaves the frozen
    base out), the LoRA export beside it in ``step_<N>_lora/``, the last ``keep_last`` of both kept, and
    ``last.ckpt`` (a link to the newest) for ``--ckpt_path last``.

    Args:
        out_dir: the run's folder.
        every_n_steps: checkpoint period in optimizer steps; 0 writes no checkpoints.
        keep_last: how many checkpoints to keep (the newest).
        export_format: format of the LoRA export beside each checkpoint (``diffusers`` or ``comfyui``).
    """

    def __init__(
        self,
        out_dir: str = "outputs/run",
        *,
        every_n_steps: int = 0,
        keep_last: int = 2,
        export_format: str = "diffusers",
    ):
        if every_n_steps < 0 or keep_last < 1:
            raise ValueError(f"need every_n_steps >= 0 and keep_last >= 1, got {every_n_steps} and {keep_last}.")
        if export_format not in lora.FORMATS:
            raise ValueError(f"export_format must be one of {lora.FORMATS}, got {export_format!r}.")
        super().__init__(
            dirpath=Path(out_dir) / "checkpoints",
            filename="step_{step}",
            auto_insert_metric_name=False,
            monitor="step",  # the highest steps are the newest: top-k by step keeps the last k
            mode="max",
            save_top_k=keep_last if every_n_steps else 0,
            save_last="link" if every_n_steps else False,
            every_n_train_steps=every_n_steps,
            every_n_epochs=0,
            save_on_train_epoch_end=False,
            # step_<N> names are unique, and a resumed run must relink last.ckpt rather than add a last-v1.ckpt
            # beside it (the checkpoint it resumed from recorded no last_model_path: last is linked after it)
            enable_version_counter=False,
        )
        self.export_format = export_format

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        module = trainer.lightning_module
        if module.hparams.lora_rank:  # every rank: the export gathers FSDP shards, rank 0 writes
            lora.export(
                module,
                _lora_dir(filepath),
                fmt=self.export_format,
                step=trainer.global_step,
                epoch=trainer.current_epoch,
            )

    def _remove_checkpoint(self, trainer, filepath: str) -> None:
        super()._remove_checkpoint(trainer, filepath)
        if trainer.is_global_zero:
            for folder in (_lora_dir(filepath), Path(str(_lora_dir(filepath)) + "_ema")):
                shutil.rmtree(folder, ignore_errors=True)


def _lora_dir(checkpoint: str) -> Path:
    path = Path(checkpoint)
    return path.with_name(path.stem + "_lora")

"""Light checkpoints for the recipes: trainable parameters, optimizer, scheduler, loops, data order, RNG.

The frozen base is never written (it is reloaded from ``pretrained``), so a Flux LoRA checkpoint is
megabytes, not the 24 GB of Lightning's default. :class:`LightCheckpoint` saves every N steps, keeps the
last K, writes ``last.ckpt`` for ``--ckpt_path last`` and a LoRA export beside each checkpoint.
:func:`check_identity` turns a checkpoint of another model, LoRA rank or data-parallel layout into an
error that says what to do, before any weight is loaded.
"""

from __future__ import annotations


def check_identity(saved: dict | None, current: dict, state_dict: dict) -> None:
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
    if saved["trainable"] != current["trainable"] or sorted(state_dict) != sorted(current["trainable"]):
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

"""Sharded checkpoints of an FSDP2 model: the torch.distributed.checkpoint (DCP) directories that the Lightning
strategy writes and reads with ``fsdp=True``.

A checkpoint directory holds

- ``state_dict.<name>``: the model's tensors, each rank writing its own shards;
- ``optimizer_<i>.*``: each optimizer's state, sharded like its parameters;
- ``<key>.<parameter name>``: per-parameter extras that the LightningModule put into the checkpoint as a dict
  of sharded tensors keyed by parameter names (an EMA of the trainable parameters), sharded like those
  parameters;
- ``meta.pt``: everything else (loops, callbacks, per-dp-rank RNG states, hyper-parameters), written by rank 0.

DCP reshards every tensor into the loading run's layout (any dp x cp, FSDP or HSDP).

Light checkpoints: a LightningModule with ``strict_loading = False`` may leave frozen tensors out of its
state dict in ``on_save_checkpoint`` (a LoRA run keeps its adapter; the frozen base is reloaded from the
pretrained weights in ``configure_model``). Such a checkpoint is loaded tensor by tensor for what it holds,
and a *trainable* parameter it lacks is still an error (it would silently restart from its initial value).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

META = "meta.pt"  # Lightning's name for the non-tensor part (lightning.fabric.utilities.load._METADATA_FILENAME)
MODEL = "state_dict"


def _holds_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, dict) and any(isinstance(v, DTensor) for v in value.values())


def saved_tensors(path: Path) -> dict[str, Any]:
    """The DCP directory's tensor metadata: flattened key -> metadata (``.size``, ``.properties.dtype``)."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(path)).read_metadata().state_dict_metadata


def save(checkpoint: dict, path: Path, rank: int) -> None:
    """Write Lightning's ``checkpoint`` dict as the DCP directory ``path`` (created; collective: every rank
    calls it with its own shards). ``checkpoint`` loses the entries written as tensors."""
    from torch.distributed.checkpoint import save as dcp_save

    path.mkdir(parents=True, exist_ok=True)
    state = {MODEL: checkpoint.pop(MODEL)}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    extras = sorted(k for k, v in checkpoint.items() if _holds_dtensor(v))  # e.g. the recipe's EMA
    state.update({k: checkpoint.pop(k) for k in extras})
    checkpoint.setdefault("cp_lightning", {})["sharded_extras"] = extras
    dcp_save(state, checkpoint_id=path)
    if rank == 0:
        torch.save(checkpoint, path / META)


def read_meta(path: Path, weights_only=None) -> dict:
    """The non-tensor part of the checkpoint (``meta.pt``; rank-local, no collectives)."""
    return torch.load(path / META, weights_only=weights_only, map_location="cpu")


def load(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    strict: bool,
    weights_only=None,
    meta: dict | None = None,
) -> dict:
    """Load the DCP directory ``path`` into the sharded ``module`` and its ``optimizers`` in place (collective)
    and return the rest of the checkpoint (``meta``, read from ``meta.pt`` unless given), with the
    per-parameter extras as tensors sharded like their parameters. Run
    :func:`cp_lightning.sharding.check_checkpoint_layout` first (no collectives)."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    saved = saved_tensors(path)
    model_state = get_model_state_dict(module)
    if not strict:  # a light checkpoint: only what it holds (the layout check refused missing trainable ones)
        model_state = {k: v for k, v in model_state.items() if f"{MODEL}.{k}" in saved}
    dcp_load({MODEL: model_state}, checkpoint_id=path)
    set_model_state_dict(module, model_state, options=StateDictOptions(strict=strict))
    for i, optimizer in enumerate(optimizers):
        key = f"optimizer_{i}"
        optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
        dcp_load(optimizer_state, checkpoint_id=path)
        set_optimizer_state_dict(
            module, optimizer, optim_state_dict=optimizer_state[key], options=StateDictOptions(cpu_offload=True)
        )
    checkpoint = read_meta(path, weights_only) if meta is None else meta
    extras = checkpoint.get("cp_lightning", {}).get("sharded_extras", [])
    if extras:
        targets = {key: _extra_targets(key, saved, module) for key in extras}
        dcp_load(targets, checkpoint_id=path)
        checkpoint.update(targets)
    return checkpoint


def _extra_targets(key: str, saved: dict[str, Any], module: nn.Module) -> dict[str, torch.Tensor]:
    """Empty tensors sharded like the parameters that the extra ``key``'s entries are named after."""
    params = dict(module.named_parameters())
    prefix = f"{key}."
    targets = {}
    for flat, meta in saved.items():
        if not flat.startswith(prefix):
            continue
        name = flat[len(prefix) :]
        if name not in params or tuple(params[name].shape) != tuple(meta.size):
            raise ValueError(
                f"the checkpoint's {key!r} entry {name!r} (shape {tuple(meta.size)}) matches no parameter of this "
                "model; per-parameter checkpoint state (an EMA) must be keyed by the model's parameter names. "
                "Resume with the model configuration the checkpoint was saved from."
            )
        targets[name] = torch.empty_like(params[name], dtype=meta.properties.dtype)
    return targets

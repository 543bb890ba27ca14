"""What :class:`cp_lightning.accelerate.ContextParallel` refuses, read from local state before any collective:
the Accelerator's plugins and options, the models and optimizers given to ``prepare``."""

from __future__ import annotations

import os
from collections.abc import Mapping

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cp_lightning import data_parallel, sharding
from cp_lightning.compilation import compile_options
from cp_lightning.mesh import _local_world_size, validate_degrees


def check_dynamo_plugin(accelerator, compile: dict | None) -> None:
    """Accelerate's own torch.compile (``Accelerator(dynamo_backend=...)``, ``accelerate config``) wraps the
    prepared model: refuse it beside ``compile=`` (the blocks would be compiled twice) and where it asks
    for what the compiled CP path cannot honour (CUDA graphs, dynamic shapes)."""
    from accelerate.utils import DynamoBackend

    plugin = accelerator.state.dynamo_plugin
    if plugin is None or plugin.backend == DynamoBackend.NO:
        return
    if compile is not None:
        raise ValueError(
            f"the Accelerator compiles the prepared model itself (dynamo backend {plugin.backend.value.lower()!r}, "
            "from dynamo_backend=, ACCELERATE_DYNAMO_BACKEND or `accelerate config`), and compile= would compile its "
            "blocks again inside it; use one of them (compile= compiles each block with fullgraph=True after "
            "parallelizing)."
        )
    kwargs = {k: v for k, v in plugin.to_kwargs().items() if k in ("backend", "mode", "options", "dynamic")}
    try:
        compile_options(kwargs)
    except ValueError as err:
        raise ValueError(f"the Accelerator's dynamo plugin: {err}") from None


def check_accelerator(accelerator, cp: int, ring: int, allow_cross_node: bool) -> None:
    """Refuse what this integration cannot run exactly; reads only local state (no collectives)."""
    from accelerate import Accelerator
    from accelerate.utils import DDPCommunicationHookType

    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"expected an accelerate.Accelerator, got {type(accelerator).__name__}.")
    kind = accelerator.distributed_type.value
    # A plugin also shows in the environment (set by the Accelerator or `accelerate launch --use_fsdp`), even
    # where Accelerate ignores it (FSDP on CPU processes falls back to DDP without a word).
    for plugin in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        if os.environ.get(f"ACCELERATE_USE_{plugin}", "false").lower() == "true":
            kind = plugin
    if kind in ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA"):
        raise ValueError(
            f"cp_lightning's Accelerate integration wraps the model for data parallelism itself (DDP, or FSDP2 with "
            f"ContextParallel(..., fsdp=True)) with its own gradient math and does not "
            f"support {kind}. Remove the FSDP/DeepSpeed/Megatron plugin (Accelerator(fsdp_plugin=..., "
            "deepspeed_plugin=...)) and the matching `accelerate config` / `accelerate launch --use_fsdp` or "
            "`--use_deepspeed` options; plain multi-process launching (multi-GPU or --cpu) is what it needs."
        )
    config = getattr(accelerator, "parallelism_config", None)
    if config is not None and (config.cp_enabled or config.tp_enabled or config.dp_shard_enabled):
        raise ValueError(
            f"the Accelerator has a ParallelismConfig with cp={config.cp_size}, tp={config.tp_size}, "
            f"dp_shard={config.dp_shard_size}; cp_lightning replaces Accelerate's own context parallelism. Drop "
            "parallelism_config and pass cp= to cp_lightning.accelerate instead."
        )
    handler = accelerator.ddp_handler
    if handler is not None and handler.comm_hook != DDPCommunicationHookType.NO:
        raise ValueError(
            f"DistributedDataParallelKwargs(comm_hook={handler.comm_hook.value}) would replace the hook that sums "
            "gradients over the CP group; drop comm_hook from the Accelerator's kwargs_handlers."
        )
    if accelerator.dispatch_batches:
        raise ValueError(
            "dispatch_batches=True sends every process its own slice of rank 0's batch, but CP peers need the "
            "same batch; use DataLoaderConfiguration(dispatch_batches=False)."
        )
    world = accelerator.num_processes
    if world == 1 and cp > 1:
        raise ValueError(
            f"cp={cp} needs cp processes, but Accelerate runs 1. Launch with `accelerate launch --num_processes {cp} "
            "...` (or a multiple of cp; add --cpu on a machine without GPUs), or use cp=1."
        )
    if world % cp != 0:
        raise ValueError(
            f"cp={cp} must divide the number of processes ({world}); the data-parallel degree is their quotient. "
            f"Pick cp from the divisors of {world}, or launch a multiple of {cp} processes "
            f"(`accelerate launch --num_processes {cp * max(1, world // cp)} ...`)."
        )
    validate_degrees(cp, ring, world, _local_world_size(), allow_cross_node=allow_cross_node)


def check_model(accelerator, model: nn.Module, plan: Mapping | None) -> None:
    if isinstance(model, DistributedDataParallel) or type(model).__name__ in (
        "FullyShardedDataParallel",
        "DeepSpeedEngine",
    ):
        raise TypeError(
            f"the model is already wrapped in {type(model).__name__} (did accelerator.prepare see it?). Pass the bare "
            "model to ContextParallel.prepare; it parallelizes it, then wraps it for data parallelism itself."
        )
    if any(p.__class__.__name__ == "DTensor" for p in model.parameters()):
        raise TypeError(
            "the model has DTensor (sharded) parameters; pass the unsharded model (ContextParallel(..., fsdp=True) "
            "shards it itself, after parallelizing)."
        )
    if any(model is m for m in accelerator._models):
        raise ValueError(
            "this model was already passed to accelerator.prepare; pass it to ContextParallel.prepare instead."
        )
    data_parallel.check_targets(model, plan)


def refuse_sharded_state(models, *_args) -> None:
    if any(sharding.is_sharded(m) for m in models):
        raise ValueError(
            "accelerator.save_state/load_state cannot handle a model cp_lightning sharded with fsdp=True (it would "
            "save rank 0's shards as the whole model); use cp.save_state(path, model=model, optimizer=optimizer) "
            "and cp.load_state(path, model=model, optimizer=optimizer), which write sharded checkpoints."
        )


def sharded_param(model: nn.Module, name: str) -> nn.Parameter:
    return model.get_parameter(name)


def check_optimizers(optimizers, models, sharded: set[int]) -> None:
    """Under FSDP an optimizer must be prepared with its model (its parameters are then replaced by the sharded
    ones) or created from the already sharded model; anything else would train stale copies."""
    known = {id(p) for m in models for p in m.parameters()} | sharded
    for optimizer in optimizers:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        stale = [p for p in params if id(p) not in known]
        if stale or (optimizer.state and any(id(p) not in sharded for p in params)):
            raise ValueError(
                f"with fsdp=True this optimizer would train {len(stale) or len(params)} stale, unsharded parameters: "
                "it was created before the model was sharded and is not prepared together with it. Pass model and "
                "optimizer to the same ContextParallel.prepare(model, optimizer, ...) call (before any optimizer "
                "step), or create the optimizer from the prepared model's parameters."
            )

"""``FabricContextParallelStrategy``: the context-parallel strategy for Lightning Fabric; ``fabric.setup(model)``
parallelizes and wraps (or shards) the model, with the gradient math of :mod:`cp_lightning.strategy`'s
Lightning strategy (both adapt :class:`cp_lightning.adapter.ContextParallelAdapter`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from torch import nn

from cp_lightning import faults, loading, sharding
from cp_lightning.adapter import ContextParallelAdapter


class FabricContextParallelStrategy(ContextParallelAdapter, FabricDDPStrategy):
    """:class:`~cp_lightning.ContextParallelStrategy` for Lightning Fabric: ``fabric.setup(model)`` parallelizes and
    wraps (or shards) the model.

    With ``fsdp=True`` create the optimizer after ``fabric.setup(model)`` from the sharded parameters
    (``fabric.setup_optimizers``); ``fabric.save``/``fabric.load`` write and read sharded checkpoints.
    ``timeout`` is as for the Lightning strategy: the rendezvous at ``fabric.launch()`` waits at
    least Lightning's 30 min, every group of the mesh ``timeout`` from ``fabric.setup(model)`` on.
    ``nonfinite`` too: losses are checked in ``fabric.backward``, local gradients (DDP) in the communication
    hook, gradient shards (FSDP) after the reduce-scatter, and all ranks agree in ``optimizer.step()``, which
    raises on every rank or skips the step (counted in ``skipped_steps``); the step named is the number of
    optimizer steps before it.
    ``activation_offload`` too, checked and applied in ``fabric.setup(model)`` (checkpointing enabled before).
    """

    def __init__(
        self,
        cp: int,
        ring: int = 1,
        *,
        plan: Mapping | None = None,
        loss_parallel: bool = False,
        layout: str = "contiguous",
        kernel: str | None = None,
        allow_cross_node: bool = False,
        check_steps: int = 2,
        fsdp: bool = False,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        hsdp: bool = False,
        fsdp_blocks: Sequence[str] | None = None,
        fsdp_units: str = "blocks",
        compile: bool | Mapping = False,
        timeout: timedelta | float | None = None,
        nonfinite: str = "raise",
        activation_offload: bool = False,
        dynamic_cp: bool = False,
        min_tokens_per_rank: int | None = None,
        dynamic_weighting: str = "samples",
        **kwargs: Any,
    ) -> None:
        if cp == "auto":
            # the mesh is built at fabric.launch(), before fabric.setup(model) shows the model or any data
            raise ValueError(
                "cp='auto' is not supported by FabricContextParallelStrategy: Fabric builds the mesh at "
                "fabric.launch(), before the model and the data are known. Plan the layout first (python -m "
                "cp_lightning.plan --model NAME --gpus N --gpu-memory GIB --tokens T ... --json, or "
                "cp_lightning.planner.search) and pass its cp and ring; ContextParallelStrategy (Lightning) "
                "takes cp='auto'."
            )
        self._init_cp(cp, ring, plan, loss_parallel, kernel, allow_cross_node, check_steps, layout)
        self._init_fsdp(fsdp, reshard_after_forward, cpu_offload, hsdp, fsdp_blocks, fsdp_units)
        self._init_compile(compile, activation_offload)
        self._init_dynamic(dynamic_cp, min_tokens_per_rank, dynamic_weighting)
        self._init_timeout(timeout, kwargs)
        self.nonfinite = faults.NonFiniteCheck(nonfinite, owner="FabricContextParallelStrategy")
        self._optimizer_steps = 0  # Fabric keeps no step count: the one named in a non-finite step's error
        self._sharded_params: set[int] = set()
        super().__init__(**kwargs)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for a non-finite loss or gradient (``nonfinite="skip"``)."""
        return self.nonfinite.skipped

    def backward(self, tensor: torch.Tensor, module, *args, **kwargs) -> None:
        if self.nonfinite.active:
            self.nonfinite.note_loss(tensor)  # the gradients are noted in DDP's communication hook
        super().backward(tensor, module, *args, **kwargs)

    def optimizer_step(self, optimizer, **kwargs):
        step, self._optimizer_steps = self._optimizer_steps, self._optimizer_steps + 1
        if self.nonfinite.active and self.fsdp:  # no DDP hook saw them: check the reduce-scattered shards
            self.nonfinite.note_sharded_grads(p for g in optimizer.param_groups for p in g["params"])
        if self.nonfinite.active and self.nonfinite.resolve(step, self.root_device):  # raises in mode "raise"
            optimizer.zero_grad(set_to_none=True)  # the optimizer leaves parameters without a gradient alone
        return super().optimizer_step(optimizer, **kwargs)

    def module_to_device(self, module: nn.Module) -> None:
        # meta-built weights are allocated on the device by setup_module (after sharding under FSDP)
        loading.move_unpending(module, self.root_device)

    def setup_module(self, module: nn.Module):
        if self.fsdp:
            sharding.check_fsdp_model(module, self.plan, self.fsdp_options)  # before any collective
        self._check_pretrained(module)
        if not self.fsdp:
            self._load_pretrained(module)
        self._parallelize(module)
        self._compile(module)
        self._set_collective_timeout()  # here, as Lightning's setup: loading the model before may take longer
        if self.fsdp:
            self.module_to_device(module)
            self._shard(module)
            self._load_pretrained(module)
            self._sharded_params.update(id(p) for p in module.parameters())
            return module
        self._sync_states(module)
        ddp = super().setup_module(module)
        self._register_cp_hook(ddp)
        return ddp

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        if self.fsdp and optimizers:
            raise ValueError(
                "fsdp=True replaces the model's parameters with sharded ones, so an optimizer created before "
                "fabric.setup(model) would train stale copies. Call model = fabric.setup(model) first, then create "
                "the optimizer from model.parameters() and pass it to fabric.setup_optimizers(optimizer)."
            )
        return super().setup_module_and_optimizers(module, optimizers, scheduler)

    def setup_optimizer(self, optimizer):
        if self.fsdp:
            stale = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in self._sharded_params]
            if stale:
                raise ValueError(
                    f"the optimizer holds {len(stale)} parameters that are not the sharded model's (it was created "
                    "before fabric.setup(model) sharded it, and would train stale copies). Create the optimizer "
                    "after model = fabric.setup(model), from model.parameters()."
                )
        return super().setup_optimizer(optimizer)

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        # DDP's version skips nothing either, but states it: on DTensor gradients the norm is the full one
        self.precision.unscale_gradients(optimizer)
        parameters = self.precision.main_params(optimizer)
        return torch.nn.utils.clip_grad_norm_(
            parameters, max_norm=max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    def save_checkpoint(self, path, state, storage_options=None, filter=None) -> None:
        if not self.fsdp:
            return super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
        from lightning.fabric.strategies.model_parallel import _save_checkpoint

        if storage_options is not None or filter is not None:
            raise TypeError("fsdp=True writes torch.distributed.checkpoint directories; drop storage_options/filter.")
        state = {**state, "cp_lightning": self._checkpoint_meta()}
        _save_checkpoint(Path(self.broadcast(path)), state, full_state_dict=False, rank=self.global_rank)

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only=None) -> dict:
        if not self.fsdp:
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        from lightning.fabric.strategies.model_parallel import _load_checkpoint

        path = Path(self.broadcast(path))
        if not isinstance(state, dict):
            raise TypeError("fsdp=True loads into a state dict of objects: fabric.load(path, {'model': model, ...}).")
        modules = [m for m in state.values() if isinstance(m, nn.Module)]
        if len(modules) != 1:
            raise ValueError(f"fsdp=True loads one sharded model per checkpoint; the state holds {len(modules)}.")
        key = next(k for k, m in state.items() if isinstance(m, nn.Module))
        sharding.check_checkpoint_layout(path, modules[0], self.dp_size, prefix=f"{key}.")
        full = {**state, "cp_lightning": None}
        rest = _load_checkpoint(path, full, strict=strict, weights_only=weights_only)
        for k in state:  # Fabric's contract: non-module entries of `state` are updated in place
            if not isinstance(state[k], (nn.Module, torch.optim.Optimizer)):
                state[k] = full[k]
        self._restore_rng_state((full["cp_lightning"] or {}).get("rng_states"))
        self.nonfinite.skipped = (full["cp_lightning"] or {}).get("skipped_steps", 0)
        return rest

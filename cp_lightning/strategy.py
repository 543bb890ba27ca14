"""``ContextParallelStrategy``: Lightning training over a (dp, cp) mesh with exact gradient math.

A thin adapter over :mod:`cp_lightning.data_parallel` (which owns the parallelization order, the
data-parallel wrapping and its gradient math, seeding and checkpoint state), in a fixed order:
validate the layout (at Trainer construction, before any process starts), build the mesh (readable in
``configure_model``), seed torch's RNG per data-parallel rank, parallelize every module that has a
plan, then wrap in DDP over the flattened dp x cp group with a communication hook that divides by
dp instead of the world size:

    full gradient = SUM over cp (each CP rank holds its shard's part) and MEAN over dp

in one all-reduce per bucket. Plain DDP divides by dp x cp: cp times too small. In loss-parallel
mode each rank's loss covers its own shard, so the plain mean over dp x cp is already exact.
The sampler is sized by dp, so CP peers draw the same batch.

With ``fsdp=True`` the model is sharded with FSDP2 instead of DDP (parameters, gradients and optimizer
state split over the flattened dp x cp mesh, or HSDP), with the same gradient math; checkpoints are then
sharded ``torch.distributed.checkpoint`` directories, saved and resumed through Lightning's own
``ModelCheckpoint`` / ``ckpt_path`` flow (see docs/fsdp.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from cp_lightning import dynamic, faults, loading, sharded_checkpoint, sharding
from cp_lightning.adapter import ContextParallelAdapter
from cp_lightning.checkpoint_io import AtomicCheckpointIO, repair_epoch_progress


class ContextParallelStrategy(ContextParallelAdapter, DDPStrategy):
    """Lightning strategy: context parallelism over groups of ``cp`` devices, data parallel across them.

    Args:
        cp: context-parallel degree (consecutive devices of a node); dp = devices x num_nodes / cp. ``"auto"``:
            the layout planner picks the smallest cp (and its ring) that fits, at set-up, from the module's
            ``planner_model()`` and the data module's buckets (``cp_lightning/planner/auto.py``), and logs it.
        ring: ring degree inside cp (cp = ring x ulysses); 1 is pure Ulysses.
        tokens: (cp="auto") tokens per sample, one per bucket, instead of the data module's bucket table.
        gpu_memory: (cp="auto", dynamic_cp) the memory budget per process in GiB; default: the CUDA device's memory.
        plan: ``{module_path: plan}`` for modules without a diffusers ``_cp_plan``; by default every
            submodule that has one is parallelized.
        loss_parallel: keep outputs sharded and compute the loss per shard (see ``cp_lightning.loss_shard``).
        layout: how the split hooks cut each sequence: ``"contiguous"`` (one run per rank) or ``"head_tail"``
            (a head and a tail run per rank, by whole frames: a ring or USP under a block-causal mask runs
            balanced; for models whose library entry supports it, SkyReels-V2 diffusion forcing; see
            ``cp_lightning.parallelize``).
        kernel: local attention kernel for ring attention (see ``cp_lightning.kernels``).
        allow_cross_node: let a CP group span nodes.
        check_steps: training steps during which CP peers' inputs are checked to be identical.
        fsdp: shard parameters, gradients and optimizer state with FSDP2 (one unit per repeated block plus
            each parallelized model) instead of replicating them with DDP; checkpoints become sharded
            ``torch.distributed.checkpoint`` directories. ``precision="bf16-mixed"`` gathers parameters in
            bf16 and reduces gradients in fp32.
        reshard_after_forward: (fsdp) free gathered block parameters after forward, gather again in backward.
        cpu_offload: (fsdp) keep sharded parameters, gradients and optimizer state in CPU memory.
        hsdp: (fsdp) shard inside each CP group and replicate across dp, instead of sharding over dp x cp.
        fsdp_blocks: (fsdp) class names of the blocks to shard one by one; default: the model's diffusers
            ``_repeated_blocks``.
        fsdp_units: (fsdp) ``"blocks"``: one FSDP unit per block; ``"children"``: one per direct submodule of a
            block that holds parameters (attention, feed-forward, norms), so a gather holds a part of a block:
            less memory in flight, more collectives. Not with ``compile=`` (see docs/memory.md).
        compile: compile the parallelized models' repeated blocks with ``torch.compile(fullgraph=True)``:
            True, or a dict of ``torch.compile`` arguments (see ``cp_lightning.compilation``).
        timeout: how long a collective waits for its peers (a ``timedelta`` or seconds), in every group of the
            mesh, before it fails naming the collective and the missing ranks; Lightning's 30 min if None.
        nonfinite: a non-finite loss or local gradient (under FSDP: gradient shard) ``"raise"``s
            :class:`~cp_lightning.faults.NonFiniteError` (naming the step and the ranks, before any weight changes),
            ``"skip"``s the step (counted in ``skipped_steps``, logged) or is ``"ignore"``d (no check). See
            docs/operations.md.
        activation_offload: keep each checkpointed block's inputs in CPU memory until backward (pinned, copied
            asynchronously on CUDA) and recompute blocks without repeating their CP communication: the outputs
            of the all-to-alls and of ring attention are kept (:mod:`cp_lightning.offload`). Needs gradient
            checkpointing (``model.enable_gradient_checkpointing()`` in ``configure_model``); checked at setup.
        dynamic_cp: run each step at the CP degree its samples' length calls for (:mod:`cp_lightning.dynamic`,
            docs/dynamic_cp.md): sub-groups of every power-of-two degree dividing cp (a power of two) are built at
            set-up; the LightningModule's ``dynamic_cp_step(batch)`` says each batch's tokens per sample, samples
            and the step's total W; gradients stay exact under any mix of degrees. Needs a degree-aware batch
            sampler (``use_distributed_sampler=False``; the recipes' bucket sampler is one).
        min_tokens_per_rank: (dynamic_cp) a step runs at the largest degree whose tokens per rank reach it.
            Default: the layout planner's (the smallest degree it predicts a sample fits at) where the module
            has ``planner_model()`` and the memory budget is known (CUDA or ``gpu_memory``), else 4096.
        dynamic_weighting: (dynamic_cp) ``"samples"`` (each sample's loss weighs 1) or ``"tokens"``.
        **kwargs: passed to Lightning's ``DDPStrategy`` (``start_method``, ``checkpoint_io``, DDP arguments).
            Checkpoints are written atomically (:class:`~cp_lightning.checkpoint_io.AtomicCheckpointIO`)
            unless another ``checkpoint_io`` is given.
    """

    strategy_name = "context_parallel"

    def __init__(
        self,
        cp: int | str,
        ring: int = 1,
        *,
        tokens: Sequence[int] | None = None,
        gpu_memory: float | None = None,
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
        self._init_cp(cp, ring, plan, loss_parallel, kernel, allow_cross_node, check_steps, layout)
        self._plan_hints = {"tokens": list(tokens) if tokens else None, "gpu_memory": gpu_memory}
        self._init_fsdp(fsdp, reshard_after_forward, cpu_offload, hsdp, fsdp_blocks, fsdp_units)
        self._init_compile(compile, activation_offload)
        self._init_dynamic(dynamic_cp, min_tokens_per_rank, dynamic_weighting)
        self.nonfinite = faults.NonFiniteCheck(nonfinite)
        self._init_timeout(timeout, kwargs)
        kwargs.setdefault("checkpoint_io", AtomicCheckpointIO())
        super().__init__(**kwargs)
        self._rank_table: list | None = None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for a non-finite loss or gradient (``nonfinite="skip"``), resumes included."""
        return self.nonfinite.skipped

    def setup_environment(self) -> None:
        super().setup_environment()
        self._rank_table = faults.rank_table()

    def setup(self, trainer) -> None:
        if self.dynamic_cp:
            dynamic.check_module(self.lightning_module)  # before any collective
        if self.fsdp:
            options = self.fsdp_options
            sharding.check_fsdp_model(self.lightning_module, self.plan, options)  # before any collective
        self._check_pretrained(self.lightning_module)
        if not self.fsdp:
            self._load_pretrained(self.lightning_module)
        self._parallelize(self.lightning_module)
        self._compile(self.lightning_module)
        self._set_collective_timeout()
        super().setup(trainer)

    def training_step(self, *args, **kwargs):
        if self.dynamic_cp:
            return self._dynamic_training_step(*args, **kwargs)
        out = super().training_step(*args, **kwargs)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if self.nonfinite.active and isinstance(loss, torch.Tensor):
            self.nonfinite.note_loss(loss)
        return out

    def _dynamic_training_step(self, *args, **kwargs):
        # the degree before the forward's first collective; the loss weighted after it (Lightning then divides
        # it by accumulate_grad_batches, which the factor includes)
        trainer = self.lightning_module.trainer
        step = dynamic.step_of(self.lightning_module, args[0])
        factor = self.dynamic_step(step, accumulate=trainer.accumulate_grad_batches)
        out = super().training_step(*args, **kwargs)
        if isinstance(out, Mapping):
            return {**out, "loss": out["loss"] * factor}
        if self.nonfinite.active and isinstance(out, torch.Tensor):
            self.nonfinite.note_loss(out)
        return out * factor

    def validation_step(self, *args, **kwargs):
        if self.dynamic is not None:  # validation batches are dp-sharded as without dynamic CP: the full CP group
            self.dynamic.bind(self.cp)
        return super().validation_step(*args, **kwargs)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        try:
            return self._optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            if self.dynamic is not None:  # callbacks between steps (sampling) see the full CP group
                self.dynamic.bind(self.cp)

    def _optimizer_step(self, optimizer, closure, model=None, **kwargs):
        if not self.nonfinite.active:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        trainer = self.lightning_module.trainer

        def checked_closure():
            result = closure()  # forward and backward: the gradients are all-reduced now
            if self.fsdp:  # no DDP hook saw them: check the reduce-scattered shards
                self.nonfinite.note_sharded_grads(p for g in optimizer.param_groups for p in g["params"])
            if self.nonfinite.resolve(trainer.global_step, self.root_device):  # raises in mode "raise"
                optimizer.zero_grad(set_to_none=True)  # the optimizer leaves parameters without a gradient alone
                for logger in trainer.loggers:
                    logger.log_metrics({"skipped_steps": self.nonfinite.skipped}, step=trainer.global_step)
            return result

        return super().optimizer_step(optimizer, checked_closure, model, **kwargs)

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if faults.is_collective_failure(exception):
            timeout = self._collective_timeout or self._timeout
            faults.augment(
                exception,
                faults.explain_collective_failure(
                    exception, rank=self.global_rank, table=self._rank_table, timeout=timeout
                ),
            )
        # Lightning's script launcher stops the other ranks when a child fails, not when rank 0 (the launching
        # process) raises: they would wait in a collective until the timeout, orphaned.
        if isinstance(self.launcher, _SubprocessScriptLauncher):
            faults.stop_processes(self.launcher.procs)

    def model_to_device(self) -> None:
        # meta-built weights are allocated on the device by configure_ddp, after sharding
        loading.move_unpending(self.model, self.root_device)

    def configure_ddp(self) -> None:
        if self.fsdp:
            # sharded in place: the LightningModule itself stays the model Lightning drives
            self._shard(self.lightning_module)
            self._load_pretrained(self.lightning_module)
            return
        self._sync_states(self.model)
        super().configure_ddp()
        self._register_cp_hook(self.model)

    # -- checkpoints: DDP a plain file (rank 0), FSDP a torch.distributed.checkpoint directory ----------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return self.fsdp  # a sharded checkpoint loads into the sharded model and its optimizer

    @property
    def lightning_restore_optimizer(self) -> bool:
        return not self.fsdp  # FSDP: load_checkpoint already restored the optimizer

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self.fsdp:
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(cpu_offload=True))

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if not self.fsdp:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        return get_optimizer_state_dict(self.model, optimizer, options=StateDictOptions(cpu_offload=True))

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if not self.fsdp:
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if not self.fsdp:
            super().load_optimizer_state_dict(checkpoint)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        # Every rank calls this; rank 0 writes. The RNG state differs per dp rank (and is equal on CP
        # peers), so each dp rank's state goes into the checkpoint and a resumed run draws the same noise.
        checkpoint["cp_lightning"] = self._checkpoint_meta()
        if not self.fsdp:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if storage_options is not None:
            raise TypeError("fsdp=True writes torch.distributed.checkpoint directories; drop storage_options.")
        path = Path(self.broadcast(filepath))
        if path.is_file():
            path.unlink()
        sharded_checkpoint.save(checkpoint, path, self.global_rank)

    def load_checkpoint(self, checkpoint_path, *args, **kwargs) -> dict:
        path = Path(self.broadcast(checkpoint_path))
        if not self.fsdp:
            if path.is_dir():
                raise ValueError(
                    f"{path} is a sharded (torch.distributed.checkpoint) checkpoint; resume it with "
                    "ContextParallelStrategy(..., fsdp=True), at any dp x cp layout."
                )
            checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
            _module_check(self.lightning_module, checkpoint)
        elif path.is_file():  # a full checkpoint into the sharded model: broadcast from rank 0
            from lightning.fabric.strategies.model_parallel import _load_checkpoint

            state = {"state_dict": self.model, **{f"optimizer_{i}": o for i, o in enumerate(self.optimizers)}}
            checkpoint = _load_checkpoint(
                path=path,
                state=state,
                strict=self.lightning_module.strict_loading,
                optimizer_states_from_list=True,
                weights_only=kwargs.get("weights_only"),
            )
        else:
            # a light checkpoint (strict_loading False) may hold the trainable tensors only
            strict, weights_only = self.lightning_module.strict_loading, kwargs.get("weights_only")
            meta = sharded_checkpoint.read_meta(path, weights_only)
            _module_check(self.lightning_module, meta)  # no collectives from here to the load
            sharding.check_checkpoint_layout(path, self.model, self.dp_size, strict=strict)
            checkpoint = sharded_checkpoint.load(
                path, self.model, self.optimizers, strict=strict, weights_only=weights_only, meta=meta
            )
        repair_epoch_progress(checkpoint)  # else a second resume re-shuffles with the previous epoch's seed
        state = checkpoint.get("cp_lightning", {})
        self._restore_rng_state(state.get("rng_states"))
        self.nonfinite.skipped = state.get("skipped_steps", 0)
        return checkpoint


def _module_check(module, checkpoint: dict) -> None:
    """The LightningModule's own ``check_checkpoint(checkpoint)``, when it has one: called with the checkpoint's
    non-tensor part before any weight is loaded (sharded: before any collective), so a module can refuse a
    checkpoint it cannot resume from with its own message (the recipes: another base model or LoRA rank)."""
    check = getattr(module, "check_checkpoint", None)
    if callable(check):
        check(checkpoint)


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    if "context_parallel" not in StrategyRegistry:
        StrategyRegistry.register(
            "context_parallel",
            ContextParallelStrategy,
            description="Ulysses CP over pairs of devices, DDP across",
            cp=2,
        )


_register()

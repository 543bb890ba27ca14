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

import logging
import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cp_lightning import data_parallel, dynamic, faults, loading, offload, sharded_checkpoint
from cp_lightning.checkpoint_io import AtomicCheckpointIO, repair_epoch_progress
from cp_lightning.compilation import compile_options, compile_targets
from cp_lightning.mesh import CP, DP, build_mesh

log = logging.getLogger("lightning.pytorch")  # shown at INFO like Lightning's own set-up lines


class _ContextParallel:
    """What the Lightning and the Fabric strategies share."""

    def _init_cp(self, cp, ring, plan, loss_parallel, kernel, allow_cross_node, check_steps) -> None:
        self._auto_cp = cp == "auto"  # the layout planner picks cp and ring in setup_environment
        cp = 1 if self._auto_cp else cp
        data_parallel.check_cp_options(cp, ring, plan, kernel, check_steps)
        self.cp, self.ring = cp, ring
        self.plan, self.loss_parallel, self.kernel = plan, bool(loss_parallel), kernel
        self.allow_cross_node, self.check_steps = allow_cross_node, check_steps
        self._mesh: DeviceMesh | None = None
        self.fsdp_options: data_parallel.FSDPOptions | None = None

    def _init_fsdp(self, fsdp, reshard_after_forward, cpu_offload, hsdp, fsdp_blocks) -> None:
        self.fsdp_options = data_parallel.fsdp_options(
            fsdp, reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload, hsdp=hsdp, blocks=fsdp_blocks
        )

    @property
    def fsdp(self) -> bool:
        return self.fsdp_options is not None

    def _init_timeout(self, timeout, kwargs: dict) -> None:
        # Joining at start-up can take longer than any collective should (ranks import and load at their own
        # pace): the rendezvous waits at least Lightning's default, the collectives `timeout` from setup on.
        self._collective_timeout = faults.check_timeout(timeout) if timeout is not None else None
        if timeout is not None:
            kwargs["timeout"] = max(self._collective_timeout, default_pg_timeout)

    def _set_collective_timeout(self) -> None:
        """Collective. Every group of the mesh: torch gives new groups 30 min, whatever the world's timeout."""
        faults.set_collective_timeout(self._collective_timeout or self._timeout, self.device_mesh, self.ring)

    def _init_dynamic(self, dynamic_cp, min_tokens_per_rank, weighting) -> None:
        """After _init_fsdp and _init_compile: dynamic CP's options are checked against theirs."""
        self.dynamic_cp, self.dynamic = bool(dynamic_cp), None  # the DynamicCP, built in _parallelize
        if not dynamic_cp:
            if min_tokens_per_rank is not None:
                raise ValueError("min_tokens_per_rank only applies with dynamic_cp=True; pass both or neither.")
            return
        if self._auto_cp:
            raise ValueError("dynamic_cp needs a number for cp (its largest degree), not cp='auto'.")
        self.min_tokens_per_rank = dynamic.check_dynamic_options(
            self.cp,
            min_tokens_per_rank=min_tokens_per_rank,
            weighting=weighting,
            loss_parallel=self.loss_parallel,
            compile=self.compile,
            hsdp=self.fsdp and self.fsdp_options.hsdp,
        )
        self.dynamic_weighting = weighting

    def dynamic_step(self, step: dynamic.DynamicStep, *, accumulate: int = 1, training: bool = True) -> float:
        """Collective (dynamic_cp). Switch to ``step``'s CP degree; returns the factor for its mean loss (see
        :meth:`cp_lightning.dynamic.DynamicCP.begin`). Lightning calls it per batch; Fabric users call it."""
        if self.dynamic is None:
            raise RuntimeError("dynamic_step needs dynamic_cp=True and a set-up model (fabric.setup / trainer.fit).")
        return self.dynamic.begin(step, accumulate=accumulate, training=training)

    def _init_compile(self, compile, activation_offload=False) -> None:
        self.compile = compile_options(compile)  # None when off; checked before any process starts
        self.activation_offload = offload.check_offload_option(activation_offload, compile=self.compile)

    def _compile(self, root: nn.Module) -> None:
        """After parallelize (and the user's checkpointing in configure_model), before DDP/FSDP wrapping."""
        compile_targets(root, self.plan, self.compile)

    # -- layout ---------------------------------------------------------------------------------
    def _configure_launcher(self) -> None:
        self._validate_layout()  # at Trainer/Fabric construction, before any process is launched
        super()._configure_launcher()

    def setup_environment(self) -> None:
        if self._auto_cp:
            self._choose_cp()
        self._validate_layout()
        super().setup_environment()
        self._build_mesh_and_seed()

    def _choose_cp(self) -> None:
        from cp_lightning.planner import auto

        chosen = auto.choose(self, **self._plan_hints)
        self.cp, self.ring = chosen.layout.cp, chosen.layout.ring
        if self.global_rank == 0:
            log.info(auto.describe(chosen, self._plan_hints["gpu_memory"] or chosen.gib_per_gpu))

    def _validate_layout(self) -> None:
        """Pure arithmetic on devices and nodes: runs before any process is launched."""
        self._fsdp_param_dtype()
        if self.fsdp and getattr(self, "_start_method", "popen") != "popen":
            raise ValueError(
                f"fsdp=True needs start_method='popen' (the default), got {self._start_method!r}: the "
                f"{self._start_method} launcher hands rank 0's parameters back to the main process, and under "
                "FSDP those are only its shard."
            )
        per_node, nodes = self.num_processes, self.num_nodes
        world = per_node * nodes
        if world == 1 and self.cp > 1:
            raise ValueError(
                f"cp={self.cp} needs cp processes, but the Trainer runs 1 (devices=1). Use devices={self.cp} "
                "(or more, a multiple of cp), or drop ContextParallelStrategy."
            )
        if world % self.cp != 0:
            raise ValueError(
                f"cp={self.cp} must divide the number of processes, devices x num_nodes = {per_node} x {nodes} = "
                f"{world}; the data-parallel degree is their quotient."
            )
        if per_node % self.cp != 0 and not self.allow_cross_node:
            raise ValueError(
                f"cp={self.cp} does not divide the {per_node} devices per node, so a CP group would span nodes "
                f"(slow inter-node attention traffic). Use cp dividing {per_node}, or pass allow_cross_node=True."
            )

    @property
    def device_mesh(self) -> DeviceMesh:
        """The (dp, cp) mesh; available from setup on (e.g. in ``configure_model``)."""
        if self._mesh is None:
            raise RuntimeError(
                "the device mesh is built when the strategy sets up its processes; read it in configure_model, "
                "setup() or later hooks, not in the LightningModule's __init__."
            )
        return self._mesh

    @property
    def dp_size(self) -> int:
        return self.device_mesh[DP].size()

    @property
    def dp_rank(self) -> int:
        return self.device_mesh[DP].get_local_rank()

    @property
    def cp_rank(self) -> int:
        return self.device_mesh[CP].get_local_rank()

    def _build_mesh_and_seed(self) -> None:
        self._mesh = build_mesh(self.cp, ring=self.ring, device_type=self.root_device.type, allow_cross_node=True)
        # Noise and timesteps drawn in training_step must be equal on CP peers and differ across dp
        # ranks, whether or not the user seeded: one base seed for the job, offset by the dp rank.
        data_parallel.seed_by_dp_rank(self.dp_rank, os.environ.get("PL_GLOBAL_SEED"))

    def _gather_rng_states(self) -> dict[int, dict]:
        return data_parallel.gather_rng_states(self.dp_rank)

    def _restore_rng_state(self, states: dict | None) -> None:
        data_parallel.restore_rng_state(states, self.dp_rank, self.dp_size)

    def _fsdp_param_dtype(self) -> torch.dtype | None:
        """The FSDP compute dtype for the Trainer's / Fabric's precision (None: keep the parameters' dtype)."""
        if not self.fsdp:
            return None
        plugin = getattr(self, "precision_plugin", None) or getattr(self, "precision", None)
        precision = str(getattr(plugin, "precision", "32-true"))
        if precision == "bf16-mixed":
            return torch.bfloat16  # gathered in bf16, reduced in fp32, compute under the plugin's autocast
        if precision in ("32-true", "bf16-true", "16-true", "64-true"):
            return None
        raise ValueError(
            f"fsdp=True does not support precision={precision!r} (fp16 mixed precision needs a sharded gradient "
            "scaler); use 'bf16-mixed', 'bf16-true' or '32-true'."
        )

    # -- model ----------------------------------------------------------------------------------
    def _parallelize(self, root: nn.Module) -> None:
        # before parallelize communicates
        offload.check_activation_offload(root, self.plan, enabled=self.activation_offload, compile=self.compile)
        if self.dynamic_cp:
            self.ring = dynamic.ring_for_targets(root, self.plan, self.cp, self.ring)
        data_parallel.parallelize_targets(
            root,
            mesh=self.device_mesh,
            plan=self.plan,
            ring=self.ring,
            kernel=self.kernel,
            loss_parallel=self.loss_parallel,
            check_steps=self.check_steps,
        )
        if self.activation_offload:  # after parallelize, before compile and DDP/FSDP wrapping
            offload.apply_activation_offload(root, self.plan)
        if self.dynamic_cp and self.dynamic is None:
            self.dynamic = dynamic.DynamicCP(
                self.device_mesh,
                [root],
                ring=self.ring,
                min_tokens_per_rank=self.min_tokens_per_rank,
                weighting=self.dynamic_weighting,
                timeout=self._collective_timeout or getattr(self, "_timeout", None),
            )

    def _shard(self, root: nn.Module) -> None:
        options = self.fsdp_options
        dtype = self._fsdp_param_dtype()
        if dtype is not None:
            options = data_parallel.FSDPOptions(**{**options.__dict__, "param_dtype": dtype})
        data_parallel.apply_fsdp(
            root,
            mesh=self.device_mesh,
            plan=self.plan,
            options=options,
            loss_parallel=self.loss_parallel,
            dynamic_cp=self.dynamic_cp,
        )

    # -- weights built on the meta device (cp_lightning.loading.empty_model) --------------------------
    def _check_pretrained(self, root: nn.Module) -> None:
        """Before any collective: every meta-built module's folder holds its weights (headers only)."""
        for module in loading.pending(root):
            loading.check_pretrained(module)

    def _load_pretrained(self, root: nn.Module) -> bool:
        """Allocate and load the meta-built modules of ``root`` on this rank's device: after sharding under
        FSDP (each rank reads its own slices), before wrapping under DDP (whole tensors, one at a time)."""
        offload = self.fsdp and self.fsdp_options.cpu_offload  # FSDP keeps the shards in host memory then
        return bool(loading.materialize(root, "cpu" if offload else self.root_device))

    def _sync_states(self, module: nn.Module) -> None:
        """Collective. DDP's start-up broadcast without its 250 MB buckets and copies of every weight (see
        data_parallel.sync_module_states). ``init_sync=False`` (the user's promise that the ranks' weights are
        equal) skips it, as it skips DDP's own."""
        if not hasattr(self, "_own_state_sync"):  # (LightningCLI passes DDP's default init_sync=True explicitly)
            self._own_state_sync = self._ddp_kwargs.get("init_sync", True) is not False
        if self._own_state_sync:
            data_parallel.sync_module_states(module)  # (float8 tensors too, as bytes)
        data_parallel.hide_float8_from_ddp(module)
        self._ddp_kwargs["init_sync"] = False

    def _checkpoint_meta(self) -> dict:
        meta = {"rng_states": self._gather_rng_states(), "cp": self.cp, "ring": self.ring, "fsdp": self.fsdp}
        if hasattr(self, "nonfinite"):
            meta["skipped_steps"] = self.nonfinite.skipped
        return meta

    def _register_cp_hook(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        # dynamic CP: every rank's loss is already its share of sum_i l_i / W, so the world's SUM is the gradient
        data_parallel.register_ddp_hook(
            ddp, 1 if self.dynamic_cp else self.dp_size, self.loss_parallel, nonfinite=getattr(self, "nonfinite", None)
        )

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's sequence shard of ``tensor`` (loss-parallel targets)."""
        from cp_lightning.collectives import shard

        return shard(tensor, dim, self.device_mesh[CP].get_group())

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # CP peers must draw the same samples: the sampler sees only the data-parallel axis
        if self.dynamic_cp:
            raise ValueError(
                "dynamic_cp needs a sampler that knows each step's degree (sub-groups of one CP group take different "
                "samples): pass use_distributed_sampler=False to the Trainer and a degree-aware batch sampler "
                "(recipes.buckets.BucketBatchSampler, or see docs/dynamic_cp.md)."
            )
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}


class ContextParallelStrategy(_ContextParallel, DDPStrategy):
    """Lightning strategy: context parallelism over groups of ``cp`` devices, data parallel across them.

    Args:
        cp: context-parallel degree (consecutive devices of a node); dp = devices x num_nodes / cp. ``"auto"``:
            the layout planner picks the smallest cp (and its ring) that fits, at set-up, from the module's
            ``planner_model()`` and the data module's buckets (``cp_lightning/planner/auto.py``), and logs it.
        ring: ring degree inside cp (cp = ring x ulysses); 1 is pure Ulysses.
        tokens: (cp="auto") tokens per sample, one per bucket, instead of the data module's bucket table.
        gpu_memory: (cp="auto") the memory budget per process in GiB; default: the CUDA device's memory.
        plan: ``{module_path: plan}`` for modules without a diffusers ``_cp_plan``; by default every
            submodule that has one is parallelized.
        loss_parallel: keep outputs sharded and compute the loss per shard (see ``cp_lightning.loss_shard``).
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
        compile: compile the parallelized models' repeated blocks with ``torch.compile(fullgraph=True)``:
            True, or a dict of ``torch.compile`` arguments (see ``cp_lightning.compilation``).
        timeout: how long a collective waits for its peers (a ``timedelta`` or seconds), in every group of the
            mesh, before it fails naming the collective and the missing ranks; Lightning's 30 min if None.
        nonfinite: a non-finite loss or local gradient ``"raise"``s :class:`~cp_lightning.faults.NonFiniteError`
            (naming the step and the ranks, before any weight changes), ``"skip"``s the step (counted in
            ``skipped_steps``, logged) or is ``"ignore"``d (no check). See docs/operations.md.
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
        kernel: str | None = None,
        allow_cross_node: bool = False,
        check_steps: int = 2,
        fsdp: bool = False,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        hsdp: bool = False,
        fsdp_blocks: Sequence[str] | None = None,
        compile: bool | Mapping = False,
        timeout: timedelta | float | None = None,
        nonfinite: str = "raise",
        activation_offload: bool = False,
        dynamic_cp: bool = False,
        min_tokens_per_rank: int | None = None,
        dynamic_weighting: str = "samples",
        **kwargs: Any,
    ) -> None:
        self._init_cp(cp, ring, plan, loss_parallel, kernel, allow_cross_node, check_steps)
        self._plan_hints = {"tokens": list(tokens) if tokens else None, "gpu_memory": gpu_memory}
        self._init_fsdp(fsdp, reshard_after_forward, cpu_offload, hsdp, fsdp_blocks)
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
            data_parallel.check_fsdp_model(self.lightning_module, self.plan, options)  # before any collective
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
            data_parallel.check_checkpoint_layout(path, self.model, self.dp_size, strict=strict)
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


class FabricContextParallelStrategy(_ContextParallel, FabricDDPStrategy):
    """The same for Lightning Fabric: ``fabric.setup(model)`` parallelizes and wraps (or shards) the model.

    With ``fsdp=True`` create the optimizer after ``fabric.setup(model)`` from the sharded parameters
    (``fabric.setup_optimizers``); ``fabric.save``/``fabric.load`` write and read sharded checkpoints.
    ``timeout`` is as for :class:`ContextParallelStrategy`: the rendezvous at ``fabric.launch()`` waits at
    least Lightning's 30 min, every group of the mesh ``timeout`` from ``fabric.setup(model)`` on.
    ``nonfinite`` too: losses are checked in ``fabric.backward``, local gradients (DDP) in the communication
    hook, and all ranks agree in ``optimizer.step()``, which raises on every rank or skips the step (counted
    in ``skipped_steps``); the step named is the number of optimizer steps before it.
    ``activation_offload`` too, checked and applied in ``fabric.setup(model)`` (checkpointing enabled before).
    """

    def __init__(
        self,
        cp: int,
        ring: int = 1,
        *,
        plan: Mapping | None = None,
        loss_parallel: bool = False,
        kernel: str | None = None,
        allow_cross_node: bool = False,
        check_steps: int = 2,
        fsdp: bool = False,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        hsdp: bool = False,
        fsdp_blocks: Sequence[str] | None = None,
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
        self._init_cp(cp, ring, plan, loss_parallel, kernel, allow_cross_node, check_steps)
        self._init_fsdp(fsdp, reshard_after_forward, cpu_offload, hsdp, fsdp_blocks)
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
        if self.nonfinite.active and self.nonfinite.resolve(step, self.root_device):  # raises in mode "raise"
            optimizer.zero_grad(set_to_none=True)  # the optimizer leaves parameters without a gradient alone
        return super().optimizer_step(optimizer, **kwargs)

    def module_to_device(self, module: nn.Module) -> None:
        # meta-built weights are allocated on the device by setup_module (after sharding under FSDP)
        loading.move_unpending(module, self.root_device)

    def setup_module(self, module: nn.Module):
        if self.fsdp:
            data_parallel.check_fsdp_model(module, self.plan, self.fsdp_options)  # before any collective
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
        data_parallel.check_checkpoint_layout(path, modules[0], self.dp_size, prefix=f"{key}.")
        full = {**state, "cp_lightning": None}
        rest = _load_checkpoint(path, full, strict=strict, weights_only=weights_only)
        for k in state:  # Fabric's contract: non-module entries of `state` are updated in place
            if not isinstance(state[k], (nn.Module, torch.optim.Optimizer)):
                state[k] = full[k]
        self._restore_rng_state((full["cp_lightning"] or {}).get("rng_states"))
        self.nonfinite.skipped = (full["cp_lightning"] or {}).get("skipped_steps", 0)
        return rest


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

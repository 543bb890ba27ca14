"""Context parallelism in an ordinary Hugging Face Accelerate training loop.

    accelerator = Accelerator()
    cp = ContextParallel(accelerator, cp=2)            # (dp, cp) mesh, RNG seeded per dp rank
    model, optimizer, loader = cp.prepare(model, optimizer, loader)
    for batch in loader:                                # CP peers get the same batch
        with accelerator.accumulate(model):
            loss = loss_fn(model(batch))
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()

The same engine and gradient math as :class:`cp_lightning.ContextParallelStrategy` (both are adapters over
:mod:`cp_lightning.data_parallel`), in the same fixed order: validate (pure arithmetic on Accelerate's
process state, before any collective), build the mesh,
seed per dp rank, :func:`cp_lightning.parallelize` every module with a plan, then Accelerate's own DDP
wrapping with the strategy's communication hook (SUM over cp, MEAN over dp, one all-reduce per
bucket). After that hook every rank holds the full gradient, so ``accelerator.clip_grad_norm_`` and
the optimizer see exactly what one process would. Data loaders are sharded by dp rank with Accelerate's
own ``prepare_data_loader``. Accelerate's own context parallelism (``ParallelismConfig(cp_size=...)``)
needs FSDP2 and forces causal attention; FSDP, DeepSpeed and Megatron plugins are refused here:
``ContextParallel(..., fsdp=True)`` shards the model with FSDP2 itself, with the same gradient math.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from cp_lightning import accelerate_checks as checks
from cp_lightning import accelerate_state, data_parallel, dynamic, faults, loading, offload, sharding
from cp_lightning.compilation import compile_options, compile_targets
from cp_lightning.mesh import CP, DP, build_mesh

__all__ = ["ContextParallel", "prepare_context_parallel"]


class ContextParallel:
    """Context parallelism over groups of ``cp`` processes of an Accelerate job; data parallel across them.

    Construction validates the layout against ``accelerator`` (before any collective), builds the
    ``(dp, cp)`` mesh and seeds torch's and Python's RNG with one job seed offset by the dp rank, so
    noise drawn in the loop is equal on CP peers and differs across dp ranks.

    Args:
        accelerator: a plain (DDP or single-process) ``accelerate.Accelerator``.
        cp: context-parallel degree (consecutive ranks of a node); dp = num_processes / cp.
        ring: ring degree inside cp (cp = ring x ulysses); 1 is pure Ulysses.
        plan: ``{module_path: plan}`` for modules without a diffusers ``_cp_plan``; by default every
            submodule of a prepared model that has one is parallelized.
        kernel: local attention kernel for ring attention (see ``cp_lightning.kernels``).
        check_steps: training forward passes during which CP peers' inputs are checked to be identical.
        loss_parallel: leave the model's output sharded; compute the loss on each rank's shard with the
            target cut by ``cp_lightning.loss_shard(target, model)``. The loss must be a per-token mean;
            DDP's plain mean over dp x cp is then exact (also for lengths cp does not divide), so no
            gradient hook is installed.
        seed: base of the per-dp-rank seed; by default rank 0's ``torch.initial_seed()`` (the value of
            ``accelerate.utils.set_seed`` if you called it before).
        allow_cross_node: let a CP group span nodes.
        fsdp: shard parameters, gradients and optimizer state with FSDP2 over the dp x cp mesh instead of
            DDP (same gradient math). Pass the model and its optimizer to the same ``prepare`` call (the
            optimizer is pointed at the sharded parameters) or create the optimizer afterwards from
            ``model.parameters()``. ``mixed_precision="bf16"`` gathers parameters in bf16, reduces in fp32.
        reshard_after_forward, cpu_offload, hsdp, fsdp_blocks, fsdp_units: FSDP options, as for
            :class:`cp_lightning.ContextParallelStrategy`.
        compile: compile the prepared models' repeated blocks with ``torch.compile(fullgraph=True)`` after
            parallelizing and before DDP: True, or a dict of ``torch.compile`` arguments
            (``cp_lightning.compilation``).
        timeout: how long a collective waits for its peers (a ``timedelta`` or seconds), in the world and every
            group of the mesh, before it fails. None: the world group's own timeout (Accelerate's
            ``InitProcessGroupKwargs(timeout=...)``, else torch's default) is given to the mesh groups too;
            torch would give them 30 min (NCCL: 10 min) whatever the world's. Set here after the rendezvous,
            so ``InitProcessGroupKwargs`` may keep a longer start-up wait.
        activation_offload: keep each checkpointed block's inputs in CPU memory until backward and recompute
            blocks without repeating their CP communication (:mod:`cp_lightning.offload`), as for
            :class:`cp_lightning.ContextParallelStrategy`. Enable gradient checkpointing before ``prepare``
            (``model.enable_gradient_checkpointing()``); checked in ``prepare``. Not with ``compile=``.
        dynamic_cp, min_tokens_per_rank, dynamic_weighting: each step at the CP degree its samples' length calls
            for, as for :class:`cp_lightning.ContextParallelStrategy`: call :meth:`dynamic_step` before each
            forward and multiply the loss by what it returns; the DataLoader's batch sampler gives each rank its
            sub-group's batch (it is not sharded again). See docs/dynamic_cp.md.
        nonfinite: a non-finite loss (seen in ``accelerator.backward``), local gradient (DDP) or gradient shard
            (FSDP) ``"raise"``s :class:`~cp_lightning.faults.NonFiniteError` in ``optimizer.step()`` on every rank,
            naming the step and the ranks, before any weight changes; ``"skip"`` skips the update and the
            scheduler's step (counted in :attr:`skipped_steps`); ``"ignore"``: no check. Multi-process runs.
    """

    def __init__(
        self,
        accelerator,
        *,
        cp: int,
        ring: int = 1,
        plan: Mapping | None = None,
        kernel: str | None = None,
        check_steps: int = 2,
        loss_parallel: bool = False,
        seed: int | None = None,
        allow_cross_node: bool = False,
        fsdp: bool = False,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        hsdp: bool = False,
        fsdp_blocks: Sequence[str] | None = None,
        fsdp_units: str = "blocks",
        compile: bool | Mapping = False,
        timeout: timedelta | float | None = None,
        activation_offload: bool = False,
        dynamic_cp: bool = False,
        min_tokens_per_rank: int | None = None,
        dynamic_weighting: str = "samples",
        nonfinite: str = "raise",
    ) -> None:
        data_parallel.check_cp_options(cp, ring, plan, kernel, check_steps)
        self.timeout = faults.check_timeout(timeout) if timeout is not None else None
        self.fsdp_options = sharding.fsdp_options(
            fsdp,
            reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload,
            hsdp=hsdp,
            blocks=fsdp_blocks,
            units=fsdp_units,
        )
        self.compile = compile_options(compile)  # None when off
        sharding.check_fsdp_compile(self.fsdp_options, self.compile)
        self.activation_offload = offload.check_offload_option(activation_offload, compile=self.compile)
        self.dynamic_cp, self.dynamic = bool(dynamic_cp), None  # the DynamicCP, built when the model is prepared
        if dynamic_cp:
            self.min_tokens_per_rank = dynamic.check_dynamic_options(
                cp,
                min_tokens_per_rank=min_tokens_per_rank,
                weighting=dynamic_weighting,
                loss_parallel=loss_parallel,
                compile=self.compile,
                hsdp=hsdp,
            )
            self.dynamic_weighting = dynamic_weighting
        elif min_tokens_per_rank is not None:
            raise ValueError("min_tokens_per_rank only applies with dynamic_cp=True; pass both or neither.")
        checks.check_accelerator(accelerator, cp, ring, allow_cross_node)
        checks.check_dynamo_plugin(accelerator, self.compile)
        if self.fsdp_options is not None:
            if accelerator.mixed_precision not in ("no", "bf16"):
                raise ValueError(
                    f"fsdp=True supports mixed_precision 'no' or 'bf16', got {accelerator.mixed_precision!r} (fp16 "
                    "needs a sharded gradient scaler)."
                )
            if accelerator.mixed_precision == "bf16":
                self.fsdp_options = sharding.FSDPOptions(
                    **{**self.fsdp_options.__dict__, "param_dtype": torch.bfloat16}
                )
        self._sharded_params: set[int] = set()
        self._refusing_state_hooks = False
        self.steps = accelerate_state.CheckedSteps(nonfinite)  # checks the mode: before any collective
        self.positions = accelerate_state.LoaderPositions()
        self.accelerator, self.cp, self.ring = accelerator, cp, ring
        self.plan, self.kernel, self.check_steps = plan, kernel, check_steps
        self.loss_parallel = bool(loss_parallel)
        self.mesh: DeviceMesh | None = None
        if accelerator.num_processes == 1:  # cp=1 on one process: plain Accelerate, same script
            self.seed = seed if seed is not None else torch.initial_seed()
            torch.manual_seed(self.seed)
            return
        self.mesh = build_mesh(cp, ring=ring, device_type=accelerator.device.type, allow_cross_node=True)
        # new groups get the backend's 30 min whatever the world's timeout (InitProcessGroupKwargs(timeout=...))
        if self.timeout is None:
            self.timeout = faults.group_timeout()
        if self.timeout is not None:
            faults.set_collective_timeout(self.timeout, self.mesh, ring)
        self.seed = data_parallel.seed_by_dp_rank(self.dp_rank, seed if seed is not None else torch.initial_seed())
        self.steps.watch_backward(accelerator)

    @property
    def dp_size(self) -> int:
        return self.mesh[DP].size() if self.mesh is not None else 1

    @property
    def dp_rank(self) -> int:
        return self.mesh[DP].get_local_rank() if self.mesh is not None else 0

    @property
    def cp_rank(self) -> int:
        return self.mesh[CP].get_local_rank() if self.mesh is not None else 0

    def dynamic_step(self, step: dynamic.DynamicStep, *, training: bool = True) -> float:
        """Collective (dynamic_cp). Switch to ``step``'s CP degree before the forward; returns the factor to multiply
        the micro-batch's mean loss by before ``accelerator.backward`` (which divides it by the accumulation
        steps: the factor includes them). See :class:`cp_lightning.dynamic.DynamicCP`."""
        if self.dynamic is None:
            raise RuntimeError("dynamic_step needs ContextParallel(..., dynamic_cp=True) and a prepared model.")
        accumulate = self.accelerator.gradient_accumulation_steps
        return self.dynamic.begin(step, accumulate=accumulate, training=training)

    def _parallelize(self, model: nn.Module) -> None:
        if self.dynamic_cp:  # degrees whose Ulysses group the heads cannot fill run ring attention
            self.ring = dynamic.ring_for_targets(model, self.plan, self.cp, self.ring)
        data_parallel.parallelize_targets(
            model,
            mesh=self.mesh,
            plan=self.plan,
            ring=self.ring,
            kernel=self.kernel,
            loss_parallel=self.loss_parallel,
            check_steps=self.check_steps,
        )
        if self.dynamic_cp and self.dynamic is None:
            self.dynamic = dynamic.DynamicCP(
                self.mesh,
                [model],
                ring=self.ring,
                min_tokens_per_rank=self.min_tokens_per_rank,
                weighting=self.dynamic_weighting,
                timeout=self.timeout,
            )

    def prepare(self, *objects: Any) -> Any:
        """Like ``accelerator.prepare``: models are parallelized and DDP-wrapped with exact gradient math,
        data loaders sharded by dp rank, anything else (optimizers, schedulers) passed to
        ``accelerator.prepare``. Everything is validated before the first collective.
        Returns the prepared objects in order (one object unpacked)."""
        for obj in objects:
            if isinstance(obj, nn.Module):
                checks.check_model(self.accelerator, obj, self.plan)
                for module in loading.pending(obj):  # a meta-built model's folder, from its headers
                    loading.check_pretrained(module)
                offload.check_activation_offload(obj, self.plan, enabled=self.activation_offload, compile=self.compile)
                if self.fsdp_options is not None and self.mesh is not None:
                    sharding.check_fsdp_model(obj, self.plan, self.fsdp_options)
            elif isinstance(obj, DataLoader) and getattr(obj, "_is_accelerate_prepared", False):
                raise ValueError(
                    "this DataLoader was already prepared by accelerator.prepare, which shards it over all "
                    f"{self.accelerator.num_processes} processes; CP peers need the same batch. Pass the original "
                    "DataLoader to ContextParallel.prepare."
                )
        sharded = self.fsdp_options is not None and self.mesh is not None
        models = [obj for obj in objects if isinstance(obj, nn.Module)]
        optimizers = [obj for obj in objects if isinstance(obj, torch.optim.Optimizer)]
        if sharded:
            checks.check_optimizers(optimizers, models, self._sharded_params)
        names = {id(p): (m, n) for m in models for n, p in m.named_parameters()} if sharded else {}
        prepared: list[Any] = [None] * len(objects)
        others = []
        for i, obj in enumerate(objects):
            if isinstance(obj, nn.Module):
                prepared[i] = self._prepare_model(obj)
            elif isinstance(obj, DataLoader):
                prepared[i] = self._prepare_data_loader(obj)
            else:
                others.append(i)
        if sharded:  # optimizers given with their model now point at its sharded parameters
            for optimizer in optimizers:
                for group in optimizer.param_groups:
                    group["params"] = [
                        checks.sharded_param(*names[id(p)]) if id(p) in names else p for p in group["params"]
                    ]
        if others:  # one call, in order: a scheduler is matched to the optimizer prepared with it
            result = self.accelerator.prepare(*(objects[i] for i in others))
            result = result if len(others) > 1 else (result,)
            for i, obj in zip(others, result, strict=True):
                prepared[i] = obj
                if self.mesh is not None and isinstance(objects[i], torch.optim.Optimizer):
                    self.steps.wrap(obj, self.accelerator, sharded=sharded, device=self.accelerator.device)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _prepare_model(self, model: nn.Module) -> nn.Module:
        if self.fsdp_options is None or self.mesh is None:
            loading.materialize(model, self.accelerator.device)  # meta-built weights, one tensor at a time
        if self.mesh is None:
            if self.activation_offload:
                offload.apply_activation_offload(model, self.plan)
            compile_targets(model, self.plan, self.compile)
            return self.accelerator.prepare_model(model)
        if self.fsdp_options is not None:
            return self._shard_model(model)
        self._parallelize(model)
        if self.activation_offload:  # after parallelize, before compile and DDP
            offload.apply_activation_offload(model, self.plan)
        compile_targets(model, self.plan, self.compile)  # after parallelize, before DDP
        data_parallel.prepare_ddp(model)  # an fp8 frozen base: gloo cannot broadcast float8
        wrapped = self.accelerator.prepare_model(model)  # device placement, autocast, DDP over dp x cp
        # not wrapped: nothing trainable, nothing to reduce; loss-parallel: DDP's own mean is exact
        if isinstance(wrapped, DistributedDataParallel):
            # Each CP rank's gradient is its shard's part: SUM over cp, MEAN over dp (DDP alone divides by dp x cp).
            # Dynamic CP: each rank's loss is its share of sum_i l_i / W already, so the SUM over the world.
            dp = 1 if self.dynamic_cp else self.dp_size
            data_parallel.register_ddp_hook(wrapped, dp, self.loss_parallel, nonfinite=self.steps.check)
        return wrapped

    def _shard_model(self, model: nn.Module) -> nn.Module:
        """Parallelize, then shard with FSDP2; Accelerate sees the sharded model as a plain one (its DDP wrapping
        would reduce the gradients a second time)."""
        acc = self.accelerator
        self._parallelize(model)
        if self.activation_offload:  # after parallelize, before compile and fully_shard
            offload.apply_activation_offload(model, self.plan)
        compile_targets(model, self.plan, self.compile)  # after parallelize, before fully_shard
        loading.move_unpending(model, acc.device)  # meta-built weights are allocated after sharding
        sharding.apply_fsdp(
            model,
            mesh=self.mesh,
            plan=self.plan,
            options=self.fsdp_options,
            loss_parallel=self.loss_parallel,
            dynamic_cp=self.dynamic_cp,
        )
        # each rank allocates and reads only its own shards (in host memory with cpu_offload)
        loading.materialize(model, "cpu" if self.fsdp_options.cpu_offload else acc.device)
        if self.fsdp_options.param_dtype is not None:  # what accelerator.prepare_model does for bf16: autocast
            forward = model.forward

            @functools.wraps(forward)
            def autocast_forward(*args, **kwargs):
                with acc.autocast():
                    return forward(*args, **kwargs)

            model.forward = autocast_forward
        self._sharded_params.update(id(p) for p in model.parameters())
        acc._models.append(model)  # accelerator.accumulate / clip_grad_norm_ / unwrap_model see it
        if not self._refusing_state_hooks:
            # accelerator.save_state would write rank 0's shards (and its optimizer shard) as if they were the
            # whole model: refuse on every rank alike, before anything is written
            acc.register_save_state_pre_hook(checks.refuse_sharded_state)
            acc.register_load_state_pre_hook(checks.refuse_sharded_state)
            self._refusing_state_hooks = True
        return model

    def save_state(self, path, *, model: nn.Module, optimizer=None, **extra: Any) -> None:
        """Save the prepared model (and optimizer) as a sharded ``torch.distributed.checkpoint`` directory, with
        each dp rank's RNG state, the prepared data loaders' positions, the optimizer step count and ``extra``
        (rank 0's values) in ``meta.pt``. Every rank calls it. Needed for ``fsdp=True`` (whose shards
        ``accelerator.save_state`` cannot write); it reshards on :meth:`load_state` at any dp x cp layout (not
        larger in dp than saved)."""
        state = {"loaders": self.positions.state(), "optimizer_steps": self.steps.optimizer_steps}
        state["skipped_steps"] = self.steps.check.skipped
        meta = {**extra, "cp_lightning": state}
        accelerate_state.save_sharded(path, model=model, optimizer=optimizer, dp_rank=self.dp_rank, meta=meta)

    def load_state(self, path, *, model: nn.Module, optimizer=None) -> dict:
        """Load what :meth:`save_state` wrote into the prepared model and optimizer (resharding as needed), restore
        this dp rank's RNG and each prepared data loader's position (its next epoch skips the batches the saved
        run had drawn: loop from ``loader.iteration``, the saved epoch); returns the ``extra`` values. Every rank
        calls it, after ``prepare``."""
        meta = accelerate_state.load_sharded(
            path, model=model, optimizer=optimizer, dp_rank=self.dp_rank, dp_size=self.dp_size
        )
        saved = meta.pop("cp_lightning", {})
        self.positions.restore(saved.get("loaders"), path)
        self.steps.optimizer_steps = saved.get("optimizer_steps", 0)
        self.steps.check.skipped = saved.get("skipped_steps", 0)
        return meta

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for a non-finite loss or gradient (``nonfinite="skip"``), resumes included."""
        return self.steps.check.skipped

    def _prepare_data_loader(self, loader: DataLoader):
        if self.mesh is None:
            return self.positions.track(self.accelerator.prepare_data_loader(loader))
        from accelerate.data_loader import prepare_data_loader

        acc = self.accelerator
        # Accelerate's own sharding with the data-parallel axis as the "processes": CP peers share a shard. Dynamic
        # CP: the loader's batch sampler already gives each rank its sub-group's batches (docs/dynamic_cp.md).
        replicas, index = (1, 0) if self.dynamic_cp else (self.dp_size, self.dp_rank)
        prepared = prepare_data_loader(
            loader,
            acc.device,
            num_processes=replicas,
            process_index=index,
            split_batches=acc.split_batches,
            put_on_device=acc.device_placement,
            rng_types=acc.rng_types.copy(),
            dispatch_batches=False,
            even_batches=acc.even_batches,
            use_seedable_sampler=acc.use_seedable_sampler,
            data_seed=acc.dataloader_config.data_seed,
            non_blocking=acc.non_blocking,
            use_stateful_dataloader=acc.use_stateful_dataloader,
        )
        acc._dataloaders.append(prepared)  # what accelerator.prepare does: save_state/load_state see its sampler
        return self.positions.track(prepared)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``accelerator.gather`` without the CP duplicates: one copy per dp rank, in dp order.

        ``accelerator.gather`` returns every process's tensor; CP peers hold identical ones, so its mean is
        already the global mean, but per-sample values appear cp times."""
        gathered = self.accelerator.gather(tensor)
        if self.mesh is None or self.cp == 1:
            return gathered
        # dp*cp*n, ... -> dp, cp, n, ... : keep cp rank 0's copy
        return gathered.unflatten(0, (self.dp_size, self.cp, -1))[:, 0].flatten(0, 1)


def prepare_context_parallel(accelerator, *objects: Any, cp: int, ring: int = 1, plan: Mapping | None = None, **kwargs):
    """One call: ``ContextParallel(accelerator, cp=..., ...).prepare(*objects)``; returns the prepared objects."""
    return ContextParallel(accelerator, cp=cp, ring=ring, plan=plan, **kwargs).prepare(*objects)

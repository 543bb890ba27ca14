"""What the Lightning and the Fabric strategies share: options checked at construction, the (dp, cp) mesh
and per-dp-rank seeding, parallelization before DDP/FSDP wrapping, weights built on the meta device, and DDP's
communication hook with the gradient rule of :mod:`cp_lightning.data_parallel`. :mod:`cp_lightning.strategy`
(Lightning) and :mod:`cp_lightning.fabric` (Fabric) are the adapters."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cp_lightning import data_parallel, dynamic, faults, loading, offload, sharding
from cp_lightning.compilation import compile_options, compile_targets
from cp_lightning.mesh import CP, DP, build_mesh

log = logging.getLogger("lightning.pytorch")  # shown at INFO like Lightning's own set-up lines


class ContextParallelAdapter:
    """What the Lightning and the Fabric strategies share."""

    def _init_cp(self, cp, ring, plan, loss_parallel, kernel, allow_cross_node, check_steps, layout="contiguous"):
        self._auto_cp = cp == "auto"  # the layout planner picks cp and ring in setup_environment
        cp = 1 if self._auto_cp else cp
        data_parallel.check_cp_options(cp, ring, plan, kernel, check_steps)
        if layout not in ("contiguous", "head_tail"):
            raise ValueError(f"layout must be 'contiguous' or 'head_tail', got {layout!r}.")
        if layout == "head_tail" and loss_parallel:
            raise ValueError(
                "layout='head_tail' cannot be combined with loss_parallel=True (loss_shard cuts targets "
                "contiguously); drop one of them."
            )
        self.layout = layout
        self.cp, self.ring = cp, ring
        self.plan, self.loss_parallel, self.kernel = plan, bool(loss_parallel), kernel
        self.allow_cross_node, self.check_steps = allow_cross_node, check_steps
        self._mesh: DeviceMesh | None = None
        self.fsdp_options: sharding.FSDPOptions | None = None

    def _init_fsdp(self, fsdp, reshard_after_forward, cpu_offload, hsdp, fsdp_blocks, fsdp_units="blocks") -> None:
        self.fsdp_options = sharding.fsdp_options(
            fsdp,
            reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload,
            hsdp=hsdp,
            blocks=fsdp_blocks,
            units=fsdp_units,
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
        self._planned_min_tokens = dynamic_cp and min_tokens_per_rank is None  # the planner may supply it
        if not dynamic_cp:
            if min_tokens_per_rank is not None:
                raise ValueError("min_tokens_per_rank only applies with dynamic_cp=True; pass both or neither.")
            return
        if self._auto_cp:
            raise ValueError("dynamic_cp needs a number for cp (its largest degree), not cp='auto'.")
        if self.layout != "contiguous":
            raise ValueError(
                f"dynamic_cp cannot be combined with layout={self.layout!r}: its layouts are built for one CP degree. "
                "Use layout='contiguous' with dynamic_cp."
            )
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
        sharding.check_fsdp_compile(self.fsdp_options, self.compile)
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
        if self._planned_min_tokens:
            self._plan_min_tokens()
        self._validate_layout()
        super().setup_environment()
        self._build_mesh_and_seed()

    def _choose_cp(self) -> None:
        from cp_lightning.planner import auto

        chosen = auto.choose(self, **self._plan_hints)
        self.cp, self.ring = chosen.layout.cp, chosen.layout.ring
        if self.global_rank == 0:
            log.info(auto.describe(chosen, self._plan_hints["gpu_memory"] or chosen.gib_per_gpu))

    def _plan_min_tokens(self) -> None:
        """dynamic_cp without min_tokens_per_rank: the planner's threshold where it can tell (Lightning, with the
        module's planner_model() and a GPU memory budget), else the default."""
        from cp_lightning.planner import auto

        hints = getattr(self, "_plan_hints", {})
        planned = auto.dynamic_min_tokens(self, gpu_memory=hints.get("gpu_memory"))
        if planned is not None:
            self.min_tokens_per_rank = planned
            if self.global_rank == 0:
                log.info(f"dynamic_cp: min_tokens_per_rank={planned} from the layout planner")

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
            layout=self.layout,
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
            options = sharding.FSDPOptions(**{**options.__dict__, "param_dtype": dtype})
        sharding.apply_fsdp(
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

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
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cp_lightning import data_parallel
from cp_lightning.mesh import CP, DP, build_mesh


class _ContextParallel:
    """What the Lightning and the Fabric strategies share."""

    def _init_cp(self, cp, ring, plan, loss_parallel, kernel, allow_cross_node, check_steps) -> None:
        data_parallel.check_cp_options(cp, ring, plan, kernel, check_steps)
        self.cp, self.ring = cp, ring
        self.plan, self.loss_parallel, self.kernel = plan, bool(loss_parallel), kernel
        self.allow_cross_node, self.check_steps = allow_cross_node, check_steps
        self._mesh: DeviceMesh | None = None

    # -- layout ---------------------------------------------------------------------------------
    def _configure_launcher(self) -> None:
        self._validate_layout()  # at Trainer/Fabric construction, before any process is launched
        super()._configure_launcher()

    def setup_environment(self) -> None:
        self._validate_layout()
        super().setup_environment()
        self._build_mesh_and_seed()

    def _validate_layout(self) -> None:
        """Pure arithmetic on devices and nodes: runs before any process is launched."""
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

    # -- model ----------------------------------------------------------------------------------
    def _parallelize(self, root: nn.Module) -> None:
        data_parallel.parallelize_targets(
            root,
            mesh=self.device_mesh,
            plan=self.plan,
            ring=self.ring,
            kernel=self.kernel,
            loss_parallel=self.loss_parallel,
            check_steps=self.check_steps,
        )

    def _register_cp_hook(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        data_parallel.register_ddp_hook(ddp, self.dp_size, self.loss_parallel)

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's sequence shard of ``tensor`` (loss-parallel targets)."""
        from cp_lightning.collectives import shard

        return shard(tensor, dim, self.device_mesh[CP].get_group())

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # CP peers must draw the same samples: the sampler sees only the data-parallel axis
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}


class ContextParallelStrategy(_ContextParallel, DDPStrategy):
    """Lightning strategy: context parallelism over groups of ``cp`` devices, data parallel across them.

    Args:
        cp: context-parallel degree (consecutive devices of a node); dp = devices x num_nodes / cp.
        ring: ring degree inside cp (cp = ring x ulysses); 1 is pure Ulysses.
        plan: ``{module_path: plan}`` for modules without a diffusers ``_cp_plan``; by default every
            submodule that has one is parallelized.
        loss_parallel: keep outputs sharded and compute the loss per shard (see ``cp_lightning.loss_shard``).
        kernel: local attention kernel for ring attention (see ``cp_lightning.kernels``).
        allow_cross_node: let a CP group span nodes.
        check_steps: training steps during which CP peers' inputs are checked to be identical.
        **kwargs: passed to Lightning's ``DDPStrategy`` (``timeout``, ``start_method``, DDP arguments).
    """

    strategy_name = "context_parallel"

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
        **kwargs: Any,
    ) -> None:
        self._init_cp(cp, ring, plan, loss_parallel, kernel, allow_cross_node, check_steps)
        super().__init__(**kwargs)

    def setup(self, trainer) -> None:
        self._parallelize(self.lightning_module)
        super().setup(trainer)

    def configure_ddp(self) -> None:
        super().configure_ddp()
        self._register_cp_hook(self.model)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        # Every rank calls this; rank 0 writes. The RNG state differs per dp rank (and is equal on CP
        # peers), so each dp rank's state goes into the checkpoint and a resumed run draws the same noise.
        checkpoint["cp_lightning"] = {"rng_states": self._gather_rng_states(), "cp": self.cp, "ring": self.ring}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path, *args, **kwargs) -> dict:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._restore_rng_state(checkpoint.get("cp_lightning", {}).get("rng_states"))
        return checkpoint


class FabricContextParallelStrategy(_ContextParallel, FabricDDPStrategy):
    """The same for Lightning Fabric: ``fabric.setup(model)`` parallelizes and wraps the model."""

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
        **kwargs: Any,
    ) -> None:
        self._init_cp(cp, ring, plan, loss_parallel, kernel, allow_cross_node, check_steps)
        super().__init__(**kwargs)

    def setup_module(self, module: nn.Module):
        self._parallelize(module)
        ddp = super().setup_module(module)
        self._register_cp_hook(ddp)
        return ddp


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

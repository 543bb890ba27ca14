"""The CP-peer consistency check: a silently wrong model becomes a loud error.

Every rank of a CP group must feed the model the *same* full tensors (same batch, same noise, same
timesteps). If a peer draws its own noise, each rank trains on a different sample and nothing fails.
At every split point this check takes a cheap checksum of the full tensor (its sum and a
position-weighted sum, in float64), all-gathers it in the CP group and raises
:class:`CPMismatchError` naming the tensor and the training forward pass when peers disagree. It
runs for the first ``steps`` training forward passes (after that, one all-gather per split point
would be pure overhead); every rank checks the same points, so all raise together, never hang.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cp_lightning.collectives import all_gather_no_grad


class CPMismatchError(ValueError):
    """CP peers were given different inputs at a split point."""


class ConsistencyCheck:
    def __init__(self, group: dist.ProcessGroup, steps: int = 0, rtol: float = 1e-6) -> None:
        if steps < 0:
            raise ValueError(f"check steps must be >= 0, got {steps}.")
        self.group, self.steps, self.rtol = group, steps, rtol
        self.forward_count = 0  # training forward passes of the parallelized module seen so far

    @property
    def active(self) -> bool:
        return 0 < self.forward_count <= self.steps

    def on_forward(self, module: torch.nn.Module) -> None:
        if module.training:
            self.forward_count += 1

    def __call__(self, where: str, x: torch.Tensor) -> None:
        if not self.active:
            return
        flat = x.detach().reshape(-1).to(torch.float64)
        weights = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=flat.device)
        local = torch.stack([flat.sum(), (flat * weights).sum()])
        every = all_gather_no_grad(local[None], 0, self.group)  # P, 2
        scale = every.abs().amax(dim=0).clamp_min(1e-30)
        if bool(((every - every[0]).abs() > self.rtol * scale).any()):
            raise CPMismatchError(
                f"CP peers disagree on {where} at training forward pass {self.forward_count}: checksums "
                f"{every.tolist()} (one row per CP rank). Every rank of a CP group must see the same batch, "
                "noise and timesteps: draw randomness from torch's global RNG (ContextParallelStrategy seeds it "
                "per data-parallel rank) or from a generator seeded the same way on CP peers."
            )

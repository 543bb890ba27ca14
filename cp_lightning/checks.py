"""The CP-peer consistency check: a silently wrong model becomes a loud error.

Every rank of a CP group must feed the model the *same* full tensors (same batch, same noise, same
timesteps). If a peer draws its own noise, each rank trains on a different sample and nothing fails.
At every split point this check takes a cheap checksum of the full tensor (its sum and a
position-weighted sum, in float64), all-gathers it in the CP group and raises
:class:`CPMismatchError` naming the tensor and the training forward pass when peers disagree. It
runs for the first ``steps`` training forward passes (after that, one all-gather per split point
would be pure overhead); every rank checks the same points, so all raise together, never hang.
While active it also cross-checks the shard lengths the engine looked up (see ``split_table.SplitState``)
against lengths exchanged between the ranks.

Under ``torch.compile`` the check must neither break the graph nor make it recompile: its counter
and its decisions live in custom ops (``cp_lightning::check_*``) that a compiled graph calls as
opaque side effects, so dynamo never reads (or guards on) a Python counter. ``parallelize`` installs
nothing at all when ``check_steps`` is 0.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.fx.node import has_side_effect

from cp_lightning.collectives import all_gather_no_grad, exchange_lengths


class CPMismatchError(ValueError):
    """CP peers were given different inputs at a split point."""


# the ops find their check by a plain integer key, since op arguments cannot be Python objects
_CHECKS: weakref.WeakValueDictionary[int, ConsistencyCheck] = weakref.WeakValueDictionary()


class ConsistencyCheck:
    def __init__(self, group: dist.ProcessGroup, steps: int = 0, rtol: float = 1e-6) -> None:
        if steps < 0:
            raise ValueError(f"check steps must be >= 0, got {steps}.")
        self.group, self.steps, self.rtol = group, steps, rtol
        self.forward_count = 0  # training forward passes of the parallelized module seen so far
        self.key = id(self)
        _CHECKS[self.key] = self

    @property
    def active(self) -> bool:
        return 0 < self.forward_count <= self.steps

    def on_forward(self, module: torch.nn.Module) -> None:
        if module.training:
            check_count_forward(self.key)

    def __call__(self, where: str, x: torch.Tensor) -> None:
        check_peers(x.detach(), self.key, where)

    def lengths(self, where: str, x: torch.Tensor, dim: int, expected: list[int]) -> None:
        """While active: the ranks' lengths of ``x`` along ``dim``, exchanged, must equal ``expected``."""
        check_lengths(x.detach(), self.key, where, dim, expected)

    def _peers(self, where: str, x: torch.Tensor) -> None:
        if not self.active:
            return
        flat = x.reshape(-1).to(torch.float64)
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

    def _lengths(self, where: str, x: torch.Tensor, dim: int, expected: list[int]) -> None:
        if not self.active:
            return
        actual = [row[0] for row in exchange_lengths([x.shape[dim]], self.group, x.device)]
        if actual != list(expected):
            raise RuntimeError(
                f"{where}: the CP ranks hold {actual} tokens along dim {dim}, but the lengths looked up from the "
                f"split hooks say {list(expected)}. The tensor is not a concatenation of this forward pass's "
                "splits; please report this with the model's plan."
            )


def _find(key: int) -> ConsistencyCheck:
    check = _CHECKS.get(key)
    assert check is not None, "the consistency check of a compiled graph was garbage-collected"
    return check


@torch.library.custom_op("cp_lightning::check_count_forward", mutates_args=())
def check_count_forward(key: int) -> None:
    """Count one training forward pass of the parallelized module."""
    _find(key).forward_count += 1


@torch.library.custom_op("cp_lightning::check_peers", mutates_args=())
def check_peers(x: torch.Tensor, key: int, where: str) -> None:
    """While the check is active: all-gather a checksum of ``x`` and raise if CP peers differ."""
    _find(key)._peers(where, x)


@torch.library.custom_op("cp_lightning::check_lengths", mutates_args=())
def check_lengths(x: torch.Tensor, key: int, where: str, dim: int, expected: list[int]) -> None:
    """While the check is active: exchange the ranks' lengths of ``x`` along ``dim`` and compare."""
    _find(key)._lengths(where, x, dim, expected)


for _op in (check_count_forward, check_peers, check_lengths):
    _op.register_fake(lambda *args: None)
    has_side_effect(_op._opoverload)  # no outputs: keep graphs from dropping the call

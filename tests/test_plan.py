"""Plans: validation against a module (no process group needed) and the hooks they install."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out
from torch import nn

from cp_lightning.plan import apply_plan, remove_plan, resolve_plan
from tests.distributed import spawn, sum_over


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, freqs, gate=None):
        out = self.lin(x) * freqs
        return out if gate is None else out * gate


class Rope(nn.Module):
    def forward(self, n: int):
        pos = torch.arange(n, dtype=torch.float32)[None, :, None]
        return torch.cos(pos), torch.sin(pos)


class Toy(nn.Module):
    """Per-token everywhere, so a split/gather plan must reproduce the unsplit module exactly."""

    def __init__(self, keyword: bool):
        super().__init__()
        self.keyword = keyword
        self.rope = Rope()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.proj_out = nn.Linear(3, 3)

    def forward(self, x, gate):
        cos, sin = self.rope(x.shape[1])
        for block in self.blocks:
            x = block(x=x, freqs=cos + sin, gate=gate) if self.keyword else block(x, cos + sin, gate)
        return self.proj_out(x)


PLAN = {
    "rope": {
        0: In(split_dim=1, expected_dims=3, split_output=True),
        1: In(split_dim=1, expected_dims=3, split_output=True),
    },
    "blocks.0": {"x": In(split_dim=1, expected_dims=3)},
    "blocks.*": {"gate": In(split_dim=1, expected_dims=3)},
    "proj_out": Out(gather_dim=1, expected_dims=3),
}


def test_star_expands_over_a_module_list():
    entries = {e.path: e for e in resolve_plan(Toy(True), PLAN)}
    assert [name for name, _ in entries["blocks.*"].modules] == ["blocks.0", "blocks.1"]
    assert entries["proj_out"].modules[0][0] == "proj_out"


@pytest.mark.parametrize(
    "plan,error,match",
    [
        ({"blocks.9": {"x": In(1)}, "proj_out": Out(1)}, ValueError, "names no submodule"),
        ({"proj_out.*": {"x": In(1)}, "proj_out": Out(1)}, ValueError, "must follow a ModuleList"),
        ({"blocks.*.*": {"x": In(1)}, "proj_out": Out(1)}, ValueError, "only once"),
        ({"blocks.0": {"y": In(1)}, "proj_out": Out(1)}, ValueError, "splits argument 'y'"),
        ({"rope": {0: In(1)}, "proj_out": Out(1)}, ValueError, "needs split_output=True"),
        ({"blocks.0": {"x": In(1, split_output=True)}, "proj_out": Out(1)}, ValueError, "integer key"),
        ({"blocks.0": {"x": Out(1)}, "proj_out": Out(1)}, TypeError, "must be a ContextParallelInput"),
        ({"proj_out": In(1)}, TypeError, "ContextParallelOutput"),
        ({"blocks.0": {"x": In(1)}}, ValueError, "gathers nothing back"),
        ({}, TypeError, "non-empty dict"),
    ],
)
def test_bad_plans_are_rejected_before_any_communication(plan, error, match):
    with pytest.raises(error, match=match):
        resolve_plan(Toy(True), plan)


def _hooks_worker(rank, world):
    results = {}
    for keyword in (True, False):
        torch.manual_seed(0)
        reference = Toy(keyword)
        model = Toy(keyword)
        model.load_state_dict(reference.state_dict())
        x = torch.randn(2, 4 * world, 3, generator=torch.Generator().manual_seed(1))
        gate = torch.rand(2, 4 * world, 1, generator=torch.Generator().manual_seed(2))

        ref_out = reference(x, gate)
        ref_out.square().sum().backward()

        handles = apply_plan(resolve_plan(model, PLAN), dist.group.WORLD)
        seen = {}

        def record(_module, args, kwargs, seen=seen):
            seen["len"] = (args[0] if args else kwargs["x"]).shape[1]

        probe = model.blocks[1].register_forward_pre_hook(record, with_kwargs=True)
        out = model(x, gate)
        out.square().sum().backward()
        probe.remove()
        grads = [p.grad.clone() for p in model.parameters()]
        sum_over(grads)
        remove_plan(handles)
        model.zero_grad()
        after_remove = model(x, gate)
        results[keyword] = {
            "local_len": seen["len"],
            "out_err": (out - ref_out).abs().max().item(),
            "grad_err": max(
                (g - p.grad).abs().max().item() for g, p in zip(grads, reference.parameters(), strict=True)
            ),
            "removed_err": (after_remove - ref_out).abs().max().item(),
        }
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_hooks_split_keyword_and_positional_args_and_outputs(world):
    for result in spawn(_hooks_worker, world):
        for keyword, r in result.items():
            assert r["local_len"] == 4, (keyword, r)  # blocks see this rank's shard only
            assert r["out_err"] <= 1e-6, (keyword, r)
            assert r["grad_err"] <= 1e-5, (keyword, r)  # SUM over the CP group = one-process gradient
            assert r["removed_err"] <= 1e-6, (keyword, r)  # remove_plan restores the plain module

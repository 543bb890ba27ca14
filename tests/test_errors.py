"""Bad input gets a clear ValueError/TypeError, raised before any collective is entered.

"Before any collective" is tested directly: only rank 0 makes the bad call while its peer waits
at a final barrier, under a short process-group timeout. A call that entered a collective would
hang there and surface as a timeout, not as the expected ValueError.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from torch import nn

from tests.distributed import spawn


class NoPlan(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_out = nn.Linear(4, 4)

    def forward(self, hidden_states):
        return self.proj_out(hidden_states)


def _bad_setup(name):
    """Each returns a zero-argument call that must raise before communicating."""
    from cp_lightning import parallelize
    from cp_lightning.tiny import tiny_model

    if name == "cp_not_dividing_world":
        return lambda: parallelize(tiny_model("flux"), cp=3)
    if name == "ring_not_dividing_cp":
        return lambda: parallelize(tiny_model("flux"), cp=2, ring=3)
    if name == "fewer_heads_than_ulysses":
        return lambda: parallelize(tiny_model("flux", heads=1), cp=2)
    if name == "no_plan":
        return lambda: parallelize(NoPlan(), cp=2)
    if name == "missing_module":
        plan = {"": {"hidden_states": ContextParallelInput(split_dim=1)}, "nope": ContextParallelOutput(gather_dim=1)}
        return lambda: parallelize(tiny_model("flux"), cp=2, plan=plan)
    if name == "unknown_argument":
        plan = {"": {"latents": ContextParallelInput(split_dim=1)}, "proj_out": ContextParallelOutput(gather_dim=1)}
        return lambda: parallelize(tiny_model("flux"), cp=2, plan=plan)
    if name == "kernel_without_lse":
        return lambda: parallelize(tiny_model("flux"), cp=2, ring=2, kernel="sdpa")
    raise KeyError(name)


SETUP_ERRORS = {
    "cp_not_dividing_world": "must divide the number of processes",
    "ring_not_dividing_cp": "ring=3 must divide cp=2",
    "fewer_heads_than_ulysses": "fewer than the Ulysses degree 2",
    "no_plan": "has no diffusers `_cp_plan`",
    "missing_module": "names no submodule",
    "unknown_argument": "splits argument 'latents'",
    "kernel_without_lse": "cannot return the log-sum-exp",
}
RUNTIME_ERRORS = {
    "sequence_shorter_than_cp": "every rank needs at least one element",
    "unexpected_dims": "expected a 3-d tensor",
    "per_query_mask": "one row per query",
    "kernel_for_another_device": "runs on \\('cuda',\\)",
}


def _runtime_call(name, model, ring_model, mesh):
    from cp_lightning.attention import ulysses_attention
    from cp_lightning.tiny import tiny_inputs

    if name == "sequence_shorter_than_cp":
        inputs = tiny_inputs("flux", model, tokens=1)
        return lambda: model(**inputs)
    if name == "unexpected_dims":
        inputs = tiny_inputs("flux", model)
        inputs["hidden_states"] = inputs["hidden_states"].unsqueeze(1)
        return lambda: model(**inputs)
    if name == "per_query_mask":
        q = torch.randn(1, 4, 2, 8)
        return lambda: ulysses_attention(q, q, q, group=mesh["cp"].get_group(), attn_mask=torch.ones(1, 1, 4, 4) > 0)
    if name == "kernel_for_another_device":
        inputs = tiny_inputs("flux", ring_model)
        return lambda: ring_model(**inputs)
    raise KeyError(name)


def _worker(rank, world):
    import torch.distributed as dist

    from cp_lightning import build_mesh, parallelize
    from cp_lightning.tiny import tiny_model

    caught = {}

    def attempt(name, call):
        try:
            call()
        except (ValueError, TypeError) as err:
            caught[name] = (type(err).__name__, str(err))
        else:
            caught[name] = (None, "no error")

    if rank == 0:
        for name in SETUP_ERRORS:
            attempt(name, _bad_setup(name))
    dist.barrier()
    mesh = build_mesh(2)
    model = parallelize(tiny_model("flux"), mesh=mesh)
    ring_model = parallelize(tiny_model("flux"), mesh=mesh, ring=2, kernel="cuda_flash")
    if rank == 0:
        for name in RUNTIME_ERRORS:
            attempt(name, _runtime_call(name, model, ring_model, mesh))
    dist.barrier()
    return caught


@pytest.fixture(scope="module")
def caught():
    return spawn(_worker, 2, timeout_s=120)[0]


@pytest.mark.parametrize("name", list(SETUP_ERRORS) + list(RUNTIME_ERRORS))
def test_bad_input_is_a_clear_error_before_any_collective(caught, name):
    import re

    kind, message = caught[name]
    assert kind in ("ValueError", "TypeError"), (name, kind, message)
    assert re.search(SETUP_ERRORS.get(name) or RUNTIME_ERRORS[name], message), message


def test_no_process_group_is_a_clear_error():
    from cp_lightning import build_mesh, parallelize
    from cp_lightning.tiny import tiny_model

    with pytest.raises(ValueError, match="init_process_group"):
        parallelize(tiny_model("flux"), cp=2)
    with pytest.raises(ValueError, match="init_process_group"):
        build_mesh(2)


@pytest.mark.parametrize("cp", [0, -2, 2.0, True])
def test_degrees_must_be_positive_ints(cp):
    from cp_lightning.mesh import validate_degrees

    with pytest.raises((ValueError, TypeError), match="cp must be"):
        validate_degrees(cp, 1, 4)


def test_usp_needs_a_head_per_ulysses_rank():
    from cp_lightning.routing import check_processors
    from cp_lightning.tiny import tiny_model

    # cp=4 with ring=2 leaves a Ulysses degree of 2: one head cannot be shared by two ranks
    with pytest.raises(ValueError, match="1 attention heads, fewer than the Ulysses degree 2"):
        check_processors(tiny_model("flux", heads=1), 2)
    check_processors(tiny_model("flux", heads=3), 2)  # 3 heads over 2 ranks: 2 + 1, exact
    check_processors(tiny_model("flux", heads=1), 1)  # pure ring (ulysses degree 1) takes any head count

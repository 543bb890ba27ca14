"""The head_tail token layout for whole models: ``parallelize(model, ..., layout="head_tail")`` (issue 45).

SkyReels-V2 diffusion forcing (the library cases ``skyreels-v2-df-block2`` / ``-block3``) with its split hooks
cutting the video tokens, their RoPE rows and the per-token modulation into each rank's head and tail runs, and
its gather putting them back in order, in one spawned group of 4 processes:

* exact: ring at cp 2 and 4 and USP 2x2 equal one process (diffusers' own dense-mask forward), outputs and the
  summed gradients, with and without activation checkpointing;
* balanced: the mask area the ranks' attention executes (every piece ``masked_cp.attend`` runs, counted while
  the model runs) is within 2% of the mean where the layout cuts whole frames, and below a contiguous split's
  on every row;
* refused before any collective: models and plans the layout does not cover, loss_parallel, an unknown layout,
  dynamic CP's regrouping, a sequence too short for 2 runs per rank.
"""

from __future__ import annotations

import pytest
import torch

from cp_lightning.check import GRAD_TOL, OUT_TOL
from tests.conftest import module_selected, selected
from tests.distributed import spawn

# (library case, tokens, cp, ring, activation checkpointing)
ROWS = [
    ("skyreels-v2-df-block2", 30, 2, 2, False),  # 10 frames of 3 tokens: runs of 3, 2 frames (15 tokens a rank)
    ("skyreels-v2-df-block2", 30, 2, 2, True),
    ("skyreels-v2-df-block2", 30, 4, 4, False),  # 10 frames over 8 runs: cut at tokens, 7 / 7 / 8 / 8
    ("skyreels-v2-df-block2", 30, 4, 4, True),
    ("skyreels-v2-df-block2", 30, 4, 2, False),  # USP 2x2
    ("skyreels-v2-df-block2", 48, 4, 4, False),  # 16 frames: 8 runs of 2 whole frames, one causal block each
    ("skyreels-v2-df-block2", 48, 4, 2, True),
    ("skyreels-v2-df-block3", 21, 2, 2, False),  # 21 frames of 1 token, blocks of 3
    ("skyreels-v2-df-block3", 21, 4, 4, True),
    ("skyreels-v2-df-block3", 21, 4, 2, False),
    ("skyreels-v2-df-block2", 30, 4, 1, False),  # Ulysses: the layout only reorders (balanced either way)
]
FAST = {0, 8}  # rows in the edit-test loop; the rest run with the full suite
PARAMS = [pytest.param(row, marks=() if i in FAST else pytest.mark.slow) for i, row in enumerate(ROWS)]
IDS = [f"{case[len('skyreels-v2-df-'):]}-{tokens}tok-cp{cp}-ring{ring}{'-ckpt' if ckpt else ''}"
       for case, tokens, cp, ring, ckpt in ROWS]  # fmt: skip
WHOLE_FRAMES = {row for row in ROWS if row[1] == 48}  # head_tail cuts whole causal blocks: balanced exactly


def _counting_pieces():
    """Wrap the pieces masked_cp.attend runs with a counter of their executed area (this rank's work)."""
    from cp_lightning import masked_cp
    from cp_lightning.mask_layout import executed_area

    counted = {"area": 0, "layouts": set()}
    inner = masked_cp.pieces

    def pieces(spec, q_runs, k_runs, *args):
        found = inner(spec, q_runs, k_runs, *args)
        counted["area"] += executed_area(found)
        return found

    masked_cp.pieces = pieces
    return counted, lambda: setattr(masked_cp, "pieces", inner)


def _parity(meshes, row) -> dict:
    import copy

    import torch.distributed as dist

    from cp_lightning import parallelize, remove
    from cp_lightning.check import resolve_case
    from cp_lightning.mask_layout import Layout, balance, ring_areas
    from cp_lightning.masks import block_causal
    from cp_lightning.mesh import cp_groups
    from cp_lightning.parity import Reference, forward_backward, grad_errors, grads
    from cp_lightning.tiny import checkpoint
    from tests.distributed import sum_over

    name, tokens, cp, ring, ckpt = row
    ref = Reference(resolve_case(name), tokens, ckpt=ckpt)
    mesh = meshes[cp]
    group = cp_groups(mesh, ring).cp
    models = copy.deepcopy(ref.pristine)
    for model in models:
        if ckpt:
            model.enable_gradient_checkpointing(checkpoint)
        parallelize(model, mesh=mesh, ring=ring, layout="head_tail")
    counted, restore = _counting_pieces()
    try:
        outs = forward_backward(models, ref.inputs)
        layout = models[0]._cp_lightning_state.split.layout
    finally:
        restore()
        for model in models:
            remove(model)
    got = grads(models)
    sum_over(got.values(), group)
    areas = [torch.zeros(1, dtype=torch.float64) for _ in range(cp)]
    dist.all_gather(areas, torch.tensor([float(counted["area"])], dtype=torch.float64), group=group)
    frame_tokens = 3 if name.endswith("block2") else 1  # the cases' frames (wan.py)
    spec = block_causal(tokens // frame_tokens, frame_tokens, models[0].config.num_frame_per_block)
    contiguous = ring_areas(spec, Layout.contiguous(tokens, cp), ring)
    return {
        "out_err": max((o - r).abs().max().item() for o, r in zip(outs, ref.outs, strict=True)),
        "grad_err": max(grad_errors(got, ref.grads).values()),
        "silent": ref.silent,
        "layout": (layout.name, layout.runs),
        "balance": balance([int(a.item()) for a in areas]),
        "contiguous balance": balance([sum(steps) for steps in contiguous]),
    }


def _refusals(meshes) -> dict:
    """Each refusal's message (None: not refused), every rank alike; the group communicates afterwards, so a rank
    that entered a collective alone would hang the test."""
    import copy

    from cp_lightning import parallelize, remove
    from cp_lightning.check import resolve_case
    from cp_lightning.models import plan_for
    from cp_lightning.parallelize import set_groups
    from cp_lightning.parity import build, make_inputs
    from cp_lightning.plan import JointInput

    mesh = meshes[4]
    skyreels = build(resolve_case("skyreels-v2-df-block2"))[0]
    wan = build(resolve_case("wan2.1"))[0]
    plan = plan_for(skyreels)
    joint = {**plan, "blocks.0": {**plan["blocks.0"], "encoder_hidden_states": JointInput(1, 3, segments=("x",))}}

    def attempt(fn):
        try:
            fn()
        except ValueError as err:
            return str(err)
        return None

    def parallelized(model, **kwargs):
        model = copy.deepcopy(model)
        try:
            parallelize(model, mesh=mesh, ring=4, **kwargs)
        finally:
            if getattr(model, "_cp_lightning_state", None) is not None:
                remove(model)

    out = {
        "wan": attempt(lambda: parallelized(wan, layout="head_tail")),
        "plan by hand": attempt(lambda: parallelized(skyreels, layout="head_tail", plan=plan)),
        "joint": attempt(lambda: parallelized(skyreels, layout="head_tail", plan=joint)),
        "loss_parallel": attempt(lambda: parallelized(skyreels, layout="head_tail", loss_parallel=True)),
        "unknown": attempt(lambda: parallelized(skyreels, layout="zigzag")),
        "contiguous": attempt(lambda: parallelized(wan, layout="contiguous")),  # the default, any model
    }
    model = copy.deepcopy(skyreels)
    parallelize(model, mesh=mesh, ring=4, layout="head_tail")
    groups = model._cp_lightning_state.groups
    out["dynamic"] = attempt(lambda: set_groups(model, groups))
    # 2 frames of 3 tokens: 6 tokens cannot make 8 runs
    inputs = make_inputs(resolve_case("skyreels-v2-df-block2"), [model], 6)[0]
    out["too short"] = attempt(lambda: model(**inputs))
    remove(model)
    return out


def _group(rank, world, rows, refusals):
    from cp_lightning import build_mesh
    from cp_lightning.mesh import cp_groups

    meshes = {2: build_mesh(2), 4: build_mesh(4)}
    for cp, ring in ((2, 2), (4, 4), (4, 2), (4, 1)):  # the ring's groups, created collectively up front
        cp_groups(meshes[cp], ring)
    results = {row: _parity(meshes, row) for row in rows}
    if refusals:
        results["refusals"] = _refusals(meshes)
        import torch.distributed as dist

        dist.barrier()  # every rank left the refusals without communicating
    return results


@pytest.fixture(scope="module")
def results(request):
    refusals = module_selected(request, "test_head_tail_refusals")
    return spawn(_group, 4, selected(request, "row"), refusals, timeout_s=900)


@pytest.mark.parametrize("row", PARAMS, ids=IDS)
def test_head_tail_model_equals_one_process_and_balances(results, row):
    for rank in results:
        r = rank[row]
        assert r["out_err"] <= OUT_TOL and r["grad_err"] <= GRAD_TOL and not r["silent"], r
        assert r["layout"][0] == "head_tail", r
        if row[3] == 1:
            assert r["balance"] == r["contiguous balance"] == 1.0, r
        else:
            assert r["balance"] < r["contiguous balance"], r
        if row in WHOLE_FRAMES:
            assert all(lo % 3 == 0 and hi % 3 == 0 for runs in r["layout"][1] for lo, hi in runs), r
            assert r["balance"] <= 1.02 and r["contiguous balance"] >= 1.4, r


def test_head_tail_refusals(results):
    for rank in results:
        r = rank["refusals"]
        assert r["contiguous"] is None, r
        assert "plan-library entry" in r["wan"] and "SkyReels-V2" in r["wan"], r
        assert "plan passed by hand" in r["plan by hand"], r
        assert "JointInput" in r["joint"], r
        assert "loss_parallel" in r["loss_parallel"], r
        assert "'zigzag'" in r["unknown"], r
        assert "dynamic CP" in r["dynamic"], r
        assert "at least 8 tokens" in r["too short"], r


def test_the_strategies_take_the_layout_and_refuse_what_it_cannot_follow():
    """``layout=`` on the Lightning and Fabric strategies: checked at construction (no process group exists here)."""
    from cp_lightning import ContextParallelStrategy
    from cp_lightning.fabric import FabricContextParallelStrategy

    assert ContextParallelStrategy(cp=2, ring=2, layout="head_tail").layout == "head_tail"
    assert ContextParallelStrategy(cp=2).layout == "contiguous"
    assert FabricContextParallelStrategy(cp=2, layout="head_tail").layout == "head_tail"
    with pytest.raises(ValueError, match="layout must be 'contiguous' or 'head_tail', got 'zigzag'"):
        ContextParallelStrategy(cp=2, layout="zigzag")
    with pytest.raises(ValueError, match="loss_parallel"):
        ContextParallelStrategy(cp=2, layout="head_tail", loss_parallel=True)
    with pytest.raises(ValueError, match="dynamic_cp cannot be combined with layout='head_tail'"):
        ContextParallelStrategy(cp=2, layout="head_tail", dynamic_cp=True)

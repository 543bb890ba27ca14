"""The gathers' gradient rule (gradients.py) on plans that are not terminal, against one process.

Two plan shapes the free slice gets wrong (measured 2x on Flux's proj_out at cp=2): parameters
after the gather (Flux gathered after its last single block, so ``norm_out``/``proj_out`` run on
gathered tokens) and a gather followed by a re-split (Flux gathered after the first block's
attention, Wan after ``blocks.0.attn1``, so the rest of that block runs replicated, then split
again). Each runs in Ulysses, ring and USP, at lengths cp does not divide, with gradient
checkpointing and (Flux) in loss-parallel mode, all in one spawned group of 4.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from tests.distributed import spawn, sum_over

FLUX_ROOT = {
    "": {
        "hidden_states": In(split_dim=1, expected_dims=3),
        "encoder_hidden_states": In(split_dim=1, expected_dims=3),
        "img_ids": In(split_dim=0, expected_dims=2),
        "txt_ids": In(split_dim=0, expected_dims=2),
    }
}
ROPE = In(split_dim=1, expected_dims=4)
PLANS = {
    # parameters after the gather: norm_out / proj_out run on the gathered tokens
    "flux-after": {**FLUX_ROOT, "single_transformer_blocks.0": [None, Out(gather_dim=1, expected_dims=3)]},
    # blocks.1 runs replicated on the gathered tokens (its parameters too), blocks.2 is split again
    "wan-resplit": {
        "blocks.0": {"hidden_states": In(split_dim=1, expected_dims=3), "rotary_emb": [ROPE, ROPE]},
        "blocks.0.block": Out(gather_dim=1, expected_dims=3),
        "blocks.2": {"hidden_states": In(split_dim=1, expected_dims=3), "rotary_emb": [ROPE, ROPE]},
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
}
# (plan, cp, ring, tokens, text tokens, checkpointing, loss-parallel)
CASES = [
    (plan, cp, ring, tokens, 8, False, False)
    for plan in PLANS
    for cp, ring, tokens in [(2, 1, 24), (4, 1, 24), (4, 4, 24), (4, 2, 24), (4, 1, 30), (4, 4, 30)]
] + [
    ("flux-after", 4, 2, 24, 8, True, False),
    ("wan-resplit", 4, 4, 30, 8, True, False),
    ("wan-resplit", 4, 2, 24, 8, True, False),
    ("flux-after", 2, 1, 24, 8, False, True),
    ("flux-after", 4, 2, 30, 13, False, True),
]
OUT_TOL, GRAD_TOL = 1e-5, 1e-4


class Wrap(torch.nn.Module):
    """A block inside a wrapper, so that one module splits its inputs and the inner one gathers."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
        return self.block(hidden_states, encoder_hidden_states, temb, rotary_emb)


def _id(case):
    plan, cp, ring, tokens, _text, ckpt, lp = case
    mode = "ulysses" if ring == 1 else ("ring" if ring == cp else f"usp-r{ring}")
    return f"{plan}-cp{cp}-{mode}-s{tokens}" + ("-ckpt" if ckpt else "") + ("-lp" if lp else "")


def _rel(got, ref):
    scale = ref.abs().max().item()
    err = (got - ref).abs().max().item()
    return err / scale if scale > 1e-8 else err


def _loss(out, target):
    return F.mse_loss(out, target)


def _run(case, meshes):
    from cp_lightning import parallelize, remove
    from cp_lightning.parallelize import loss_shard
    from cp_lightning.tiny import tiny_inputs, tiny_model

    plan, cp, ring, tokens, text, ckpt, lp = case
    family = plan.split("-")[0]
    torch.manual_seed(0)
    reference = tiny_model(family)
    if plan == "wan-resplit":  # three blocks: split, replicated, split again
        reference = type(reference).from_config({**reference.config, "num_layers": 3})
        reference.blocks[0] = Wrap(reference.blocks[0])
    with torch.no_grad():  # zero-initialised output layers would hide their gradients' errors
        for p in reference.parameters():
            if not p.abs().any():
                p.normal_(0, 0.1)
    if ckpt:
        reference.enable_gradient_checkpointing()
    model = copy.deepcopy(reference)
    inputs = tiny_inputs(family, reference, tokens=tokens, text_tokens=text)
    ref_out = reference(**inputs, return_dict=False)[0]
    target = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(3))
    _loss(ref_out, target).backward()

    parallelize(model, mesh=meshes[cp], ring=ring, plan=PLANS[plan], loss_parallel=lp)
    out = model(**inputs, return_dict=False)[0]
    _loss(out, loss_shard(target, model)).backward()
    group = meshes[cp]["cp"].get_group()
    errs = {}
    got = {name: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for name, p in model.named_parameters()}
    sum_over(got.values(), group)  # SUM over cp (loss-parallel: DDP's MEAN over cp)
    for name, p in model.named_parameters():
        g = got[name]
        ref = dict(reference.named_parameters())[name].grad
        errs[name] = _rel(g / cp if lp else g, ref if ref is not None else torch.zeros_like(p))
    if lp:
        out = torch.cat([part for part in _gather_all(out, group)], dim=1)
    remove(model)
    worst = max(errs, key=errs.get)
    return {"out_err": (out - ref_out).abs().max().item(), "grad_err": errs[worst], "worst": worst}


def _gather_all(x, group):
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([x.shape[1]]), group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.cat([x.detach(), x.new_zeros(x.shape[0], longest - x.shape[1], *x.shape[2:])], dim=1)
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return [part[:, : int(s)] for part, s in zip(parts, sizes, strict=True)]


def _free_slice_cases(meshes):
    """diffusers' own Flux and Wan plans gather once, terminally: the free slice stays (no extra bytes)."""
    from cp_lightning import collectives, parallelize, remove
    from cp_lightning.parallelize import parallel_state
    from cp_lightning.tiny import tiny_inputs, tiny_model

    out = {}
    for family in ("flux", "wan"):
        model = tiny_model(family)
        parallelize(model, mesh=meshes[4], ring=2)
        inputs = tiny_inputs(family, model, tokens=30, text_tokens=13)
        with collectives.count_bytes() as sent:
            model(**inputs, return_dict=False)[0].square().mean().backward()
        out[family] = {"free": parallel_state(model).split.record.free, "kinds": sorted(sent)}
        remove(model)
    model = tiny_model("flux")
    parallelize(model, mesh=meshes[4], plan=PLANS["flux-after"])
    with collectives.count_bytes() as sent:
        model(**tiny_inputs("flux", model, tokens=24), return_dict=False)[0].square().mean().backward()
    out["flux-after"] = {"free": parallel_state(model).split.record.free, "kinds": sorted(sent)}
    return out


class Toy(torch.nn.Module):
    """Split, gather, a token-mixing layer with parameters on the gathered tokens, split again."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(3, 3)
        self.gathered = torch.nn.Identity()  # the gather point after `first`
        self.mix, self.second, self.proj_out = (torch.nn.Linear(3, 3) for _ in range(3))

    def forward(self, x):
        x = self.gathered(self.first(x))
        x = self.mix(x.cumsum(dim=1) / x.shape[1])  # every token depends on the ones before it
        return self.proj_out(self.second(x))


TOY_PLAN = {
    "first": {"input": In(split_dim=1, expected_dims=3)},
    "gathered": Out(gather_dim=1, expected_dims=3),
    "second": {"input": In(split_dim=1, expected_dims=3)},
    "proj_out": Out(gather_dim=1, expected_dims=3),
}
TOY_CASES = [(tokens, lp) for tokens in (8, 10) for lp in (False, True)]


def _toy(tokens, lp):
    from cp_lightning.collectives import shard
    from cp_lightning.plan import apply_plan, remove_plan, resolve_plan

    group, world = dist.group.WORLD, dist.get_world_size()
    torch.manual_seed(0)
    reference = Toy()
    model = copy.deepcopy(reference)
    x = torch.randn(2, tokens, 3, generator=torch.Generator().manual_seed(1))
    target = torch.randn(2, tokens, 3, generator=torch.Generator().manual_seed(2))
    F.mse_loss(reference(x), target).backward()
    handles = apply_plan(resolve_plan(model, TOY_PLAN), group, gather=not lp, root=model)
    F.mse_loss(model(x), shard(target, 1, group) if lp else target).backward()
    remove_plan(handles)
    got = [p.grad.clone() for p in model.parameters()]
    sum_over(got, group)
    errs = []
    for g, ref in zip(got, reference.parameters(), strict=True):
        errs.append(_rel(g / world if lp else g, ref.grad))
    return max(errs)


def _misordered_toy():
    """Loss-parallel predicts the terminal gather from module order; a wrong guess is a clear error."""
    from cp_lightning.plan import apply_plan, remove_plan, resolve_plan

    model = Toy()
    model.gathered = model._modules.pop("gathered")  # registered last: looks like the final gather
    handles = apply_plan(resolve_plan(model, TOY_PLAN), dist.group.WORLD, gather=False, root=model)
    try:
        model(torch.randn(2, 8, 3))
    except ValueError as err:
        return str(err)
    finally:
        remove_plan(handles)
    return "no error"


def _worker(rank, world):
    from cp_lightning import build_mesh

    meshes = {cp: build_mesh(cp) for cp in (2, 4)}
    results = {case: _run(case, meshes) for case in CASES}
    results["toy"] = {case: _toy(*case) for case in TOY_CASES}
    results["misordered"] = _misordered_toy()
    try:
        results["free"] = _free_slice_cases(meshes)
    except (AttributeError, TypeError) as err:  # an engine without the rule (checked once against main)
        results["free"] = repr(err)
    return results


@pytest.fixture(scope="module")
def results():
    per_rank = spawn(_worker, 4)
    merged = {}
    for case in CASES:
        merged[case] = dict(per_rank[0][case])
        for key in ("out_err", "grad_err"):
            merged[case][key] = max(r[case][key] for r in per_rank)
    merged["free"] = per_rank[0]["free"]
    merged["misordered"] = per_rank[0]["misordered"]
    merged["toy"] = {case: max(r["toy"][case] for r in per_rank) for case in TOY_CASES}
    return merged


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_non_terminal_gathers_are_exact(results, case):
    r = results[case]
    assert r["out_err"] <= OUT_TOL, r
    assert r["grad_err"] <= GRAD_TOL, r


def test_terminal_gathers_keep_the_free_slice(results):
    free = results["free"]
    for family in ("flux", "wan"):
        assert free[family]["free"] is True, free
        assert "reduce_scatter" not in free[family]["kinds"], free
    # parameters after the gather: the general rule, with its reduce-scatter
    assert free["flux-after"]["free"] is False, free
    assert "reduce_scatter" in free["flux-after"]["kinds"], free


@pytest.mark.parametrize("case", TOY_CASES, ids=[f"s{t}" + ("-lp" if lp else "") for t, lp in TOY_CASES])
def test_token_mixing_between_gather_and_resplit_is_exact(results, case):
    # loss-parallel keeps the last gather sharded but must still run (and reduce-scatter) the first
    assert results["toy"][case] <= GRAD_TOL, results["toy"]


def test_loss_parallel_names_a_gather_it_wrongly_left_sharded(results):
    assert "split after the gather at 'gathered'" in results["misordered"], results["misordered"]

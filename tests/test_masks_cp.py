"""``cp_attention(..., mask=spec)`` at cp 2, 3, 4 in Ulysses, ring and USP 2x2, both layouts, against one process.

Every case of the grid (tests/test_masks.py: the specs, uneven frames and head counts), the causality probe and
the refusals run in one worker group per world size (cp 2 inside the group of 4 when both run), which computes
only what this run selected (tests.conftest.selected) and returns error figures; each rank compares its own
layout shard of the output and of the input gradients with the one-process reference's (fp64 SDPA math with the
spec's dense mask). Tolerances: fp64 1e-12; fp32 outputs 1e-5, gradients 1e-4 (relative to the largest
reference value).
"""

from __future__ import annotations

import pytest
import torch

from cp_lightning import masks as M
from cp_lightning.mask_layout import Layout
from tests.conftest import selected
from tests.distributed import spawn
from tests.test_masks import SPECS, TOL, layout_of, reference

MODES = [(2, 1), (2, 2), (3, 1), (3, 3), (4, 1), (4, 4), (4, 2)]  # (cp, ring): Ulysses, ring, USP 2x2 at 4
# the rows every run computes; the rest of the grid is marked slow
QUICK = {
    (2, 1, "contiguous", "block5", "float64"),
    (2, 2, "head_tail", "qwen", "float64"),
    (3, 1, "head_tail", "teacher", "float64"),
    (3, 3, "head_tail", "documents", "float64"),
    (4, 1, "head_tail", "prefix_only", "float64"),
    (4, 4, "head_tail", "block5", "float64"),
    (4, 2, "head_tail", "block2", "float64"),
    (4, 2, "contiguous", "qwen", "float32"),
}
CP_CASES = [
    (world, ring, layout, name, dtype)
    for world, ring in MODES
    for layout in ("contiguous", "head_tail")
    for name in SPECS
    for dtype in ("float64", "float32")
    if dtype == "float64" or name in ("block5", "qwen")
]
# causality probes: (cp, ring, layout)
PROBES = [(2, 1, "head_tail"), (2, 2, "head_tail"), (4, 1, "contiguous"), (4, 4, "head_tail"), (4, 2, "head_tail")]


def heads_for(world: int, ring: int) -> int:
    """One head more than the Ulysses degree: uneven head groups wherever Ulysses runs."""
    ulysses = world // ring
    return ulysses + 1 if ulysses > 1 else 2


def _cp_run(spec, layout, groups, q, k, v, dout, dtype):
    """This rank's (out, dq, dk, dv) of cp_attention over its layout shard of the full (B, S, H, D) tensors."""
    import torch.distributed as dist

    from cp_lightning.attention import cp_attention

    rank = dist.get_rank(groups.cp)
    leaves = [layout.shard(t, 1, rank).to(dtype).requires_grad_() for t in (q, k, v)]
    out = cp_attention(*leaves, groups=groups, mask=spec, layout=layout)
    out.backward(layout.shard(dout, 1, rank).to(dtype))
    return [out.detach(), *(t.grad for t in leaves)]


def _inputs(spec, heads, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, spec.length, heads, 4, generator=g, dtype=torch.float64) for _ in range(4)]  # B, S, H, D


def _cp_case(case, groups):
    """Relative errors (out, dq, dk, dv) of this rank's shard against the one-process reference's."""
    import torch.distributed as dist

    world, ring, layout_name, name, dtype = case
    spec = SPECS[name]()
    q, k, v, dout = _inputs(spec, heads_for(world, ring))
    # B, S, H, D -> B, H, S, D for the reference and back
    ref = [t.transpose(1, 2) for t in reference(spec, *(t.transpose(1, 2) for t in (q, k, v, dout)))]
    layout = layout_of(layout_name, spec.length, world)
    got = _cp_run(spec, layout, groups, q, k, v, dout, getattr(torch, dtype))
    rank = dist.get_rank(groups.cp)
    return [
        ((a.double() - layout.shard(r, 1, rank)).abs().max() / r.abs().max()).item()
        for a, r in zip(got, ref, strict=True)
    ]


def _probe(probe, groups):
    """Perturb the last block's q, k, v: every earlier output and the gradients of the earlier outputs' loss
    must stay bitwise equal (and be exactly 0 at the last block's inputs); the last block's outputs change."""
    import torch.distributed as dist

    world, ring, layout_name = probe
    spec = SPECS["block5"]()
    last = spec.slices[-1].q_lo  # the tail block (one frame)
    q, k, v, dout = _inputs(spec, heads_for(world, ring))
    dout[:, last:] = 0  # the loss covers the earlier blocks only
    layout = layout_of(layout_name, spec.length, world)
    rank = dist.get_rank(groups.cp)
    base = _cp_run(spec, layout, groups, q, k, v, dout, torch.float64)
    q, k, v = (t.clone() for t in (q, k, v))
    for t in (q, k, v):
        t[:, last:] += 1.0
    moved = _cp_run(spec, layout, groups, q, k, v, dout, torch.float64)
    is_last = layout.shard(torch.arange(spec.length) >= last, 0, rank)
    early = [torch.equal(a[:, ~is_last], b[:, ~is_last]) for a, b in zip(base, moved, strict=True)]
    zero_grads = all(not t[:, is_last].any() for t in base[1:] + moved[1:])
    changed = not is_last.any() or not torch.equal(base[0][:, is_last], moved[0][:, is_last])
    return {"early_equal": all(early), "last_grads_zero": zero_grads, "last_changed": changed}


def _bad_inputs(groups):
    """Each refusal on every rank, with no byte sent; the group stays in step (the cases after it run)."""
    import torch.distributed as dist

    from cp_lightning.attention import ContextParallelAttention, cp_attention
    from cp_lightning.collectives import count_bytes

    world, rank = groups.cp_size, dist.get_rank(groups.cp)
    spec = M.block_causal(2 * world, 2, 2)
    x = torch.randn(1, 4, world, 4)  # 4 tokens a rank: the spec has 4 * world
    longer = M.block_causal(2 * world + 1, 2, 2)
    calls = {
        "token_count": lambda: cp_attention(x, x, x, groups=groups, mask=longer, even=True),
        "layout_length": lambda: cp_attention(x, x, x, groups=groups, mask=spec, layout=Layout.contiguous(9, world)),
        "spec_and_tensor": lambda: cp_attention(x, x, x, groups=groups, mask=spec, attn_mask=torch.ones(1, 1, 1, 4)),
        "routed_token_count": lambda: ContextParallelAttention(groups)(x, x, x, attn_mask=longer, where="blocks.0"),
    }
    refused = {}
    for name, call in calls.items():
        with count_bytes() as sent:
            try:
                call()
                refused[name] = "not refused"
            except ValueError as err:
                refused[name] = str(err)
        refused[name + "_bytes"] = sum(sent.values())
    # the routed call (a processor handing the spec as attn_mask) is cp_attention's, bitwise
    y = torch.randn(1, 4 * world, world + 1, 4, generator=torch.Generator().manual_seed(1))
    local = Layout.contiguous(4 * world, world).shard(y, 1, rank)
    routed = ContextParallelAttention(groups)(local, local, local, attn_mask=spec)
    refused["routed_equal"] = torch.equal(routed, cp_attention(local, local, local, groups=groups, mask=spec))
    return refused


def _worker(rank, world, jobs):
    """``jobs``: cp degree -> (cases, probes) this group computes, each with the refusals; a cp of 2 in a group of
    4 runs as dp 2 x cp 2 (one group start saved), every dp replica computing the same."""
    import warnings

    from cp_lightning import build_mesh
    from cp_lightning.mesh import cp_groups

    # tiny specs idle in rings; the warning has its own test
    warnings.filterwarnings("ignore", message="ring attention under this mask")
    groups = {}
    for cp, (cases, probes) in sorted(jobs.items()):
        mesh = build_mesh(cp)
        for ring in sorted({1} | {case[1] for case in cases} | {probe[1] for probe in probes}):
            groups[cp, ring] = cp_groups(mesh, ring)  # created collectively, up front, only those needed
    results = {}
    for cp, (cases, probes) in sorted(jobs.items()):
        results["bad", cp] = _bad_inputs(groups[cp, 1])
        results.update({case: _cp_case(case, groups[cp, case[1]]) for case in cases})
        results.update({probe: _probe(probe, groups[cp, probe[1]]) for probe in probes})
    return results


@pytest.fixture(scope="module")
def per_world(request):
    """The process cases, probes and refusals this run selected, in one worker group per world size (cp 2
    inside the group of 4 when both run); cp degree -> every rank's results."""
    cases, probes = selected(request, "case"), selected(request, "probe")
    degrees = {c[0] for c in cases} | {p[0] for p in probes} | set(selected(request, "world"))
    jobs = {cp: ([c for c in cases if c[0] == cp], [p for p in probes if p[0] == cp]) for cp in degrees}
    worlds = {4 if cp == 2 and 4 in degrees else cp: None for cp in degrees}
    by_world = {
        world: spawn(_worker, world, {cp: job for cp, job in jobs.items() if cp == world or (world, cp) == (4, 2)})
        for world in worlds
    }
    return {cp: by_world[4 if cp == 2 and 4 in degrees else cp] for cp in degrees}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=[] if c in QUICK else [pytest.mark.slow], id="cp{}-ring{}-{}-{}-{}".format(*c))
        for c in CP_CASES
    ],
)
def test_cp_attention_with_a_mask_spec_matches_one_process(per_world, case):
    out_tol, grad_tol = TOL[case[4]]
    for rank, result in enumerate(per_world[case[0]]):
        out_err, *grad_errs = result[case]
        assert out_err <= out_tol and max(grad_errs) <= grad_tol, (rank, out_err, grad_errs)


@pytest.mark.parametrize("probe", PROBES, ids=["cp{}-ring{}-{}".format(*p) for p in PROBES])
def test_perturbing_the_last_block_changes_nothing_before_it(per_world, probe):
    for rank, result in enumerate(per_world[probe[0]]):
        assert all(result[probe].values()), (rank, result[probe])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bad_input_is_refused_on_every_rank_before_any_collective(per_world, world):
    for rank, result in enumerate(per_world[world]):
        bad = result["bad", world]
        assert "the sequence has" in bad["token_count"], bad
        assert "but the layout" in bad["layout_length"], bad
        assert "not both" in bad["spec_and_tensor"], bad
        assert bad["routed_token_count"].startswith("blocks.0: "), bad
        assert not any(bad[name] for name in bad if name.endswith("_bytes")), (rank, bad)
        assert bad["routed_equal"], rank

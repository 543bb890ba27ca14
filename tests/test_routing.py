"""Attention routing (routing.py) and mask collapse, against one process.

SD3.5's stock ``JointAttnProcessor2_0`` (SDPA called directly, dual attention, qk norm) routed by
``parallelize`` itself; HunyuanVideo's token refiner (``AttnProcessor2_0``, before the split) found
unsplit and left local; the same refiner with a processor cp_lightning does not know, refused by name
and exact once the plan declares it ``Unsplit``; HunyuanVideo-1.5 and Chroma's (B, 1, S, S)
outer-product masks collapsed to key masks; CogVideoX's stock processor (cp=4 only). One spawned
group of 4 runs every case at 21 tokens (no CP degree divides it): cp=4 Ulysses, ring and USP 2x2,
and cp=2 as dp2 x cp2 (dp rank 0 Ulysses, dp rank 1 ring).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import AttnProcessor2_0

from tests.distributed import spawn, sum_over

CASES = ["sd3.5", "hunyuanvideo", "hunyuanvideo-1.5", "chroma", "hunyuanvideo-declared"]
LAYOUTS = [(2, None), (4, 1), (4, 4), (4, 2)]  # cp=2: Ulysses on dp rank 0, ring on dp rank 1
TOKENS = 21
OUT_TOL, GRAD_TOL = 1e-5, 1e-4
REFINER = "context_embedder.token_refiner.refiner_blocks.0.attn"


class CustomProcessor(AttnProcessor2_0):
    """A processor cp_lightning does not know (its class is not a stock one)."""


def _with_custom_refiner(models):
    for model in models:
        for name, sub in model.named_modules():
            if name.startswith("context_embedder") and hasattr(sub, "processor"):
                sub.set_processor(CustomProcessor())
    return models


def _routes(model):
    from cp_lightning.parallelize import parallel_state

    return {route.name: route.cp for route in parallel_state(model).routes}


def _worker(rank, world):
    import copy

    from cp_lightning import Unsplit, build_mesh, parallelize, remove
    from cp_lightning.check import Reference, run_cp
    from cp_lightning.mesh import cp_groups
    from cp_lightning.models import CASES as LIBRARY
    from cp_lightning.models import plan_for

    meshes = {2: build_mesh(2), 4: build_mesh(4)}
    for cp, ring in [(2, 1), (2, 2), (4, 1), (4, 4), (4, 2)]:
        cp_groups(meshes[cp], ring)  # created collectively up front; the dp groups then diverge
    results = {}
    for name in CASES:
        declared = name == "hunyuanvideo-declared"
        for ckpt in (False, True):
            # checkpointed on both sides: diffusers' checkpointed path may differ from its plain one (Chroma)
            ref = Reference(LIBRARY["hunyuanvideo" if declared else name], TOKENS, ckpt=ckpt)
            plan = None
            if declared:
                ref.pristine = _with_custom_refiner(ref.pristine)
                plan = {**plan_for(ref.pristine[0]), "context_embedder": Unsplit()}
            for cp, ring in LAYOUTS:
                ring = ring or (1 if rank < 2 else 2)
                results[(name, cp, ring if cp == 4 else None, ckpt)] = run_cp(ref, meshes[cp], ring, plan=plan)
    # which modules ran over the CP group in the last forward pass
    ref = Reference(LIBRARY["hunyuanvideo"], TOKENS)
    model = copy.deepcopy(ref.pristine[0])
    parallelize(model, mesh=meshes[4])
    model(**ref.inputs[0])
    results["routes"] = _routes(model)
    remove(model)
    # without the declaration the unknown processor is refused before any collective
    model = _with_custom_refiner([copy.deepcopy(ref.pristine[0])])[0]
    try:
        parallelize(model, mesh=meshes[4])
        results["refused"] = "no error"
    except ValueError as err:
        results["refused"] = str(err)
    results["masks"] = _mask_cases(meshes)
    results["cogvideox"] = {(cp, ring): _cogvideox(meshes[4], ring) for cp, ring in [(4, 1), (4, 4), (4, 2)]}
    return results


def _cogvideox(mesh, ring):
    """CogVideoX's stock CogVideoXAttnProcessor2_0 (joint [text, video] attention, SDPA called directly)."""
    import copy

    from diffusers import CogVideoXTransformer3DModel
    from diffusers.models._modeling_parallel import ContextParallelInput as In
    from diffusers.models._modeling_parallel import ContextParallelOutput as Out

    from cp_lightning import parallelize, remove
    from cp_lightning.check import _wake, rel_err

    torch.manual_seed(0)
    reference = CogVideoXTransformer3DModel(
        num_attention_heads=4,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        sample_width=8,
        sample_height=6,
        sample_frames=5,
        patch_size=2,
        text_embed_dim=16,
        time_embed_dim=8,
        max_text_seq_length=7,
    )
    _wake(reference, 100)
    g = torch.Generator().manual_seed(1)
    inputs = {  # 2 x 3 x 4 = 24 video tokens and 7 text tokens, split apart at the first block
        "hidden_states": torch.randn(2, 2, 4, 6, 8, generator=g),
        "encoder_hidden_states": torch.randn(2, 7, 16, generator=g),
        "timestep": torch.randint(0, 1000, (2,), generator=g),
    }
    plan = {
        "transformer_blocks.0": {
            "hidden_states": In(split_dim=1, expected_dims=3),
            "encoder_hidden_states": In(split_dim=1, expected_dims=3),
        },
        "proj_out": Out(gather_dim=1, expected_dims=3),
    }
    model = copy.deepcopy(reference)
    weights = torch.randn(2, 2, 4, 6, 8, generator=g)
    ref_out = reference(**inputs, return_dict=False)[0]
    (ref_out * weights).sum().backward()
    parallelize(model, mesh=mesh, ring=ring, plan=plan)
    out = model(**inputs, return_dict=False)[0]
    (out * weights).sum().backward()
    remove(model)
    errs = {}
    grads = [p.grad.clone() for p in model.parameters()]
    sum_over(grads, mesh["cp"].get_group())
    for (name, _), ref, grad in zip(model.named_parameters(), reference.parameters(), grads, strict=True):
        # a bias on every key shifts all of a query's logits alike: its true gradient is 0, both runs' noise
        if not name.endswith("norm_k.bias"):
            errs[name] = rel_err(grad, ref.grad)
    return {"out_err": (out - ref_out).abs().max().item(), "grad_err": max(errs.values()), "silent": []}


def _mask_cases(meshes):
    """Outer-product boolean masks through every mode, against SDPA on the full sequence."""
    import torch.distributed as dist

    from cp_lightning.attention import ContextParallelAttention
    from cp_lightning.collectives import shard
    from cp_lightning.mesh import cp_groups

    g = torch.Generator().manual_seed(0)
    b, s, h, d = 2, 21, 4, 8
    q, k, v = (torch.randn(b, s, h, d, generator=g) for _ in range(3))
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[0, 15:] = False
    valid[1, 3:9] = False
    full_mask = valid[:, None, :, None] & valid[:, None, None, :]
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=full_mask).transpose(1, 2)
    errs = {}
    for ring in (1, 2, 4):
        groups = cp_groups(meshes[4], ring)
        group = groups.cp
        lq, lk, lv = (shard(t, 1, group) for t in (q, k, v))
        lvalid = shard(valid, 1, group)
        local_mask = lvalid[:, None, :, None] & lvalid[:, None, None, :]  # what the models build from local tokens
        attention = ContextParallelAttention(groups)
        attention.state.even = False  # 21 tokens over 4 ranks
        out = attention(lq, lk, lv, attn_mask=local_mask)
        errs[ring] = (out - shard(ref, 1, group)).abs().max().item()
        assert dist.get_world_size(group) == 4
    return errs


@pytest.fixture(scope="module")
def results():
    per_rank = spawn(_worker, 4, timeout_s=900)
    merged = {}
    for r in per_rank:
        for case, row in r.items():
            if not isinstance(case, tuple):
                continue
            if case not in merged:
                merged[case] = dict(row)
            else:
                for key in ("out_err", "grad_err"):
                    merged[case][key] = max(merged[case][key], row[key])
    merged["routes"] = per_rank[0]["routes"]
    merged["refused"] = per_rank[0]["refused"]
    for key in per_rank[0]["cogvideox"]:
        rows = [r["cogvideox"][key] for r in per_rank]
        merged[("cogvideox", *key)] = {k: max(row[k] for row in rows) for k in ("out_err", "grad_err")} | {"silent": []}
    merged["masks"] = {ring: max(r["masks"][ring] for r in per_rank) for ring in per_rank[0]["masks"]}
    return merged


PARITY = [(name, cp, ring, ckpt) for name in CASES for cp, ring in LAYOUTS for ckpt in (False, True)]


def _id(case):
    name, cp, ring, ckpt = case
    mode = "ulysses+ring" if ring is None else ("ulysses" if ring == 1 else ("ring" if ring == cp else "usp-r2"))
    return f"{name}-cp{cp}-{mode}" + ("-ckpt" if ckpt else "")


PARITY += [("cogvideox", 4, ring, False) for ring in (1, 4, 2)]


@pytest.mark.parametrize("case", PARITY, ids=[_id(c) for c in PARITY])
def test_parity(results, case):
    row = results[case if case[0] != "cogvideox" else case[:3]]
    assert row["out_err"] <= OUT_TOL, row
    assert row["grad_err"] <= GRAD_TOL, row
    assert not row["silent"], row


def test_the_token_refiner_runs_locally_and_the_blocks_over_cp(results):
    routes = results["routes"]
    refiner = {name: cp for name, cp in routes.items() if name.startswith("context_embedder")}
    blocks = {name: cp for name, cp in routes.items() if "transformer_blocks" in name}
    assert refiner and not any(refiner.values()), routes
    assert blocks and all(blocks.values()), routes


def test_an_unknown_processor_is_refused_by_module_name_before_any_collective(results):
    assert REFINER in results["refused"] and "CustomProcessor" in results["refused"], results["refused"]
    assert "Unsplit()" in results["refused"], results["refused"]


@pytest.mark.parametrize("ring", [1, 2, 4], ids=["ulysses", "usp-r2", "ring"])
def test_outer_product_masks_are_exact_in_every_mode(results, ring):
    assert results["masks"][ring] <= OUT_TOL, results["masks"]


def test_collapse_is_checked_not_assumed():
    from cp_lightning.attention import ContextParallelAttention, collapse_mask

    valid = torch.tensor([[True, True, False, True]])
    outer = valid[:, None, :, None] & valid[:, None, None, :]
    key_mask, rows = collapse_mask(outer, 4, 4)
    assert torch.equal(key_mask, valid[:, None, None, :])
    assert rows.flatten().tolist() == [1.0, 1.0, 0.0, 1.0]
    key_only = valid[:, None, None, :]
    passed, no_rows = collapse_mask(key_only, 4, 4)
    assert passed is key_only and no_rows is None  # key masks pass through
    causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]
    attention = ContextParallelAttention(None)  # refused before it would touch a process group
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="blocks.3.attn: boolean attention mask .* not an outer product"):
        attention(q, q, q, attn_mask=causal, where="blocks.3.attn")
    with pytest.raises(ValueError, match="blocks.3.attn: .* one row per query"):
        attention(q, q, q, attn_mask=outer.float(), where="blocks.3.attn")

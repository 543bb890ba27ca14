"""Linear attention under CP (Sana, Sana-Video): exact at cp=3 on uneven shards, one all-reduce of the state.

tests/test_library.py runs the Sana cases at cp 2 and 4 (Ulysses, ring, USP, with and without
checkpointing); here one spawned group of 3 runs them at a length 3 does not divide, and counts what one
linear attention sends: the all-reduce of its (B, H, D+1, D) state, forward and again backward, nothing else.
"""

from __future__ import annotations

import pytest
import torch

from cp_lightning.check import GRAD_TOL, OUT_TOL
from tests.distributed import spawn, sum_over

P = 3
TOKENS = 20  # 7, 7, 6 tokens per rank
B, S, HEADS, HEAD_DIM = 2, 10, 2, 8
ROWS = [("sana", 1, False), ("sana", 3, True), ("sana-video", 1, True), ("sana-video", 3, False)]


def _attention(video: bool):
    from diffusers.models.attention_processor import Attention, SanaLinearAttnProcessor2_0
    from diffusers.models.transformers.transformer_sana_video import SanaLinearAttnProcessor3_0

    torch.manual_seed(0)
    processor = SanaLinearAttnProcessor3_0() if video else SanaLinearAttnProcessor2_0()
    qk_norm = "rms_norm_across_heads" if video else None
    return Attention(HEADS * HEAD_DIM, heads=HEADS, dim_head=HEAD_DIM, kv_heads=HEADS, qk_norm=qk_norm, bias=True,
                     processor=processor)  # fmt: skip


def _rope(s: int):
    angles = torch.linspace(0, 3, s * HEAD_DIM).reshape(1, s, 1, HEAD_DIM)
    return angles.cos(), angles.sin()


def _run(rank, world):
    from cp_lightning import build_mesh, collectives
    from cp_lightning.check import Reference, grad_errors, run_cp
    from cp_lightning.linear_attention import sana_attention, sana_video_attention
    from cp_lightning.mesh import CP
    from cp_lightning.models import CASES

    mesh = build_mesh(P)
    group = mesh[CP].get_group()
    out = {"bytes": {}, "unit": {}, "parity": {}}
    for video in (False, True):
        attn = _attention(video)
        x = torch.randn(B, S, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(1), requires_grad=True)
        weights = torch.randn(B, S, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(2))
        extra = {"rotary_emb": _rope(S)} if video else {}
        ref = attn(x, **extra)
        (ref * weights).sum().backward()
        ref_grads = {f"0.{n}": p.grad.clone() for n, p in attn.named_parameters()}
        attn.zero_grad()
        sizes = collectives.chunk_sizes(S, P)
        start = sum(sizes[:rank])
        local = collectives.shard(x.detach(), 1, group).requires_grad_()
        with collectives.count_bytes() as fwd:
            if video:
                rope = tuple(t.narrow(1, start, sizes[rank]) for t in _rope(S))
                got = sana_video_attention(attn, local, rope, group)
            else:
                got = sana_attention(attn, local, group)
        with collectives.count_bytes() as bwd:
            (got * weights.narrow(1, start, sizes[rank])).sum().backward()
        grads = {f"0.{n}": p.grad.clone() for n, p in attn.named_parameters()}
        sum_over(grads.values(), group)  # each rank's share of the gradient
        out["unit"][video] = {
            "out_err": (got - ref.narrow(1, start, sizes[rank])).abs().max().item(),
            "input_grad_err": (local.grad - x.grad.narrow(1, start, sizes[rank])).abs().max().item()
            / x.grad.abs().max().item(),
            "grad_err": max(grad_errors(grads, ref_grads).values()),
        }
        out["bytes"][video] = {"forward": dict(fwd), "backward": dict(bwd)}
    for name, ring, ckpt in ROWS:
        ref = Reference(CASES[name], TOKENS, ckpt=ckpt)
        out["parity"][(name, ring, ckpt)] = run_cp(ref, mesh, ring)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_run, P, timeout_s=900)


@pytest.mark.parametrize("video", [False, True], ids=["sana", "sana-video"])
def test_linear_attention_on_uneven_shards_matches_one_process(results, video):
    for rank, result in enumerate(results):
        r = result["unit"][video]
        assert r["out_err"] <= OUT_TOL, (rank, r)
        assert r["input_grad_err"] <= GRAD_TOL and r["grad_err"] <= GRAD_TOL, (rank, r)


@pytest.mark.parametrize("video", [False, True], ids=["sana", "sana-video"])
def test_one_linear_attention_sends_the_all_reduce_of_its_state(results, video):
    # the state: B x H x (D+1) x D fp32 (Sana: values padded with a row of ones; Sana-Video: the key sum as
    # a column), and a ring all-reduce sends 2 (P-1)/P of it; forward, and the same again backward
    state = B * HEADS * (HEAD_DIM + 1) * HEAD_DIM * 4
    want = 2 * state * (P - 1) // P
    for rank, result in enumerate(results):
        sent = result["bytes"][video]
        assert sent["forward"] == {"all_reduce": want}, (rank, sent)
        assert sent["backward"] == {"all_reduce": want}, (rank, sent)


@pytest.mark.parametrize("row", ROWS, ids=[f"{n}-{'ring' if r > 1 else 'ulysses'}{'-ckpt' * c}" for n, r, c in ROWS])
def test_sana_models_are_exact_at_cp3(results, row):
    for rank, result in enumerate(results):
        r = result["parity"][row]
        assert r["out_err"] <= OUT_TOL and r["grad_err"] <= GRAD_TOL and not r["silent"], (rank, r)

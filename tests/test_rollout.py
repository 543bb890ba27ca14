"""KV-cache roll-out under Ulysses (cp_lightning.rollout) against one process.

A 3-chunk roll-out at cp 2 and cp 4 (cp 2 runs as dp 2 x cp 2 inside the group of 4 when both are selected: one
spawned group for every case) against one process in fp64: each chunk attends with SDPA math over the keys of all
chunks so far, masked to the window and sink that the eviction keeps (written here from the positions, not from
the cache code). Chunk lengths that cp does not divide, head counts that Ulysses does not divide, windows and sinks,
a causal mask within the chunk, GQA (with a K/V head on two ranks at cp 4), fp32. Each rank compares its own shard
of every chunk's output and of the last chunk's input gradients, checks that its cache holds exactly its heads and
the kept tokens, and the earlier chunks got no gradient (the cache is detached). Bytes: each chunk's all-to-alls
move the chunk only, however long the cache. Refusals come before any collective (one rank refuses while the
others wait at a barrier, and nothing is sent). Tolerances: fp64 1e-12; fp32 outputs 1e-5, gradients 1e-4
(relative to the largest reference value).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from cp_lightning import masks as M
from cp_lightning.collectives import chunk_sizes
from cp_lightning.masked import local_attention
from cp_lightning.rollout import KVCache, rollout_attention
from tests.conftest import selected
from tests.distributed import spawn
from tests.test_masks import TOL, rel

B, D = 2, 4


@dataclass(frozen=True)
class Variant:
    chunks: tuple[int, ...] = (5, 7, 6)  # lengths cp 2 and cp 4 do not divide
    window: int | None = None
    sink: int = 0
    gqa: bool = False  # 6 query heads over 2 K/V heads; else one head more than cp (uneven head groups)
    causal: bool = False  # a causal mask within each chunk
    even: bool = False  # even=True: every rank holds the same chunk length, nothing exchanged
    dtype: str = "float64"


VARIANTS = {
    "full": Variant(),
    "window": Variant(window=13),  # chunk 3 (tokens 12:18) sees 5:18
    "window_sink": Variant(window=7, sink=2),  # chunk 2 sees 0:2 + 5:12, chunk 3 0:2 + 11:18
    "sink_past_a_chunk": Variant(window=9, sink=7),  # the sink spans chunks 1 and 2; chunk 3 sees 0:7 + 9:18
    "causal_chunk": Variant(window=8, sink=1, causal=True),
    "gqa": Variant(window=7, sink=2, gqa=True),
    "even": Variant(chunks=(8, 8, 8), window=9, sink=2, even=True),
    "fp32": Variant(window=7, sink=2, dtype="float32"),
}
CASES = [(cp, name) for cp in (2, 4) for name in VARIANTS]


def heads_of(variant: Variant, cp: int) -> tuple[int, int]:
    """(query heads, K/V heads)."""
    return (6, 2) if variant.gqa else (cp + 1, cp + 1)


def visible(variant: Variant, start: int, end: int) -> torch.Tensor:
    """(n, end) booleans: the keys the queries of the chunk [start, end) see (the window ends at the chunk's end,
    the sink is the first tokens; a causal chunk mask over the chunk's own keys)."""
    pos = torch.arange(end)
    seen = torch.ones(end, dtype=torch.bool) if variant.window is None else pos >= end - variant.window
    mask = (seen | (pos < variant.sink)).expand(end - start, end).clone()
    if variant.causal:
        mask[:, start:] &= torch.ones(end - start, end - start, dtype=torch.bool).tril()
    return mask


def inputs(variant: Variant, cp: int) -> list[torch.Tensor]:
    """Full (B, S, H, D) q, k, v and the last chunk's output gradient, fp64, the same on every rank."""
    heads, kv = heads_of(variant, cp)
    g = torch.Generator().manual_seed(3)
    total = sum(variant.chunks)
    q = torch.randn(B, total, heads, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, total, kv, D, generator=g, dtype=torch.float64) for _ in range(2))
    return [q, k, v, torch.randn(B, variant.chunks[-1], heads, D, generator=g, dtype=torch.float64)]


def reference(variant: Variant, q, k, v, dout) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One process: every chunk's output, and the last chunk's (dq, dk, dv) with the earlier K/V held fixed."""
    outs, start = [], 0
    for n in variant.chunks:
        end = start + n
        last = end == q.shape[1]
        own = [t[:, start:end].clone().requires_grad_(last) for t in (q, k, v)]
        keys, values = (torch.cat([t[:, :start], o], dim=1) for t, o in ((k, own[1]), (v, own[2])))
        # B, S, H, D -> B, H, S, D for SDPA and back
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            out = F.scaled_dot_product_attention(
                own[0].transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                attn_mask=visible(variant, start, end), enable_gqa=variant.gqa,
            ).transpose(1, 2)  # fmt: skip
        outs.append(out.detach())
        start = end
    out.backward(dout)
    return outs, [t.grad for t in own]


def kept_tokens(variant: Variant) -> int:
    return int(visible(variant, sum(variant.chunks[:-1]), sum(variant.chunks))[-1].sum())


def _case(variant: Variant, groups) -> dict:
    import torch.distributed as dist

    from cp_lightning.collectives import shard

    cp, rank = groups.cp_size, dist.get_rank(groups.cp)
    q, k, v, dout = inputs(variant, cp)
    ref_outs, ref_grads = reference(variant, q, k, v, dout)
    dtype = getattr(torch, variant.dtype)
    cache = KVCache(window_tokens=variant.window, sink_tokens=variant.sink)
    errors, start, leaves = [], 0, []
    for n, ref in zip(variant.chunks, ref_outs, strict=True):
        own = [shard(t[:, start : start + n], 1, groups.cp).to(dtype).clone().requires_grad_() for t in (q, k, v)]
        mask = M.documents([n], causal=True) if variant.causal else None
        out = rollout_attention(*own, cache, groups=groups, mask=mask, enable_gqa=variant.gqa, even=variant.even)
        errors.append(rel(out, shard(ref, 1, groups.cp)))
        leaves.append(own)
        start += n
    out.backward(shard(dout, 1, groups.cp).to(dtype))
    heads, kv = heads_of(variant, cp)
    split = chunk_sizes(heads, cp)
    first, group = sum(split[:rank]), heads // kv
    return {
        "out": max(errors),
        "grads": max(rel(t.grad, shard(r, 1, groups.cp)) for t, r in zip(leaves[-1], ref_grads, strict=True)),
        "earlier_grads": [t.grad is not None for own in leaves[:-1] for t in own],
        # this rank's heads: its query heads' K/V heads (first // g to (first + n - 1) // g under GQA)
        "cache_shape": tuple(cache.key.shape),
        "want_shape": (B, kept_tokens(variant), (first + split[rank] - 1) // group - first // group + 1, D),
        "eviction": (cache.seen, cache.kept(), cache.tokens),
    }


def _bytes(groups) -> dict:
    """Bytes each chunk's forward sends, and the last chunk's backward: the chunk's four all-to-alls only."""
    import torch.distributed as dist

    from cp_lightning.collectives import count_bytes

    cp = groups.cp_size
    g = torch.Generator().manual_seed(dist.get_rank(groups.cp))
    cache = KVCache()
    sent = []
    for _ in range(3):
        q, k, v = (torch.randn(B, 16 // cp, 2 * cp, D, generator=g, requires_grad=True) for _ in range(3))
        with count_bytes() as fwd:
            out = rollout_attention(q, k, v, cache, groups=groups, even=True)
        sent.append(dict(fwd))
    with count_bytes() as bwd:
        out.backward(torch.ones_like(out))
    return {"forward": sent, "backward": dict(bwd), "cache_tokens": cache.tokens, "chunk_bytes": q.numel() * 4}


def _refusals(groups, ring_groups) -> dict:
    """The bad calls, on the last CP rank only (the others wait at the barrier after them): a call that reached a
    collective would wait for ranks that never come. Each message, and the bytes sent (none)."""
    import torch.distributed as dist

    from cp_lightning.collectives import count_bytes

    cp, rank = groups.cp_size, dist.get_rank(groups.cp)
    x = torch.randn(1, 3, cp, D)
    used = KVCache()
    rollout_attention(x, x, x, used, groups=groups, even=True)  # every rank: the cache is built for cp heads
    calls = {f"ring{ring}": lambda g=g: rollout_attention(x, x, x, KVCache(), groups=g) for ring, g in ring_groups}
    calls |= {
        "other_heads": lambda: rollout_attention(*[torch.randn(1, 3, 2 * cp, D)] * 3, used, groups=groups),
        "other_group": lambda: rollout_attention(x, x, x, local, groups=groups),
        "not_a_cache": lambda: rollout_attention(x, x, x, {}, groups=groups),
        "lengths": lambda: rollout_attention(x, x, x, KVCache(), groups=groups, lengths=[4] * cp),
        "window": lambda: rollout_attention(x, x, x, KVCache(window_tokens=5), groups=groups, lengths=[3] * cp),
        "mask_length": lambda: rollout_attention(
            x, x, x, KVCache(), groups=groups, lengths=[3] * cp, mask=M.documents([3 * cp + 1])
        ),
        "keys_length": lambda: rollout_attention(x, torch.randn(1, 2, cp, D), x, KVCache(), groups=groups),
        "few_heads": lambda: rollout_attention(*[torch.randn(1, 3, 1, D)] * 3, KVCache(), groups=groups),
        "kernel": lambda: rollout_attention(x, x, x, KVCache(), groups=groups, kernel="cuda_flash"),
        "gqa_heads": lambda: rollout_attention(
            torch.randn(1, 3, cp + 1, D), *[torch.randn(1, 3, 2, D)] * 2, KVCache(), groups=groups, enable_gqa=True
        ),
    }
    local = KVCache()
    rollout_attention(x, x, x, local, groups=None)  # built for one process
    refused = {}
    if rank == cp - 1:
        for name, call in calls.items():
            with count_bytes() as sent:
                try:
                    call()
                    refused[name] = "not refused"
                except (ValueError, TypeError) as err:
                    refused[name] = f"{type(err).__name__}: {err}"
            refused[name + "_bytes"] = sum(sent.values())
    dist.barrier()
    # a window shorter than the chunk, known only after the lengths exchange: every rank refuses alike
    try:
        rollout_attention(x, x, x, KVCache(window_tokens=3 * cp - 1), groups=groups)
        refused["window_exchanged"] = "not refused"
    except ValueError as err:
        refused["window_exchanged"] = str(err)
    dist.barrier()
    return refused


def _worker(rank, world, jobs):
    """``jobs``: cp degree -> (case names, whether to count bytes, whether to run the refusals)."""
    from cp_lightning import build_mesh
    from cp_lightning.mesh import cp_groups

    made = {}
    for cp, (_, _, refusals) in sorted(jobs.items()):
        mesh = build_mesh(cp)
        rings = sorted({2, cp}) if refusals else []
        made[cp] = cp_groups(mesh, 1), [(ring, cp_groups(mesh, ring)) for ring in rings]  # collectively, up front
    results = {}
    for cp, (names, count, refusals) in sorted(jobs.items()):
        groups, ring_groups = made[cp]
        results |= {(cp, name): _case(VARIANTS[name], groups) for name in names}
        if count:
            results["bytes", cp] = _bytes(groups)
        if refusals:
            results["refused", cp] = _refusals(groups, ring_groups)
    return results


@pytest.fixture(scope="module")
def per_world(request):
    """What this run selected, in one worker group (of 4 when cp 4 runs; cp 2 then runs as dp 2 x cp 2)."""
    cases = selected(request, "case")
    counted, refused = set(selected(request, "bytes_cp")), set(selected(request, "refused_cp"))
    degrees = {cp for cp, _ in cases} | counted | refused
    if not degrees:
        return {}
    jobs = {cp: ([n for c, n in cases if c == cp], cp in counted, cp in refused) for cp in degrees}
    results = spawn(_worker, max(degrees), jobs, timeout_s=120)
    return results


@pytest.mark.parametrize("case", CASES, ids=[f"cp{cp}-{name}" for cp, name in CASES])
def test_a_three_chunk_rollout_matches_one_process(per_world, case):
    out_tol, grad_tol = TOL[VARIANTS[case[1]].dtype]
    evictions = set()
    for rank, result in enumerate(per_world):
        got = result[case]
        assert got["out"] <= out_tol and got["grads"] <= grad_tol, (rank, got)
        assert got["cache_shape"] == got["want_shape"], (rank, got)  # this rank's heads, the kept tokens
        assert not any(got["earlier_grads"]), (rank, got)  # the cache is detached
        evictions.add(got["eviction"])
    assert len(evictions) == 1, evictions  # the same on every rank


@pytest.mark.parametrize("bytes_cp", [2, 4])
def test_each_chunk_sends_only_itself(per_world, bytes_cp):
    u = bytes_cp
    for rank, result in enumerate(per_world):
        got = result["bytes", bytes_cp]
        chunk = 4 * got["chunk_bytes"] * (u - 1) // u  # q, k, v and the output, (u - 1) / u of each
        assert got["cache_tokens"] == 48, got  # the cache grew to 3 chunks
        assert got["forward"] == [{"all_to_all": chunk}] * 3, (rank, got)
        assert got["backward"] == {"all_to_all": chunk}, (rank, got)


@pytest.mark.parametrize("refused_cp", [2, 4])
def test_bad_input_is_refused_before_any_collective(per_world, refused_cp):
    for rank, result in enumerate(per_world):
        bad = result["refused", refused_cp]
        assert "window_tokens=" in bad["window_exchanged"], bad
        if rank % refused_cp != refused_cp - 1:
            continue
        rings = [name for name in bad if name.startswith("ring") and not name.endswith("_bytes")]
        assert rings and all("Ulysses only" in bad[name] and "ring=1" in bad[name] for name in rings), bad
        assert "heads 4 -> 8" in bad["other_heads"] if refused_cp == 4 else "heads 2 -> 4" in bad["other_heads"], bad
        assert "ulysses 1 -> " in bad["other_group"], bad
        assert bad["not_a_cache"].startswith("TypeError: cache must be"), bad
        assert "inconsistent" in bad["lengths"], bad
        assert "window_tokens=5 is shorter" in bad["window"], bad
        assert "the chunk mask covers" in bad["mask_length"], bad
        assert "same batch and local length" in bad["keys_length"], bad
        assert "divide the query heads" in bad["gqa_heads"], bad
        assert "at least one of the 1 attention heads" in bad["few_heads"], bad
        assert "'cuda_flash' runs on" in bad["kernel"], bad
        assert not any(bad[name] for name in bad if name.endswith("_bytes")), (rank, bad)


@pytest.mark.parametrize("gqa", [False, True])
def test_a_rollout_of_blocks_is_block_causal_attention(gqa):
    """One process: chunks of ``frames_per_block`` frames with the window and sink in tokens attend exactly as
    ``block_causal`` over the whole video (the tail block included), the mask a causal student trains with."""
    frames, t, per_block, window, sink = 7, 3, 2, 4, 1
    spec = M.block_causal(frames, t, per_block, window_frames=window, sink_frames=sink)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, frames * t, 4, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, frames * t, 2 if gqa else 4, D, generator=g, dtype=torch.float64) for _ in range(2))
    cache = KVCache(window_tokens=window * t, sink_tokens=sink * t)
    outs = []
    for f in range(0, frames, per_block):
        part = slice(f * t, min(f + per_block, frames) * t)
        outs.append(rollout_attention(q[:, part], k[:, part], v[:, part], cache, groups=None, enable_gqa=gqa))
    assert rel(torch.cat(outs, dim=1), local_attention(q, k, v, spec)) <= 1e-12
    assert cache.kept() == ((0, 3), (9, 21)) and cache.tokens == 15  # the sink frame and the last 4 frames

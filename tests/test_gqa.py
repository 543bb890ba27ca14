"""Grouped-query attention under CP (``enable_gqa=True``: K/V with H_kv heads dividing the H_q query heads).

``cp_attention`` at cp 2 and 4 in Ulysses, ring and USP 2x2, over H_q/H_kv 8/2, 8/4, 4/1 and 6/2 (Ulysses degrees
that do not divide H_kv, H_kv below the degree, query groups straddling two ranks), with no mask, a key-padding mask
and a block-causal mask spec, and the acceptance grid (``GRID``: H_q 6, 8, 12 x every H_kv of 1-4 dividing it x
Ulysses degree 2, 3, 4 in Ulysses, ring and USP), at 15 tokens (no degree divides them), against one-process SDPA
math with ``enable_gqa`` (fp64: 1e-12; fp32: outputs 1e-5, gradients 1e-4, relative to the largest reference
value). A toy module whose processor calls diffusers' dispatcher with ``enable_gqa=True``, parallelized, against the
same module in one process; the bytes GQA saves; the stand-ins that keep Lumina2's, Krea2's and
NucleusMoE's grouped K/V heads (and Cosmos3's), against the stock processors in one process (fp64, 1e-12) and the
ring's K/V bytes under CP against the stock processors' repeated heads; and the refusal of head counts that do not
divide, before any collective. Everything runs in one worker group per world size (each degree inside the largest
selected group it divides, e.g. cp 2 as dp 2 x cp 2 in the group of 4), which computes only what this run selected
(tests.conftest.selected).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.attention_processor import Attention
from torch import nn

from cp_lightning import masks as M
from tests.conftest import selected
from tests.distributed import spawn, sum_over
from tests.test_masks import TOL, layout_of

MODES = [(2, 1), (2, 2), (4, 1), (4, 4), (4, 2)]  # (cp, ring): Ulysses, ring, USP 2x2 at 4
HEADS = [(8, 2), (8, 4), (4, 1), (6, 2)]  # (H_q, H_kv)
MASKS = ["none", "key", "spec"]
TOKENS = 15
CASES = [
    (cp, ring, hq, hkv, mask, dtype)
    for cp, ring in MODES
    for hq, hkv in HEADS
    for mask in MASKS
    for dtype in ("float64", "float32")
    if dtype == "float64" or mask == "none"
]
# the rows every run computes; the rest of the grid is marked slow
QUICK = {
    (2, 1, 8, 2, "key", "float64"),
    (2, 1, 6, 2, "none", "float64"),
    (2, 2, 8, 4, "spec", "float64"),
    (4, 1, 6, 2, "key", "float64"),  # u=4 does not divide H_kv=2: query group 0 straddles ranks 0 and 1
    (4, 1, 4, 1, "spec", "float64"),  # H_kv=1 < u: every rank receives the one K/V head
    (4, 4, 8, 2, "key", "float64"),
    (4, 2, 6, 2, "spec", "float64"),
    (4, 2, 8, 2, "none", "float32"),
}
ROUTED = [(2, 1), (4, 1), (4, 4), (4, 2)]  # the parallelized toy module, H_q/H_kv 6/2
# issue 46's acceptance grid, fp64 without a mask: H_q in {6, 8, 12} x H_kv in {1, 2, 3, 4} dividing it x Ulysses
# degree u in {2, 3, 4}, in Ulysses (cp = u), ring (cp = ring = u) and USP (ring 2 x Ulysses u, cp = 2u); rows CASES
# holds are not repeated. All slow: cp 3 and 6 run in one group of 6 processes, cp 2, 4 and 8 in one of 8
GRID = sorted(
    {
        (cp, ring, hq, hkv, "none", "float64")
        for hq in (6, 8, 12)
        for hkv in (1, 2, 3, 4)
        if hq % hkv == 0
        for u in (2, 3, 4)
        for cp, ring in ((u, 1), (u, u), (2 * u, 2))
    }
    - set(CASES)
)


def _id(case):
    cp, ring, hq, hkv, mask, dtype = case
    mode = "ulysses" if ring == 1 else ("ring" if ring == cp else "usp")
    return f"cp{cp}-{mode}-{hq}q{hkv}kv-{mask}-{dtype}"


# ----- the toy module: a processor that hands diffusers' dispatcher fewer K/V heads with enable_gqa=True ---------


class GQAProcessor:
    """Cosmos3's way: K/V keep their H_kv heads and the dispatcher gets ``enable_gqa=True`` (a dispatch processor:
    routing.py sets ``_parallel_config`` and wraps this module's ``dispatch_attention_fn``)."""

    _parallel_config = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        q = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))  # B, S, H*D -> B, S, H, D
        head_dim = q.shape[-1]
        k, v = (proj(hidden_states).unflatten(-1, (-1, head_dim)) for proj in (attn.to_k, attn.to_v))  # B, S, H_kv, D
        out = dispatch_attention_fn(
            q, k, v, attn_mask=attention_mask, enable_gqa=True, parallel_config=self._parallel_config
        )
        return attn.to_out[0](out.flatten(2))  # B, S, H, D -> B, S, H*D


class Block(nn.Module):
    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        dim = heads * head_dim
        self.attn = Attention(
            dim, heads=heads, kv_heads=kv_heads, dim_head=head_dim, bias=True, processor=GQAProcessor()
        )
        self.mlp = nn.Linear(dim, dim)

    def forward(self, hidden_states):
        x = hidden_states + self.attn(hidden_states)
        return x + self.mlp(x)


class ToyGQA(nn.Module):
    def __init__(self, heads: int = 6, kv_heads: int = 2, head_dim: int = 4, channels: int = 4):
        super().__init__()
        self.proj_in = nn.Linear(channels, heads * head_dim)
        self.blocks = nn.ModuleList([Block(heads, kv_heads, head_dim) for _ in range(2)])
        self.proj_out = nn.Linear(heads * head_dim, channels)

    def forward(self, hidden_states):
        x = self.proj_in(hidden_states)
        for block in self.blocks:
            x = block(x)
        return self.proj_out(x)


def _routed(groups_mesh, ring):
    """Relative errors (output, worst parameter gradient summed over CP) of the parallelized toy module, fp64."""
    import copy

    from diffusers.models._modeling_parallel import ContextParallelInput as In
    from diffusers.models._modeling_parallel import ContextParallelOutput as Out

    from cp_lightning import parallelize, remove

    torch.manual_seed(0)
    reference = ToyGQA().double()
    model = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, TOKENS, 4, generator=g, dtype=torch.float64)
    weights = torch.randn(2, TOKENS, 4, generator=g, dtype=torch.float64)
    ref_out = reference(x)
    (ref_out * weights).sum().backward()
    # split where the tokens enter the first block; gathered after proj_out (nothing runs on replicated tokens)
    plan = {
        "blocks.0": {"hidden_states": In(split_dim=1, expected_dims=3)},
        "proj_out": Out(gather_dim=1, expected_dims=3),
    }
    parallelize(model, mesh=groups_mesh, ring=ring, plan=plan)
    out = model(x)
    (out * weights).sum().backward()
    remove(model)
    grads = [p.grad.clone() for p in model.parameters()]
    sum_over(grads, groups_mesh["cp"].get_group())
    # a bias on every key shifts all of a query's logits alike: its true gradient is 0, both runs' noise
    grad_err = max(
        ((a - p.grad).abs().max() / p.grad.abs().max()).item()
        for (name, _), a, p in zip(model.named_parameters(), grads, reference.parameters(), strict=True)
        if not name.endswith("to_k.bias")
    )
    return ((out - ref_out).abs().max() / ref_out.abs().max()).item(), grad_err


# ----- cp_attention against one process ------------------------------------------------------------------------


def _inputs(hq, hkv, seed=7):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(2, TOKENS, hq, 4, generator=g, dtype=torch.float64) for _ in range(2))  # B, S, H, D
    k, v = (torch.randn(2, TOKENS, hkv, 4, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, dout


def _key_valid():
    valid = torch.ones(2, TOKENS, dtype=torch.bool)
    valid[0, 11:] = False
    valid[1, 2:5] = False
    return valid  # B, S


def _reference(q, k, v, dout, attn_mask):
    """(out, dq, dk, dv) of one-process SDPA math with enable_gqa, fp64, (B, S, H, D) in and out."""
    leaves = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]  # B, S, H, D -> B, H, S, D
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*leaves, attn_mask=attn_mask, enable_gqa=True)
    out.backward(dout.transpose(1, 2))
    return [t.transpose(1, 2) for t in (out.detach(), *(leaf.grad for leaf in leaves))]


def _case(case, groups):
    """Relative errors (out, dq, dk, dv) of this rank's shard against the one-process reference's."""
    import torch.distributed as dist

    from cp_lightning.attention import cp_attention

    cp, ring, hq, hkv, mask, dtype = case
    q, k, v, dout = _inputs(hq, hkv)
    spec = M.block_causal(5, 3, 3) if mask == "spec" else None  # 15 tokens, 2 blocks
    valid = _key_valid()
    dense = {"none": None, "key": valid[:, None, None, :], "spec": None if spec is None else spec.to_dense()}[mask]
    ref = _reference(q, k, v, dout, dense)
    layout = layout_of("head_tail" if mask == "spec" and ring > 1 else "contiguous", TOKENS, cp)
    rank = dist.get_rank(groups.cp)
    leaves = [layout.shard(t, 1, rank).to(getattr(torch, dtype)).requires_grad_() for t in (q, k, v)]
    kwargs = {"mask": spec, "layout": layout} if spec is not None else {}
    if mask == "key":
        kwargs["attn_mask"] = layout.shard(valid, 1, rank)[:, None, None, :]
    out = cp_attention(*leaves, groups=groups, enable_gqa=True, **kwargs)
    out.backward(layout.shard(dout, 1, rank).to(out.dtype))
    got = [out.detach(), *(t.grad for t in leaves)]
    return [
        ((a.double() - layout.shard(r, 1, rank)).abs().max() / r.abs().max()).item()
        for a, r in zip(got, ref, strict=True)
    ]


def _bad_inputs(groups):
    """Head counts that do not divide, refused on every rank with no byte sent (the group stays in step)."""
    from cp_lightning.attention import ContextParallelAttention, cp_attention
    from cp_lightning.collectives import count_bytes

    q, kv = torch.randn(1, 3, 8, 4), torch.randn(1, 3, 3, 4)
    attention = ContextParallelAttention(groups)
    attention.state.even = False  # the routed call would exchange lengths first: the check must come before
    calls = {
        "not_dividing": lambda: cp_attention(q, kv, kv, groups=groups, enable_gqa=True),
        "routed_not_dividing": lambda: attention(q, kv, kv, enable_gqa=True, where="blocks.0.attn"),
        "without_flag": lambda: cp_attention(q, q[:, :, :2], q[:, :, :2], groups=groups),
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
    return refused


def _bytes(groups_of):
    """Bytes sent in one forward pass at cp 4, 16 tokens: Ulysses with GQA and ring with GQA vs repeated heads."""
    from cp_lightning.attention import cp_attention
    from cp_lightning.collectives import count_bytes

    def sent(groups, hkv, gqa, kind):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 4, 8, 4, generator=g, dtype=torch.float64)  # B, S_local, H, D
        k = torch.randn(1, 4, hkv, 4, generator=g, dtype=torch.float64)
        if not gqa:  # what a processor that repeats K/V heads sends: B, S, H_kv, D -> B, S, H, D
            k = k.repeat_interleave(8 // hkv, dim=2)
        with torch.no_grad(), count_bytes() as counter:
            cp_attention(q, k, k, groups=groups, even=True, enable_gqa=gqa)
        return sum(n for name, n in counter.items() if name.startswith(kind))

    query_bytes = 1 * 4 * 8 * 4 * 8
    return {
        "ulysses_8_4": sent(groups_of[1], 4, True, "all_to_all") / query_bytes,
        "ulysses_8_2": sent(groups_of[1], 2, True, "all_to_all") / query_bytes,
        "ulysses_repeated": sent(groups_of[1], 2, False, "all_to_all") / query_bytes,
        "ring_8_2": sent(groups_of[4], 2, True, "p2p"),
        "ring_repeated": sent(groups_of[4], 2, False, "p2p"),
    }


# library case -> (the stock processor its stand-in replaces, the path prefix of the attention modules in the split
# region): the stand-ins that hand CP attention their grouped K/V heads instead of the stock processors' repeated ones
GROUPED_STAND_INS = {
    "lumina2": ("Lumina2AttnProcessor2_0", "layers."),
    "krea2": ("Krea2AttnProcessor", "transformer_blocks."),
    "nucleusmoe-image": ("NucleusMoEAttnProcessor2_0", "transformer_blocks."),
}


def _stand_in(mesh, name):
    """A library case's grouped-K/V stand-in inside parallelize (its parity rows in tests/test_library.py prove it
    exact): the processors inside and after, and the ring's K/V bytes in one forward at cp 4 against the stock
    processor's repeated heads."""
    import copy

    from cp_lightning import parallelize, remove, routing
    from cp_lightning.collectives import count_bytes
    from cp_lightning.models import CASES as LIBRARY
    from cp_lightning.parity import build, make_inputs

    case, (processor, prefix) = LIBRARY[name], GROUPED_STAND_INS[name]
    pristine = build(case)[0]
    inputs = make_inputs(case, [pristine], 16)[0]

    def run():
        model = copy.deepcopy(pristine)
        parallelize(model, mesh=mesh, ring=4)
        names = {type(sub.processor).__name__ for name, sub in routing.attention_modules(model) if prefix in name}
        with torch.no_grad(), count_bytes() as sent:
            model(**inputs)
        remove(model)
        after = {type(sub.processor).__name__ for _, sub in routing.attention_modules(model)}
        return sorted(names), sorted(after), sent["p2p:0"] + sent["p2p:1"]  # K and V blocks

    inside, after, kv_bytes = run()
    stand_in = routing.STAND_INS.pop(processor)
    try:
        stock = run()
    finally:
        routing.STAND_INS[processor] = stand_in
    return {"inside": inside, "after": after, "kv_bytes": kv_bytes, "stock": stock}


def _worker(rank, world, jobs):
    """``jobs``: cp degree -> (cases, routed modes, whether to run the refusals and bytes)."""
    from cp_lightning import build_mesh
    from cp_lightning.mesh import cp_groups

    meshes, groups = {}, {}
    for cp, (cases, routed, _) in sorted(jobs.items()):
        meshes[cp] = build_mesh(cp)
        for ring in sorted({1, cp} | {c[1] for c in cases} | {r for _, r in routed}):
            groups[cp, ring] = cp_groups(meshes[cp], ring)  # created collectively, up front
    results = {}
    for cp, (cases, routed, extra) in sorted(jobs.items()):
        if extra:
            results["bad", cp] = _bad_inputs(groups[cp, 1])
        if extra and cp == 4:
            results["bytes"] = _bytes({1: groups[4, 1], 4: groups[4, 4]})
            results.update({("stand_in", name): _stand_in(meshes[4], name) for name in GROUPED_STAND_INS})
        results.update({case: _case(case, groups[cp, case[1]]) for case in cases})
        results.update({("routed", *mode): _routed(meshes[cp], mode[1]) for mode in routed})
    return results


@pytest.fixture(scope="module")
def per_world(request):
    """The cases, routed modes, refusals and bytes this run selected; cp degree -> every rank's results."""
    cases, routed, worlds = selected(request, "case"), selected(request, "routed"), selected(request, "world")
    extra = set(worlds) | ({4} if selected(request, "bytes_world") or selected(request, "stand_in") else set())
    degrees = {c[0] for c in cases} | {r[0] for r in routed} | extra
    jobs = {cp: ([c for c in cases if c[0] == cp], [r for r in routed if r[0] == cp], cp in extra) for cp in degrees}
    # each degree runs in the largest selected group it divides (starting groups costs seconds): cp 2 as dp 2 x cp 2
    # in the group of 4, or dp 4 x cp 2 in that of 8 when the grid runs, cp 3 as dp 2 x cp 3 in that of 6
    host = {cp: max(w for w in degrees if w % cp == 0) for cp in degrees}
    by_world = {
        world: spawn(_worker, world, {cp: job for cp, job in jobs.items() if host[cp] == world})
        for world in set(host.values())
    }
    return {cp: by_world[host[cp]] for cp in degrees}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[] if c in QUICK else [pytest.mark.slow], id=_id(c)) for c in CASES + GRID]
)
def test_gqa_matches_one_process(per_world, case):
    out_tol, grad_tol = TOL[case[5]]
    for rank, result in enumerate(per_world[case[0]]):
        out_err, *grad_errs = result[case]
        assert out_err <= out_tol and max(grad_errs) <= grad_tol, (rank, out_err, grad_errs)


@pytest.mark.parametrize(
    "routed",
    [pytest.param(m, marks=[] if m == (4, 2) else [pytest.mark.slow], id="cp{}-ring{}".format(*m)) for m in ROUTED],
)
def test_a_parallelized_module_with_enable_gqa_matches_one_process(per_world, routed):
    for rank, result in enumerate(per_world[routed[0]]):
        out_err, grad_err = result[("routed", *routed)]
        assert out_err <= 1e-12 and grad_err <= 1e-12, (rank, out_err, grad_err)


@pytest.mark.parametrize("world", [4])
def test_heads_that_do_not_divide_are_refused_before_any_collective(per_world, world):
    for rank, result in enumerate(per_world[world]):
        bad = result["bad", world]
        assert "divide the query heads" in bad["not_dividing"], bad
        assert bad["routed_not_dividing"].startswith("blocks.0.attn: "), bad
        assert "enable_gqa=True" in bad["without_flag"], bad
        assert not any(bad[name] for name in bad if name.endswith("_bytes")), (rank, bad)


@pytest.mark.parametrize("bytes_world", [4])
def test_gqa_sends_fewer_bytes(per_world, bytes_world):
    """Ulysses (u=4) forward: (2 + 2/g) x the query bytes x (u-1)/u when u divides H_kv, and at 8/2 (g=4, every K/V
    head to two ranks) 3/8 per K and V; the ring's K/V per step 1/g of repeated heads'."""
    for rank, result in enumerate(per_world[bytes_world]):
        b = result["bytes"]
        assert b["ulysses_8_4"] == pytest.approx((2 + 2 / 2) * 3 / 4), (rank, b)
        assert b["ulysses_8_2"] == pytest.approx(3 / 4 + 3 / 8 + 3 / 8 + 3 / 4), (rank, b)
        assert b["ulysses_repeated"] == pytest.approx(4 * 3 / 4), (rank, b)
        assert b["ring_repeated"] == 4 * b["ring_8_2"], (rank, b)


def test_a_mask_spec_over_local_tokens_takes_gqa():
    """A routed module running locally (outside the split region) hands its spec to ``masked.local_attention``."""
    from cp_lightning.masked import local_attention

    spec = M.block_causal(5, 3, 3)
    q, k, v, dout = _inputs(6, 2)
    ref = _reference(q, k, v, dout, spec.to_dense())
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = local_attention(*leaves, spec)
    out.backward(dout)
    for got, want in zip([out.detach(), *(t.grad for t in leaves)], ref, strict=True):
        assert (got - want).abs().max() <= 1e-12 * want.abs().max()
    with pytest.raises(ValueError, match="divide the 6 query heads"):
        local_attention(q, k[:, :, :1].expand(-1, -1, 4, -1), v[:, :, :1].expand(-1, -1, 4, -1), spec)


@pytest.mark.parametrize("stand_in", list(GROUPED_STAND_INS))
def test_grouped_stand_ins_hand_cp_attention_their_kv_heads(per_world, stand_in):
    """Inside parallelize the stand-in replaces the stock processor (which repeats K/V heads), remove() restores it;
    the ring's K/V blocks then carry the 2 K/V heads of the tiny case's 4 query heads, not 4 repeated ones."""
    from cp_lightning import routing

    processor = GROUPED_STAND_INS[stand_in][0]
    for rank, result in enumerate(per_world[4]):
        got = result["stand_in", stand_in]
        assert got["inside"] == [routing.STAND_INS[processor].__name__] and got["after"] == [processor], got
        assert got["stock"][0] == [processor], got
        assert got["stock"][2] == 2 * got["kv_bytes"] > 0, (rank, got)


def _local_attend(query, key, value, attn_mask=None, scale=None):
    """A stand-in's ``attend`` in one process: SDPA math with enable_gqa, or a mask spec's rectangles."""
    from cp_lightning.masked import local_attention

    if isinstance(attn_mask, M.MaskSpec):
        return local_attention(query, key, value, attn_mask, scale=scale)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # B, S, H, D -> B, H, S, D and back
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
    return out.transpose(1, 2)


@pytest.mark.parametrize("name", [*GROUPED_STAND_INS, "cosmos3-omni"])
def test_stand_ins_equal_the_stock_processors_in_one_process(monkeypatch, name):
    """Each stand-in's CP path (its grouped K/V heads to ``attend``, here one-process SDPA math with enable_gqa, or
    the causal spec's rectangles for Cosmos3's text) against the stock processor, the whole tiny model in fp64:
    outputs and parameter gradients within 1e-12 of the largest."""
    import copy

    from cp_lightning import routing
    from cp_lightning.models import CASES as LIBRARY
    from cp_lightning.parity import _tensors, build, make_inputs

    # one process: the stand-in's local tokens are the whole sequence (Cosmos3 asks for its text's full length)
    monkeypatch.setattr(routing, "shard_span", lambda x, dim: (0, x.shape[dim]))
    if name == "krea2":  # its RMSNorms upcast to fp32 only, which would round the comparison to 1e-8: keep fp64
        from diffusers.models.transformers.transformer_krea2 import Krea2RMSNorm

        norm = lambda self, x: F.rms_norm(x, (self.dim,), weight=self.weight + 1.0, eps=self.eps)  # noqa: E731
        monkeypatch.setattr(Krea2RMSNorm, "forward", norm)
    case = LIBRARY[name]
    stock = [build(case)[0].double()]
    inputs = make_inputs(case, stock, 16, dtype=torch.float64)[0]
    stood_in = copy.deepcopy(stock)
    swapped = 0
    for _, sub in routing.attention_modules(stood_in[0]):
        factory = routing.STAND_INS.get(type(sub.processor).__name__)
        if factory is not None:
            sub.processor, swapped = factory(sub.processor, _local_attend, lambda: True), swapped + 1
    assert swapped

    def run(model):  # fp64 outputs and parameter gradients of a fixed random weighting of the outputs
        outs = _tensors(model(**inputs, return_dict=False))
        g = torch.Generator().manual_seed(5)
        sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs).backward()
        return [o.detach() for o in outs], {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    (want, want_grads), (got, got_grads) = run(stock[0]), run(stood_in[0])
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max(), name
    largest = max(g.abs().max() for g in want_grads.values())
    assert sorted(got_grads) == sorted(want_grads)
    for key, g in want_grads.items():
        assert (got_grads[key] - g).abs().max() <= 1e-12 * largest, key

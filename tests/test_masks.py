"""Mask specs (cp_lightning.masks) in one process: the specs, the rectangles, balance, and the ring loop.

Each constructor against the definition it follows (diffusers' Flux.2 KV and Qwen-Image 2.1 code, CausVid's
teacher-forcing mask); refusals; the rectangles a layout executes against the dense mask; the balance of executed
area per rank on the shapes of DESIGN.md section 9.1; no S x S tensor; and the shipped ring loop over virtual
ranks (cp_lightning.ring_threads) at P = 2, 4, 8 against fp64 SDPA math with the spec's dense mask. The process
grid (cp_attention at cp 2, 3, 4) is tests/test_masks_cp.py. Tolerances: fp64 1e-12; fp32 outputs 1e-5,
gradients 1e-4 (relative to the largest reference value).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cp_lightning import masks as M
from cp_lightning.mask_layout import Layout, balance, executed_area, pieces, ring_areas, ring_idling, ring_positions

TOL = {"float64": (1e-12, 1e-12), "float32": (1e-5, 1e-4)}

# small specs for the parity grid: uneven frames and tail blocks, 2-5 blocks, windows, sinks, causal tiles
SPECS = {
    "block2": lambda: M.block_causal(5, 3, 3),  # 2 blocks, the tail of 2 frames
    "block5": lambda: M.block_causal(9, 2, 2, window_frames=4, sink_frames=1),  # 5 blocks
    "teacher": lambda: M.teacher_forcing(5, 2, 2),  # [clean | noisy], 3 blocks each
    "documents": lambda: M.documents([3, 5, 2, 7]),
    "prefix_only": lambda: M.prefix_only(3, 4, 6),
    "qwen": lambda: M.qwen_image_segments([(0, 5, True), (5, 9, False), (9, 12, True)], 17),  # causal text
}


def layout_of(name: str, length: int, ranks: int) -> Layout:
    return Layout.contiguous(length, ranks) if name == "contiguous" else Layout.head_tail(length, ranks)


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def reference(spec: M.MaskSpec, q, k, v, dout):
    """(out, dq, dk, dv) of SDPA math in fp64 over the whole (B, H, S, D) sequence with the dense mask."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*leaves, attn_mask=spec.to_dense())
    out.backward(dout.double())
    return [out.detach(), *(t.grad for t in leaves)]


# ----- the specs ---------------------------------------------------------------------------------------------


def test_block_causal_is_block_of_key_at_most_block_of_query_with_window_sink_and_tail():
    frames, t, n, window, sink = 11, 2, 3, 5, 1
    dense = M.block_causal(frames, t, n, window_frames=window, sink_frames=sink).to_dense()
    frame = torch.arange(frames * t) // t
    block, end = frame // n, torch.clamp((frame // n + 1) * n, max=frames)  # the tail block (frames 9, 10) counts
    q, k = frame[:, None], frame[None, :]
    seen = (block[None, :] <= block[:, None]) & ((k >= end[:, None] - window) | (k < sink))
    assert torch.equal(dense, seen)
    assert torch.equal(M.block_causal(frames, t, n).to_dense(), block[None, :] <= block[:, None])
    assert M.block_causal(frames, t, n).length == q.shape[0] == frames * t


def test_teacher_forcing_is_causvids_mask():
    """CausVid's ``_prepare_teacher_forcing_mask``: clean ``kv < context_end(q)``; noisy block b its own block
    and the clean keys before ``b * block`` (plus the diagonal, which those already hold)."""
    frames, t, n = 7, 2, 3
    half, size = frames * t, n * t
    i = torch.arange(2 * half)
    context_end = torch.clamp((i // size + 1) * size, max=half)
    noisy_start = half + ((i - half) // size) * size
    q, k = i[:, None], i[None, :]
    clean = (q < half) & (k < context_end[:, None])
    noisy = (q >= half) & (
        ((k >= noisy_start[:, None]) & (k < noisy_start[:, None] + size)) | (k < (q - half) // size * size)
    )
    assert torch.equal(M.teacher_forcing(frames, t, n).to_dense(), clean | noisy | (q == k))


def test_prefix_only_is_flux2_kv_extract_mode():
    from diffusers.models.transformers.transformer_flux2 import _flux2_kv_causal_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 13, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    want = _flux2_kv_causal_attention(q, k, v, num_txt_tokens=3, num_ref_tokens=4)
    dense = M.prefix_only(3, 4, 6).to_dense()
    got = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=dense).transpose(1, 2)
    assert rel(got, want) < 1e-12


def test_qwen_image_segments_are_qwenimage21s_block_causal_mask():
    """``(q >= k) or same_image_block`` over image ids that diffusers' own helpers give a prompt, two condition
    images and a target."""
    from diffusers.models.transformers.transformer_qwenimage21 import (
        QwenImage21Transformer2DModel,
        _qwenimage21_prefix_segments,
    )

    pad = torch.tensor([False] * 4 + [True] * 3 + [True] * 2 + [False] * 3 + [True] * 5)  # text, img, img, text, target
    ids, target = QwenImage21Transformer2DModel.build_token_metadata(pad, [(1, 1, 3), (1, 2, 1), (1, 1, 5)])
    prefix = int((~target).sum())
    spec = M.qwen_image_segments(_qwenimage21_prefix_segments(ids, prefix), len(ids))
    q, k = torch.arange(len(ids))[:, None], torch.arange(len(ids))[None, :]
    same_block = (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)
    assert torch.equal(spec.to_dense(), (q >= k) | same_block)


def test_documents_and_area():
    spec = M.documents([2, 3], causal=True)
    assert spec.to_dense().tolist()[2:] == [[0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert spec.area == 3 + 6 and M.documents([2, 3]).area == 13
    assert M.block_causal(25, 1, 5).density == pytest.approx(0.6)  # DESIGN.md section 9.1


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: M.MaskSpec(6, [(0, 6, 0, 4), (2, 4, 3, 6)]), "overlap at query rows 2:4, keys 3:4"),
        (lambda: M.MaskSpec(6, [(0, 2, 0, 2), (3, 6, 0, 6)]), "query rows 2:3 see no key"),
        (lambda: M.MaskSpec(6, [(0, 6, 0, 7)]), "inside the sequence of 6 tokens"),
        (lambda: M.block_causal(6, 2, 3, window_frames=2), "shorter than a block"),
        (lambda: M.qwen_image_segments([(0, 3, True), (4, 6, False)], 8), "must start where"),
        (lambda: Layout.head_tail(5, 4), "at least 8 tokens"),
    ],
    ids=["overlap", "row-sees-nothing", "outside", "window", "segments", "head-tail-short"],
)
def test_bad_specs_are_refused_at_construction(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_token_count_and_layout_mismatch_are_refused_without_communication():
    """cp_attention's checks (masked_cp.resolve_layout) run before its first collective; a rank with the wrong
    shard is refused alone only when nothing tells it the sequence length (then the others' mistake)."""
    from cp_lightning.masked_cp import resolve_layout

    spec, x = M.block_causal(4, 2, 2), torch.zeros(1, 4, 1, 4)
    with pytest.raises(ValueError, match="covers 8 tokens but the sequence has 10"):
        resolve_layout(spec, None, x, 2, 0, 10)
    with pytest.raises(ValueError, match="covers 8 tokens but the layout 9"):
        resolve_layout(spec, Layout.contiguous(9, 2), x, 2, 0, None)
    with pytest.raises(ValueError, match="holds 5 tokens but the head_tail layout"):
        resolve_layout(spec, Layout.head_tail(8, 2), torch.zeros(1, 5, 1, 4), 2, 0, None)
    assert resolve_layout(spec, None, x, 2, 1, 8).lengths == [4, 4]


# ----- rectangles and balance --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SPECS)
def test_pieces_cover_the_dense_mask_exactly_once(name):
    spec = SPECS[name]()
    dense = spec.to_dense()
    for ranks in (1, 2, 3, 4):
        for layout in ("contiguous", "head_tail"):
            held = layout_of(layout, spec.length, ranks).runs
            for r in range(ranks):
                keys = tuple(run for rank in held for run in rank)
                for tile in (2, 64):
                    found = pieces(spec, held[r], keys, tile)
                    rows, cols = (torch.cat([torch.arange(a, b) for a, b in runs]) for runs in (held[r], keys))
                    count = torch.zeros(len(rows), len(cols), dtype=torch.int)
                    for p in found:
                        i, j = torch.arange(p.q_lo, p.q_hi)[:, None], torch.arange(p.k_lo, p.k_hi)[None, :]
                        seen = (j <= i + p.diag) if p.diag is not None else torch.ones(len(i), j.shape[1], dtype=bool)
                        assert seen.any(1).all(), (p, "a kernel call with an empty softmax row")
                        count[p.q_lo : p.q_hi, p.k_lo : p.k_hi] += seen
                    assert torch.equal(count, dense[rows][:, cols].int()), (ranks, layout, r, tile)


# (name, frames, frames per block, tokens per frame): SkyReels-V2 DF 540P (97 frames), CausVid and LongLive 480P
SHAPES = [("skyreels_df", 25, 5, 2040), ("causvid", 21, 3, 1560), ("longlive", 32, 8, 1560)]


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_executed_area_per_rank_is_balanced(shape, ranks):
    """Ulysses: every rank runs the whole mask for its heads, the same area whatever the layout; a head_tail ring
    within 2% of the mean (a contiguous one gives the last rank 1.4-1.75x)."""
    _, frames, block, tokens = shape
    spec = M.block_causal(frames, tokens, block)
    for layout in (Layout.contiguous(spec.length, ranks), Layout.head_tail(spec.length, ranks, unit=tokens)):
        everything = layout.group_runs(range(ranks))
        assert executed_area(pieces(spec, everything, everything)) == spec.area  # Ulysses, per head
    head_tail = Layout.head_tail(spec.length, ranks, unit=tokens)
    assert balance([sum(steps) for steps in ring_areas(spec, head_tail, ranks)]) <= 1.02
    assert balance([sum(steps) for steps in ring_areas(spec, Layout.contiguous(spec.length, ranks), ranks)]) >= 1.4
    assert ring_idling(spec, head_tail, ranks) <= 1.25


def test_head_tail_keeps_whole_frames_when_ranks_divide_them():
    assert Layout.head_tail(32 * 3, 4, unit=3).runs[1] == ((12, 24), (72, 84))  # 4 frames a run
    assert Layout.head_tail(25 * 3, 4, unit=3).lengths == [19, 19, 19, 18]  # 25 frames: by tokens, even


def test_a_ring_that_idles_under_teacher_forcing_is_warned():
    from cp_lightning.masked_cp import IDLING_WARNING, warn_if_idle

    spec = M.teacher_forcing(21, 4, 3)
    layout = Layout.head_tail(spec.length, 4)
    assert ring_idling(spec, layout, 4) > IDLING_WARNING
    with pytest.warns(UserWarning, match="prefer it"):
        warn_if_idle(spec, layout, 4)


def test_no_tensor_of_s_squared_elements_forward_or_backward():
    """Every tensor an op returns while a spec runs, forward and backward, is at most the (B, S, H, D) inputs' size,
    far below S^2 elements (a dense mask at the 8,192 tokens of the block-causal case: 67M)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from cp_lightning.masked import local_attention

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    for spec in (M.block_causal(32, 256, 4), M.qwen_image_segments([(0, 256, True)], 2048)):  # + causal tiles
        q, k, v = (torch.randn(1, spec.length, 1, 4, requires_grad=True) for _ in range(3))
        Largest.numel = 0
        with Largest():
            local_attention(q, k, v, spec).sum().backward()
        assert 0 < Largest.numel <= spec.length * 4 < spec.length**2 // 100


# ----- the shipped ring loop over virtual ranks ----------------------------------------------------------------


def thread_ring_case(name: str, ranks: int, layout_name: str, dtype: torch.dtype) -> list[float]:
    from cp_lightning import ring
    from cp_lightning.kernels import get_kernel
    from cp_lightning.masked import encode
    from cp_lightning.ring_threads import ThreadRing

    spec = SPECS[name]()
    g = torch.Generator().manual_seed(ranks)
    q, k, v, dout = (torch.randn(1, 2, spec.length, 4, generator=g, dtype=torch.float64) for _ in range(4))
    ref = reference(spec, q, k, v, dout)
    layout = layout_of(layout_name, spec.length, ranks)
    held = ring_positions(layout, ranks)

    def rank_fn(r):
        plan = encode([pieces(spec, held[r], held[(r - s) % ranks]) for s in range(ranks)])
        leaves = [layout.shard(t, 2, r).to(dtype).requires_grad_() for t in (q, k, v)]
        kernel = get_kernel("cpu_flash")
        out = ring.ring_attention(*leaves, group=tr, kernel=kernel, block_lengths=layout.lengths, plan=plan)
        out.backward(layout.shard(dout, 2, r).to(dtype))
        return [out.detach(), *(t.grad for t in leaves)]

    with ThreadRing(ranks) as tr:
        per_rank = tr.run(rank_fn)
    return [rel(layout.unshard([r[i] for r in per_rank], 2), ref[i]) for i in range(4)]


THREAD_CASES = [
    pytest.param(
        (name, ranks, layout, dtype),
        marks=[]
        if (ranks, layout, dtype) in ((4, "head_tail", "float64"), (8, "contiguous", "float32"))
        else [pytest.mark.slow],
        id=f"{name}-P{ranks}-{layout}-{dtype}",
    )
    for name in SPECS
    for ranks in (2, 4, 8)
    for layout in ("contiguous", "head_tail")
    for dtype in ("float64", "float32")
    if ranks * 2 <= SPECS[name]().length
]


@pytest.mark.parametrize("thread_case", THREAD_CASES)
def test_thread_ring_matches_one_process(thread_case):
    name, ranks, layout, dtype = thread_case
    out_err, *grad_errs = thread_ring_case(name, ranks, layout, getattr(torch, dtype))
    out_tol, grad_tol = TOL[dtype]
    assert out_err <= out_tol and max(grad_errs) <= grad_tol, (out_err, grad_errs)


def test_masks_benchmark_runs_tiny(capsys):
    from benchmarks import masks as bench

    out = bench.main(["--frame-tokens", "2", "--heads", "1", "--head-dim", "4", "--repeats", "1", "--ranks", "2"])
    assert len(out["timing"]) == len(bench.timing_specs(2)) and len(out["balance"]) == len(bench.SHAPES)
    skyreels = out["balance"][0]  # head_tail balanced, contiguous not
    assert float(skyreels[6]) <= 1.02 < 1.3 <= float(skyreels[4]), skyreels
    printed = capsys.readouterr().out
    assert "| full | 48 | 1.000 |" in printed and "| skyreels_df 25/5 | 2 | 0.600 | 1.00 | 1.400 |" in printed

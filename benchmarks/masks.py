"""What a mask spec costs and saves: masked vs unmasked attention time on CPU, and the balance per rank.

    python benchmarks/masks.py                       # both tables, default shapes
    python benchmarks/masks.py --frame-tokens 32     # smaller timing shapes

Timing (one process, fp32, forward + backward of one attention call over the whole sequence, the work one
Ulysses rank does for its heads): each mask of docs/masks.md as a spec (``masked.local_attention``: the
unmasked CPU kernel per rectangle) against plain SDPA with no mask, and against SDPA with the spec's dense
(S, S) boolean mask, which is what diffusers' SkyReels-V2 builds. The spec's time over the unmasked time
should follow the mask's density (its FLOPs are the mask's area); the dense mask costs the full S x S work
and S^2 bytes.

Balance (pure arithmetic over the rectangles the layouts execute, mask_layout.ring_areas): on the shapes of
DESIGN.md section 9.1 at 2, 4 and 8 ranks, the busiest ring rank's area over the mean for the contiguous and
head_tail layouts, and the ring's per-step idling (lockstep time over balanced time). Ulysses is 1.00 for every
mask (each rank runs the whole mask for its heads). Prints Markdown.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import table  # noqa: E402
from cp_lightning import masks as M  # noqa: E402
from cp_lightning.mask_layout import Layout, balance, ring_areas, ring_idling  # noqa: E402
from cp_lightning.masked import local_attention  # noqa: E402

# (name, frames, frames per block, tokens per frame, teacher forcing): SkyReels-V2 DF 540P 97 frames, CausVid and
# LongLive 480P (DESIGN.md section 9.1)
SHAPES = [
    ("skyreels_df 25/5", 25, 5, 2040, False),
    ("causvid 21/3", 21, 3, 1560, False),
    ("longlive 32/8", 32, 8, 1560, False),
    ("causvid teacher forcing 21/3", 21, 3, 1560, True),
]


def timing_specs(frame_tokens: int) -> dict[str, M.MaskSpec]:
    """The masks at a CPU-sized scale: 24 frames of ``frame_tokens`` tokens, or as many tokens."""
    t = frame_tokens
    image = 24 * t
    return {
        "full": M.full(image),
        "block_causal 24/4": M.block_causal(24, t, 4),
        "block_causal 24/4, window 8, sink 1": M.block_causal(24, t, 4, window_frames=8, sink_frames=1),
        "teacher_forcing 12/3": M.teacher_forcing(12, t, 3),
        "documents 4 x 6 frames": M.documents([6 * t] * 4),
        "prefix_only (1/4 reference)": M.prefix_only(t, image // 4, image - image // 4 - t),
        "qwen_image_segments": M.qwen_image_segments([(0, t, True), (t, 7 * t, False), (7 * t, 8 * t, True)], image),
    }


def _timed(fns, repeats: int) -> list[float]:
    """The fastest of ``repeats`` runs of each function, run in turn (a b c a b c ...), in CPU time of this
    process: with one thread that is compute time, not the waiting a shared machine adds to wall time."""
    times = [[] for _ in fns]
    for i in range(repeats + 1):
        for fn, spent in zip(fns, times, strict=True):
            start = time.process_time()
            fn()
            if i:  # the first round warms up
                spent.append(time.process_time() - start)
    return [min(spent) for spent in times]


def _sdpa(q, k, v, mask=None):
    # B, S, H, D -> B, H, S, D and back
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask).transpose(1, 2)


def _step(attend, q, k, v, dout) -> None:
    """One forward and backward of ``attend`` on fresh leaves."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attend(*leaves).backward(dout)


def time_masks(args) -> list[list]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, spec in timing_specs(args.frame_tokens).items():
        inputs = [torch.randn(1, spec.length, args.heads, args.head_dim, generator=g) for _ in range(4)]
        dense = spec.to_dense()
        variants = [_sdpa, functools.partial(local_attention, spec=spec), functools.partial(_sdpa, mask=dense)]
        plain, spec_time, dense_time = _timed([functools.partial(_step, f, *inputs) for f in variants], args.repeats)
        rows.append(
            [name, spec.length, f"{spec.density:.3f}", f"{plain * 1e3:.1f}", f"{spec_time * 1e3:.1f}",
             f"{spec_time / plain:.3f}", f"{dense_time * 1e3:.1f}", f"{dense.numel() / 2**20:.1f}"]
        )  # fmt: skip
    return rows


def balance_rows(ranks_list) -> list[list]:
    rows = []
    for name, frames, block, tokens, teacher in SHAPES:
        spec = (M.teacher_forcing if teacher else M.block_causal)(frames, tokens, block)
        for ranks in ranks_list:
            row = [name, ranks, f"{spec.density:.3f}", "1.00"]
            for layout in (Layout.contiguous(spec.length, ranks), Layout.head_tail(spec.length, ranks, unit=tokens)):
                per_rank = [sum(steps) for steps in ring_areas(spec, layout, ranks)]
                row += [f"{balance(per_rank):.3f}", f"{ring_idling(spec, layout, ranks):.3f}"]
            rows.append(row)
    return rows


def parse(argv=None):
    parser = argparse.ArgumentParser(description="masked vs unmasked attention time, and balance per rank")
    parser.add_argument("--frame-tokens", type=int, default=64, help="tokens per frame of the timing shapes")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--no-timing", action="store_true", help="only the balance table")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    out = {"balance": balance_rows(args.ranks), "timing": []}
    if not args.no_timing:
        out["timing"] = time_masks(args)
        threads = torch.get_num_threads()
        print(f"forward + backward, fp32, 1 x S x {args.heads} heads x {args.head_dim}, {threads} thread(s), torch "
              f"{torch.__version__}, CPU time of the process, fastest of {args.repeats}\n")  # fmt: skip
        headers = ["mask", "tokens", "density", "unmasked SDPA ms", "spec ms", "spec / unmasked", "dense-mask SDPA ms",
                   "dense mask MiB"]  # fmt: skip
        print(table(headers, out["timing"]) + "\n")
    headers = ["shape", "ranks", "density", "Ulysses max/mean", "contiguous ring max/mean", "contiguous idling",
               "head_tail ring max/mean", "head_tail idling"]  # fmt: skip
    print(table(headers, out["balance"]))
    return out


if __name__ == "__main__":
    main()

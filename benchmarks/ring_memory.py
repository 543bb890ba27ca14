"""Per-rank peak memory of one training step: Ulysses vs ring vs an all-gather-K/V ring.

    python benchmarks/ring_memory.py --cp 4 --tokens 8192

Runs one forward+backward of a narrow Flux-architecture transformer at the given cp, once per mode,
each mode in a fresh group of worker processes (CPU, gloo, one thread each), and prints a Markdown
table. Peak memory is the process high-water mark (VmHWM, reset through /proc/self/clear_refs just
before the step) minus the resident set before the step; glibc is told to serve large blocks with
mmap (MALLOC_MMAP_THRESHOLD_) so that freed tensors leave the resident set and the mark is honest.

The "allgather" mode exists only for this comparison: it gathers every rank's K/V up front (what
diffusers calls ring attention), keeps the full K/V for backward, and reduce-scatters dK/dV, so its
K/V memory is O(S) instead of O(S/P).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("ulysses", "ring", "allgather")


def _status(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+)", text).group(1)) * 1024


class _AllGatherKV(torch.autograd.Function):
    """Attention of local queries over all-gathered K/V, block by block with LSE merging."""

    @staticmethod
    def forward(ctx, q, k, v, group, kernel, scale):
        from cp_lightning.collectives import all_gather_no_grad
        from cp_lightning.ring import merge

        world = dist.get_world_size(group)
        k_all, v_all = all_gather_no_grad(k, 2, group), all_gather_no_grad(v, 2, group)  # B, H, S, D: O(S)
        out = lse = None
        for kb, vb in zip(k_all.chunk(world, 2), v_all.chunk(world, 2), strict=True):
            block_out, block_lse = kernel.forward(q, kb, vb, None, scale)
            out, lse = merge(out, lse, block_out, block_lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k_all, v_all, out, lse)
        ctx.group, ctx.kernel, ctx.scale, ctx.world = group, kernel, scale, world
        return out

    @staticmethod
    def backward(ctx, dout):
        from cp_lightning.collectives import record_sent

        q, k_all, v_all, out, lse = ctx.saved_tensors
        dq = torch.zeros_like(q, dtype=torch.float32)
        dks, dvs = [], []
        for kb, vb in zip(k_all.chunk(ctx.world, 2), v_all.chunk(ctx.world, 2), strict=True):
            dq_b, dk_b, dv_b = ctx.kernel.backward(dout, q, kb, vb, out, lse, None, ctx.scale)
            dq += dq_b
            dks.append(dk_b)
            dvs.append(dv_b)
        dk_all, dv_all = torch.cat(dks, 2).contiguous(), torch.cat(dvs, 2).contiguous()
        for t in (dk_all, dv_all):  # a ring all-reduce sends 2 (P-1)/P of the tensor
            record_sent("all_reduce", 2 * t.numel() * t.element_size() * (ctx.world - 1) // ctx.world)
        dist.all_reduce(dk_all, group=ctx.group)
        dist.all_reduce(dv_all, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return (dq.to(q.dtype), dk_all.chunk(ctx.world, 2)[rank], dv_all.chunk(ctx.world, 2)[rank], None, None, None)


def _allgather_attention_config(groups):
    from cp_lightning.attention import ContextParallelAttention
    from cp_lightning.kernels import pick_kernel

    class AllGatherRing(ContextParallelAttention):
        def __call__(self, query, key, value, *, attn_mask=None, scale=None, **_):
            kernel = pick_kernel(query.device, query.dtype, False)
            q, k, v = (t.transpose(1, 2) for t in (query, key, value))
            return _AllGatherKV.apply(q, k, v, self.groups.cp, kernel, scale).transpose(1, 2)

    return AllGatherRing(groups)


def build_model(args):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=args.layers,
        num_single_layers=args.layers,
        attention_head_dim=args.head_dim,
        num_attention_heads=args.heads,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(args.head_dim // 4, 3 * args.head_dim // 8, 3 * args.head_dim // 8),
    )


def _worker(rank, world, mode, args):
    from cp_lightning import build_mesh, collectives, parallelize
    from cp_lightning.parallelize import parallel_state
    from cp_lightning.routing import route_processors
    from cp_lightning.tiny import tiny_inputs

    model = build_model(args)
    inputs = tiny_inputs("flux", model, batch=1, tokens=args.tokens, text_tokens=args.text_tokens)
    mesh = build_mesh(args.cp)
    parallelize(model, mesh=mesh, ring=args.cp if mode in ("ring", "allgather") else 1)
    if mode == "allgather":
        state = parallel_state(model)
        route_processors(state.attention_modules, _allgather_attention_config(state.groups))
    # warm-up at a small size so one-time allocations (thread pools, kernels) are not counted
    small = tiny_inputs("flux", model, batch=1, tokens=64, text_tokens=args.cp * 4)
    model(**small, return_dict=False)[0].sum().backward()
    model.zero_grad(set_to_none=True)

    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    baseline = _status("VmRSS")
    start = time.perf_counter()
    with collectives.count_bytes() as sent:
        out = model(**inputs, return_dict=False)[0]
        out.float().square().mean().backward()
    elapsed = time.perf_counter() - start
    return {"peak": _status("VmHWM") - baseline, "time": elapsed, "sent": sum(sent.values())}


def run_mode(mode: str, args) -> list[dict]:
    """One fresh group of ``cp`` worker processes for this mode; returns each rank's figures."""
    from tests.distributed import spawn

    # glibc reads this at process start: spawned workers inherit it from here
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    return spawn(_worker, args.cp, mode, args, timeout_s=args.timeout)


def parse(argv=None):
    parser = argparse.ArgumentParser(description="per-rank peak memory: Ulysses vs ring vs all-gather ring")
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--text-tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2, help="double- and single-stream blocks each")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--timeout", type=float, default=1800)
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    rows = {}
    for mode in args.modes:
        print(f"running {mode} ...", file=sys.stderr, flush=True)
        rows[mode] = run_mode(mode, args)
    base = max(r["peak"] for r in rows.get("ulysses", next(iter(rows.values()))))
    print(
        f"\nFlux-architecture, {args.layers}+{args.layers} blocks, {args.heads} heads x {args.head_dim}, "
        f"batch 1 x ({args.tokens} + {args.text_tokens}) tokens, cp={args.cp}, CPU/gloo, fp32\n"
    )
    print("| mode | peak MiB (max over ranks) | vs Ulysses | step s (max) | MiB sent per rank |")
    print("|---|---|---|---|---|")
    for mode, per_rank in rows.items():
        peak = max(r["peak"] for r in per_rank)
        print(
            f"| {mode} | {peak / 2**20:.1f} | {peak / base:.2f} | {max(r['time'] for r in per_rank):.2f} | "
            f"{max(r['sent'] for r in per_rank) / 2**20:.1f} |"
        )
    return rows


if __name__ == "__main__":
    main()

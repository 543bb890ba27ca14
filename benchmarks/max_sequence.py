"""The longest sequence whose training step fits a fixed per-rank memory budget, at each cp.

    python benchmarks/max_sequence.py --cps 1 2 4 --budget-mib 128
    torchrun --nproc-per-node 4 benchmarks/max_sequence.py --budget-mib 4096    # one cp = 4 (nccl on CUDA)

For each cp (and mode), one group of processes searches the image-token count: a first probe, a
linear extrapolation of its peak to the budget, then doubling or halving steps until the budget is
bracketed, then bisection down to ``--granularity`` tokens. A probe is one forward+backward of the
narrow Flux of benchmarks/scaling.py; its peak is the maximum over the group's ranks of the per-rank
peak (see benchmarks/common.py), so every rank takes the same decision. The budget counts the
step's own memory above what the process held before it (activations, gradients, buffers), not the
interpreter and the weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import common  # noqa: E402

MODES = ("ulysses", "ring")


def _probe(model, tokens: int, args, dev: torch.device) -> tuple[int, float]:
    """The group's peak bytes (max over ranks) and step seconds (max) for one step at ``tokens``."""
    inputs = common.make_inputs(model, tokens=tokens, text_tokens=args.text_tokens, device=dev)
    result = common.measure(model, inputs, device=dev, warmup=0, repeats=1)
    figures = torch.tensor([float(result["peak"]), result["time"]], dtype=torch.float64, device=dev)
    if dist.is_initialized():
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return int(figures[0]), float(figures[1])


def search(model, args, dev: torch.device, cp: int) -> dict:
    """Bracket, then bisect, the largest token count (a multiple of the granularity) under the budget."""
    budget, g = args.budget_mib * common.MiB, args.granularity
    probes: list[tuple[int, int, float]] = []

    def fits(tokens: int) -> bool:
        peak, seconds = _probe(model, tokens, args, dev)
        probes.append((tokens, peak, seconds))
        return peak <= budget

    def round_down(tokens: float) -> int:
        return max(g, int(tokens) // g * g)

    def extrapolate() -> int:
        """The token count at which the line through the last probes (or the origin) meets the budget."""
        (t1, p1, _), (t2, p2, _) = probes[-2:] if len(probes) > 1 else ((0, 0, 0.0), probes[-1])
        slope = (p2 - p1) / (t2 - t1) if t2 != t1 and p2 > p1 else p2 / t2
        return round_down(t2 + (budget - p2) / slope * 1.05)  # aim a little past the budget to bracket it

    # warm-up at the first probe's size: one-time allocations (thread pools, kernels) are not the step's
    _probe(model, args.first_probe * cp, args, dev)
    lo, hi, tokens = 0, None, args.first_probe * cp
    while hi is None or lo == 0:  # bracket: lo fits, hi does not
        if fits(tokens):
            lo, tokens = tokens, max(tokens + g, extrapolate())
        elif tokens <= g:
            break  # not even the smallest sequence fits
        else:
            hi, tokens = tokens, round_down(tokens / 2)
        if hi is not None and lo:
            break
    while hi is not None and lo and hi - lo > g:  # bisect
        mid = round_down((lo + hi) / 2)
        if fits(mid):
            lo = mid
        else:
            hi = mid
    at_lo = next((p for p in probes if p[0] == lo), None)
    return {"tokens": lo, "peak": at_lo[1] if at_lo else 0, "time": at_lo[2] if at_lo else 0.0, "probes": probes}


def _setup(world: int, mode: str, args):
    from cp_lightning import build_mesh, parallelize

    dev = common.device()
    model = common.build_model(layers=args.layers, heads=args.heads, head_dim=args.head_dim).to(dev)
    if world > 1:
        parallelize(model, mesh=build_mesh(world), ring=world if mode == "ring" else 1)
    return model, dev


def _worker(rank: int, world: int, mode: str, args) -> dict:
    model, dev = _setup(world, mode, args)
    return search(model, args, dev, world)


def render(rows: list[dict], args) -> str:
    base = next((r for r in rows if r["cp"] == 1), None)
    body = [
        [
            r["cp"],
            r["mode"],
            r["tokens"],
            f"{r['tokens'] / base['tokens']:.2f}" if base and base["tokens"] else "-",
            common.mib(r["peak"]),
            f"{r['time']:.2f}",
            len(r["probes"]),
        ]
        for r in rows
    ]
    title = (
        f"Budget {args.budget_mib} MiB per rank for one step's memory; Flux-architecture, {args.layers}+{args.layers} "
        f"blocks, {args.heads} heads x {args.head_dim}, batch 1, {args.text_tokens} text tokens, fp32, "
        f"{common.machine_line(common.device())}; granularity {args.granularity} tokens"
    )
    headers = ["cp", "mode", "max image tokens", "vs cp=1", "peak MiB/rank there", "step s there", "probes"]
    return title + "\n\n" + common.table(headers, body)


def parse(argv=None):
    parser = argparse.ArgumentParser(description="longest sequence under a per-rank memory budget, against cp")
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["ulysses"])
    parser.add_argument("--budget-mib", type=float, default=128)
    parser.add_argument("--first-probe", type=int, default=1024, help="first probe: this many tokens per rank")
    parser.add_argument("--granularity", type=int, default=256)
    common.add_model_args(parser, timing=False)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads shared by a configuration's processes")
    args = parser.parse_args(argv)
    if args.granularity % 4 or args.first_probe % args.granularity:
        parser.error("--granularity must be a multiple of 4 and divide --first-probe")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    rows = []
    if common.under_torchrun():
        common.init_torchrun(None)
        world = dist.get_world_size()
        for mode in args.modes if world > 1 else ["none"]:
            model, dev = _setup(world, mode, args)
            rows.append({"cp": world, "mode": mode, **search(model, args, dev, world)})
            del model
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return {"rows": rows}
    else:
        for cp in args.cps:
            for mode in args.modes if cp > 1 else ["none"]:
                print(f"searching cp={cp} {mode} ...", file=sys.stderr, flush=True)
                per_rank = common.launch(_worker, cp, mode, args, threads=max(1, args.threads // cp))
                rows.append({"cp": cp, "mode": mode, **per_rank[0]})
    text = render(rows, args)
    print("\n" + text + "\n")
    return {"rows": rows, "table": text}


if __name__ == "__main__":
    main()

"""Scaling of one training step with the CP degree: per-rank peak memory, step time, bytes sent.

    python benchmarks/scaling.py --cps 1 2 4 --tokens 8192                      # CPU: starts its own groups
    torchrun --nproc-per-node 4 benchmarks/scaling.py --tokens 32768             # one cp = 4 (nccl on CUDA)

One forward+backward of a narrow Flux-architecture transformer (``--layers`` double- and single-stream
blocks) on ``--tokens`` image + ``--text-tokens`` text tokens, at each cp for Ulysses, ring and USP
(ring 2 x Ulysses cp/2, from cp = 4). cp = 1 is the plain model, unparallelized. Each configuration
runs in a fresh group of processes; ``--threads`` CPU threads are shared among its processes (so on
a 2-core machine cp = 1 gets 1 process x 2 threads and cp = 2 gets 2 processes x 1 thread).

Prints a Markdown table (peak memory and step time against cp = 1, bytes sent per rank against the
formulas of DESIGN.md section 3) and saves a plot of memory and time against cp.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

MODES = ("ulysses", "ring", "usp")


def ring_degree(mode: str, cp: int) -> int | None:
    """The ring degree of ``mode`` at ``cp`` (None: the mode does not exist there)."""
    if cp == 1:
        return 1
    if mode == "ulysses":
        return 1
    if mode == "ring":
        return cp
    return 2 if cp >= 4 and cp % 2 == 0 else None  # usp: a 2-rank ring of Ulysses groups


def _setup(world: int, ring: int, args):
    from cp_lightning import build_mesh, parallelize

    dev = common.device()
    model = common.build_model(layers=args.layers, heads=args.heads, head_dim=args.head_dim).to(dev)
    if world > 1:
        parallelize(model, mesh=build_mesh(world), ring=ring)
    inputs = common.make_inputs(model, tokens=args.tokens, text_tokens=args.text_tokens, device=dev)
    return model, inputs, dev


def _worker(rank: int, world: int, ring: int, args) -> dict:
    model, inputs, dev = _setup(world, ring, args)
    return common.measure(model, inputs, device=dev, warmup=args.warmup, repeats=args.repeats)


def _row(cp: int, mode: str, ring: int, per_rank: list[dict], threads: int, args) -> dict:
    formula = common.formula_bytes(
        mode,
        cp=cp,
        ring=ring,
        tokens=args.tokens,
        text_tokens=args.text_tokens,
        heads=args.heads,
        head_dim=args.head_dim,
        attention_layers=2 * args.layers,
        out_channels=16,
    )
    return {
        "cp": cp,
        "mode": mode if cp > 1 else "none",
        "ring": ring,
        "threads": threads,
        "peak": max(r["peak"] for r in per_rank),
        "time": max(r["time"] for r in per_rank),
        "cpu": sum(r["cpu"] for r in per_rank),
        "sent": max(sum(r["sent"].values()) for r in per_rank),
        "formula": formula,
    }


def configurations(args) -> list[tuple[int, str, int]]:
    out = []
    for cp in args.cps:
        for mode in ("none",) if cp == 1 else args.modes:
            ring = ring_degree(mode, cp)
            if ring is not None and args.heads >= cp // ring:  # each Ulysses rank needs a head
                out.append((cp, mode, ring))
    return out


def render(rows: list[dict], args) -> str:
    base = next((r for r in rows if r["cp"] == 1), None)
    body = []
    for r in rows:
        ratio_mem = f"{r['peak'] / base['peak']:.2f}" if base else "-"
        ratio_time = f"{r['time'] / base['time']:.2f}" if base else "-"
        exact = f"{r['sent'] / r['formula']:.3f}" if r["formula"] else "-"
        body.append(
            [
                r["cp"],
                r["mode"],
                r["ring"],
                f"{r['cp']} x {r['threads']}",
                common.mib(r["peak"]),
                ratio_mem,
                f"{r['time']:.2f}",
                ratio_time,
                f"{r['cpu']:.1f}",
                common.mib(r["sent"]),
                common.mib(r["formula"]),
                exact,
            ]
        )
    headers = ["cp", "mode", "ring", "procs x threads", "peak MiB/rank", "vs cp=1", "step s", "vs cp=1", "CPU s"]
    headers += ["MiB sent/rank", "formula MiB", "sent/formula"]
    title = (
        f"Flux-architecture, {args.layers}+{args.layers} blocks, {args.heads} heads x {args.head_dim}, batch 1 x "
        f"({args.tokens} + {args.text_tokens}) tokens, fp32, {common.machine_line(common.device())}; "
        f"step time = median of {args.repeats} after {args.warmup} warm-up; CPU s = the step's CPU seconds summed "
        "over ranks"
    )
    return title + "\n\n" + common.table(headers, body)


def plot(rows: list[dict], path: Path, args) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(10, 4))
    base = [r for r in rows if r["cp"] == 1]
    for mode in args.modes:
        points = base + [r for r in rows if r["mode"] == mode]
        if len(points) < 2 - (not base):
            continue
        cps = [r["cp"] for r in points]
        ax_mem.plot(cps, [r["peak"] / common.MiB for r in points], marker="o", label=mode)
        ax_time.plot(cps, [r["time"] for r in points], marker="o", label=mode)
    for ax, label in ((ax_mem, "peak memory per rank (MiB)"), (ax_time, "step time (s)")):
        ax.set_xlabel("cp")
        ax.set_ylabel(label)
        ax.set_xticks(sorted({r["cp"] for r in rows}))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"one training step, {args.tokens} + {args.text_tokens} tokens")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def parse(argv=None):
    parser = argparse.ArgumentParser(description="memory, time and bytes of one training step against cp")
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--tokens", type=int, default=8192)
    common.add_model_args(parser)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads shared by a configuration's processes")
    parser.add_argument("--plot", type=Path, default=Path(common.ROOT, "benchmarks/results/scaling.png"))
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    rows = []
    if common.under_torchrun():
        import torch.distributed as dist

        common.init_torchrun(None)
        world = dist.get_world_size()
        args.cps = [world]
        for cp, mode, ring in configurations(args):
            model, inputs, dev = _setup(world, ring, args)
            result = common.measure(model, inputs, device=dev, warmup=args.warmup, repeats=args.repeats)
            rows.append(_row(cp, mode, ring, common.gather_results(result), common.torch.get_num_threads(), args))
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return {"rows": rows}
    else:
        for cp, mode, ring in configurations(args):
            threads = max(1, args.threads // cp)
            print(f"running cp={cp} {mode} ({cp} x {threads} threads) ...", file=sys.stderr, flush=True)
            per_rank = common.launch(_worker, cp, ring, args, threads=threads, timeout=args.timeout)
            rows.append(_row(cp, mode, ring, per_rank, threads, args))
    text = render(rows, args)
    print("\n" + text + "\n")
    path = plot(rows, args.plot, args)
    print(f"plot: {path}")
    return {"rows": rows, "table": text, "plot": path}


if __name__ == "__main__":
    main()

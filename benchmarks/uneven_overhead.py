"""What a sequence length the CP degree does not divide costs: step time and per-rank peak memory.

    python benchmarks/uneven_overhead.py --cp 4 --tokens 4096 --text-tokens 256

For each mode (Ulysses, ring, USP = ring 2 x Ulysses cp/2) one training step of the narrow
Flux-architecture transformer of benchmarks/common.py runs twice in fresh process groups: at a
divisible length (``--tokens`` image + ``--text-tokens`` text tokens) and at the nearest
non-divisible one (one token fewer of each). The uneven run shards with ``tensor_split`` sizes,
looks each attention call's lengths up in the split hooks' table and uses uneven all-to-alls and
ring blocks (docs/design.md, "Any length"). Prints a Markdown table of the ratios.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

MODES = {"ulysses": lambda cp: 1, "ring": lambda cp: cp, "usp": lambda cp: 2 if cp >= 4 else None}


def _worker(rank: int, world: int, ring: int, tokens: int, text_tokens: int, args) -> dict:
    from cp_lightning import build_mesh, parallelize
    from cp_lightning.parallelize import parallel_state

    dev = common.device()
    model = common.build_model(layers=args.layers, heads=args.heads, head_dim=args.head_dim).to(dev)
    parallelize(model, mesh=build_mesh(world), ring=ring)
    inputs = common.make_inputs(model, tokens=tokens, text_tokens=text_tokens, device=dev)
    figures = common.measure(model, inputs, device=dev, warmup=args.warmup, repeats=args.repeats)
    figures["even"] = parallel_state(model).split.even
    return figures


def run(args) -> list[dict]:
    rows = []
    for mode in args.modes:
        ring = MODES[mode](args.cp)
        if ring is None or args.cp % ring:
            continue  # USP needs cp >= 4 (a ring of 2 Ulysses groups)
        pair = {}
        for label, tokens, text in (
            ("divisible", args.tokens, args.text_tokens),
            ("uneven", args.tokens - 1, args.text_tokens - 1),
        ):
            print(f"running {mode} {label} ({tokens} + {text} tokens) ...", file=sys.stderr, flush=True)
            per_rank = common.launch(_worker, args.cp, ring, tokens, text, args, timeout=args.timeout)
            pair[label] = {
                "tokens": tokens,
                "text_tokens": text,
                "peak": max(r["peak"] for r in per_rank),
                "time": max(r["time"] for r in per_rank),
                "even": all(r["even"] for r in per_rank),
            }
        rows.append({"mode": mode, "ring": ring, **pair})
    return rows


def render(rows: list[dict], args) -> str:
    body = []
    for r in rows:
        d, u = r["divisible"], r["uneven"]
        body.append(
            [
                r["mode"],
                f"{d['tokens']} + {d['text_tokens']}",
                f"{u['tokens']} + {u['text_tokens']}",
                f"{d['time']:.3f}",
                f"{u['time']:.3f}",
                f"{u['time'] / d['time']:.3f}",
                common.mib(d["peak"]),
                common.mib(u["peak"]),
                f"{u['peak'] / d['peak']:.3f}",
            ]
        )
    headers = ["mode", "divisible tokens", "uneven tokens", "step s", "step s (uneven)", "time ratio"]
    headers += ["peak MiB/rank", "peak MiB/rank (uneven)", "memory ratio"]
    title = (
        f"cp={args.cp}, Flux-architecture, {args.layers}+{args.layers} blocks, {args.heads} heads x {args.head_dim}, "
        f"batch 1, fp32, {common.machine_line(common.device())}; step time = median of {args.repeats} after "
        f"{args.warmup} warm-up"
    )
    return title + "\n\n" + common.table(headers, body)


def parse(argv=None):
    parser = argparse.ArgumentParser(description="cost of a sequence length cp does not divide")
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096, help="divisible image tokens; the uneven run uses one less")
    common.add_model_args(parser)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    args = parser.parse_args(argv)
    if args.tokens % args.cp or args.text_tokens % args.cp:
        parser.error(f"--tokens and --text-tokens must be multiples of --cp {args.cp} (the divisible baseline)")
    return args


def main(argv=None) -> list[dict]:
    args = parse(argv)
    rows = run(args)
    print(render(rows, args))
    return rows


if __name__ == "__main__":
    main()

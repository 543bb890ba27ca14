"""Cost of the gathers' general gradient rule against the free slice, on the scaling model.

    python benchmarks/gather_rule.py --cps 2 4 --tokens 8192

For the scaling benchmark's Flux-architecture model and its diffusers plan (one terminal gather at
``proj_out``), one training step is timed under three rules (cp_lightning/gradients.py):

* ``slice``: the free slice, taken without proving it (the engine before the general rule);
* ``proved``: today's engine: each forward walks the autograd graph, proves the slice exact, uses it;
* ``general``: the general rule forced on the same plan (reduce-scatter of the gathered output's
  gradient, root outputs scaled by 1/cp): the cost of the extra collective;

and, as a plan that needs the general rule, ``after``: the model gathered after its last single block
(``norm_out``/``proj_out`` on gathered tokens). Ratios are to ``slice`` at the same cp and mode.
Each configuration runs in a fresh group of processes sharing ``--threads`` CPU threads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

RULES = ("slice", "proved", "general", "after")


def _worker(rank: int, world: int, ring: int, rule: str, args) -> dict:
    from diffusers.models._modeling_parallel import ContextParallelOutput

    from cp_lightning import build_mesh, gradients, parallelize

    if rule in ("slice", "general"):
        forced = rule == "slice"
        gradients.free_slice_is_exact = lambda outputs, record: forced
    dev = common.device()
    model = common.build_model(layers=args.layers, heads=args.heads, head_dim=args.head_dim).to(dev)
    plan = None
    if rule == "after":
        plan = dict(type(model)._cp_plan)
        del plan["proj_out"]
        plan[f"single_transformer_blocks.{args.layers - 1}"] = [
            None,
            ContextParallelOutput(gather_dim=1, expected_dims=3),
        ]
    parallelize(model, mesh=build_mesh(world), ring=ring, plan=plan)
    inputs = common.make_inputs(model, tokens=args.tokens, text_tokens=args.text_tokens, device=dev)
    return common.measure(model, inputs, device=dev, warmup=args.warmup, repeats=args.repeats)


def parse(argv=None):
    parser = argparse.ArgumentParser(description="step time of the general gradient rule against the free slice")
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--modes", nargs="+", choices=("ulysses", "ring"), default=["ulysses", "ring"])
    parser.add_argument("--rules", nargs="+", choices=RULES, default=list(RULES))
    parser.add_argument("--tokens", type=int, default=8192)
    common.add_model_args(parser)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads shared by a configuration's processes")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    rows = []
    for cp in args.cps:
        for mode in args.modes:
            ring = cp if mode == "ring" else 1
            for rule in args.rules:
                threads = max(1, args.threads // cp)
                print(f"running cp={cp} {mode} {rule} ...", file=sys.stderr, flush=True)
                per_rank = common.launch(_worker, cp, ring, rule, args, threads=threads, timeout=args.timeout)
                rows.append(
                    {
                        "cp": cp,
                        "mode": mode,
                        "rule": rule,
                        "time": max(r["time"] for r in per_rank),
                        "cpu": sum(r["cpu"] for r in per_rank),
                        "reduce_scatter": max(r["sent"].get("reduce_scatter", 0) for r in per_rank),
                        "sent": max(sum(r["sent"].values()) for r in per_rank),
                    }
                )
    body = []
    for row in rows:
        base = next((r for r in rows if (r["cp"], r["mode"], r["rule"]) == (row["cp"], row["mode"], "slice")), None)
        body.append(
            [
                row["cp"],
                row["mode"],
                row["rule"],
                f"{row['time']:.3f}",
                f"{row['time'] / base['time']:.2f}" if base else "-",
                f"{row['cpu']:.2f}",
                f"{row['cpu'] / base['cpu']:.2f}" if base else "-",
                common.mib(row["reduce_scatter"]),
                common.mib(row["sent"]),
            ]
        )
    headers = ["cp", "mode", "rule", "step s", "vs slice", "CPU s", "vs slice", "reduce-scatter MiB", "MiB sent/rank"]
    title = (
        f"Flux-architecture, {args.layers}+{args.layers} blocks, {args.heads} heads x {args.head_dim}, batch 1 x "
        f"({args.tokens} + {args.text_tokens}) tokens, fp32, {common.machine_line(common.device())}; step time = "
        f"median of {args.repeats} after {args.warmup} warm-up; CPU s summed over ranks"
    )
    text = title + "\n\n" + common.table(headers, body)
    print("\n" + text + "\n")
    return {"rows": rows, "table": text}


if __name__ == "__main__":
    main()

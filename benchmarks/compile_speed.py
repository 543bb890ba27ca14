"""Compiled against eager step time, in the same run, for Ulysses, ring and USP.

    python benchmarks/compile_speed.py --tokens 1024 --text-tokens 64

Each mode runs in a fresh process group: Ulysses and ring at cp 2, USP (ring 2 x Ulysses 2) at cp 4.
Every rank builds the narrow Flux-architecture transformer of benchmarks/common.py twice (same
weights), parallelizes both, compiles one (``--what blocks``: each repeated block with
``cp_lightning.compile_blocks``, as ``ContextParallelStrategy(compile=...)`` does; ``--what model``:
``torch.compile(model, fullgraph=True)``) with ``--backend`` (inductor by default), warms both up
(the compiled one compiles there), then times eager and compiled training steps *interleaved*, so
that load from other processes hits both alike. Prints a Markdown table: median step seconds of
each and their ratio (compiled / eager; below 1 is faster), plus the compile time.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from benchmarks import common  # noqa: E402

MODES = {"ulysses": (2, 1), "ring": (2, 2), "usp": (4, 2)}  # mode -> (cp, ring)


def _timed(fn, model, inputs, group) -> tuple[float, float]:
    dist.barrier(group)
    start, start_cpu = time.perf_counter(), time.process_time()
    fn(model, inputs)
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start, time.process_time() - start_cpu


def _worker(rank: int, world: int, ring: int, args) -> dict:
    import torch._dynamo

    from cp_lightning import build_mesh, compile_blocks, parallelize

    dev = common.device()
    eager = common.build_model(layers=args.layers, heads=args.heads, head_dim=args.head_dim).to(dev)
    compiled = copy.deepcopy(eager)
    mesh = build_mesh(world)
    for model in (eager, compiled):
        parallelize(model, mesh=mesh, ring=ring)
    if args.what == "blocks":
        compile_blocks(compiled, backend=args.backend)
        run = compiled
    else:
        run = torch.compile(compiled, fullgraph=True, dynamic=False, backend=args.backend)
    inputs = common.make_inputs(eager, tokens=args.tokens, text_tokens=args.text_tokens, device=dev)
    group = mesh["cp"].get_group()

    def step_compiled(_model, batch):
        common.step(run, batch)

    start = time.perf_counter()
    _timed(step_compiled, compiled, inputs, group)  # compiles
    compile_s = time.perf_counter() - start
    for _ in range(args.warmup):
        _timed(common.step, eager, inputs, group)
        _timed(step_compiled, compiled, inputs, group)
    torch._dynamo.config.error_on_recompile = True  # a recompile would be timed as a step
    times = {"eager": [], "compiled": []}
    cpu = {"eager": [], "compiled": []}
    for _ in range(args.repeats):
        for label, fn, model in (("eager", common.step, eager), ("compiled", step_compiled, compiled)):
            wall, used = _timed(fn, model, inputs, group)
            times[label].append(wall)
            cpu[label].append(used)
    return {
        "compile": compile_s,
        **{f"{label}_time": statistics.median(v) for label, v in times.items()},
        **{f"{label}_cpu": statistics.median(v) for label, v in cpu.items()},
    }


def run(args) -> list[dict]:
    rows = []
    for mode in args.modes:
        cp, ring = MODES[mode]
        print(f"running {mode} (cp={cp}, ring={ring}) ...", file=sys.stderr, flush=True)
        per_rank = common.launch(_worker, cp, ring, args, threads=args.threads, timeout=args.timeout)
        row = {"mode": mode, "cp": cp, "ring": ring}
        for key in per_rank[0]:
            row[key] = max(r[key] for r in per_rank)  # the slowest rank sets the step time
        rows.append(row)
    return rows


def render(rows: list[dict], args) -> str:
    body = [
        [
            r["mode"],
            r["cp"],
            r["ring"],
            f"{r['eager_time']:.3f}",
            f"{r['compiled_time']:.3f}",
            f"{r['compiled_time'] / r['eager_time']:.2f}",
            f"{r['compiled_cpu'] / r['eager_cpu']:.2f}",
            f"{r['compile']:.0f}",
        ]
        for r in rows
    ]
    headers = ["mode", "cp", "ring", "eager step s", "compiled step s", "time ratio", "CPU-time ratio", "compile s"]
    title = (
        f"torch.compile ({args.backend}, {args.what}, fullgraph) against eager, Flux-architecture "
        f"{args.layers}+{args.layers} blocks, {args.heads} heads x {args.head_dim}, {args.tokens} + "
        f"{args.text_tokens} tokens, batch 1, fp32, {args.threads} thread(s) per rank, "
        f"{common.machine_line(common.device())}; median of {args.repeats} interleaved steps after "
        f"{args.warmup} warm-up"
    )
    return title + "\n\n" + common.table(headers, body)


def parse(argv=None):
    parser = argparse.ArgumentParser(description="compiled vs eager step time under CP")
    parser.add_argument("--tokens", type=int, default=1024)
    common.add_model_args(parser)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--what", choices=["blocks", "model"], default="blocks")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--threads", type=int, default=1)
    parser.set_defaults(text_tokens=64, repeats=5)
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse(argv)
    rows = run(args)
    print(render(rows, args))
    return rows


if __name__ == "__main__":
    main()

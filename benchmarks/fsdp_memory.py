"""FSDP2 against DDP at world 4: per-rank bytes of training state, peak memory and time of a training step.

    python benchmarks/fsdp_memory.py                          # CPU: a fresh group of 4 processes per row
    torchrun --nproc-per-node 4 benchmarks/fsdp_memory.py     # the launched processes (nccl on CUDA)

For dp x cp = 2 x 2 and 1 x 4 and each data-parallel wrapping (DDP with the exact SUM-cp/MEAN-dp hook;
FSDP2 over the flattened dp x cp mesh; HSDP: shard over cp, replicate over dp), the scaling benchmark's
narrow Flux-architecture transformer is parallelized, wrapped and trained with AdamW for a warm-up step.
Then it reports, per rank:

- state: bytes of parameters + gradients + AdamW state this rank holds (local shards for FSDP/HSDP),
  and its ratio to DDP's at the same layout (ideal FSDP at world 4: 0.25, plus FSDP's padding);
- peak: the memory a whole training step (forward, backward, optimizer step) adds above what is held
  before it (see benchmarks/common.py for how it is measured on CPU and CUDA);
- state + peak: the per-rank high-water mark of a step, and its ratio to DDP's;
- time: the median wall time of that step, and its ratio to DDP's at the same layout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

WORLD = 4
MODES = ("ddp", "fsdp", "hsdp")


def _local(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def state_bytes(model, optimizer) -> dict:
    """Bytes this rank holds: parameters, gradients, optimizer state (local shards of DTensors)."""
    params = [p for p in model.parameters()]
    opt = sum(_local(v) for s in optimizer.state.values() for v in s.values() if hasattr(v, "numel") and v.dim())
    return {
        "params": sum(_local(p) for p in params),
        "grads": sum(_local(p.grad) for p in params if p.grad is not None),
        "optimizer": opt,
    }


def _run(model, inputs, optimizer):
    out = model(**inputs, return_dict=False)[0]
    out.float().square().mean().backward()
    optimizer.step()


def _config(cp: int, mode: str, args) -> dict:
    import torch

    from cp_lightning import build_mesh, data_parallel, parallelize, sharding

    dev = common.device()
    model = common.build_model(layers=args.layers, heads=args.heads, head_dim=args.head_dim).to(dev)
    mesh = build_mesh(cp, device_type=dev.type)
    parallelize(model, mesh=mesh)
    if mode == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        data_parallel.register_ddp_hook(wrapped, mesh["dp"].size(), loss_parallel=False)
    else:
        options = sharding.FSDPOptions(hsdp=mode == "hsdp")
        wrapped = sharding.apply_fsdp(model, mesh=mesh, plan=None, options=options, loss_parallel=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs = common.make_inputs(model, tokens=args.tokens, text_tokens=args.text_tokens, device=dev)
    _run(wrapped, inputs, optimizer)  # the optimizer state exists from here on
    held = state_bytes(model, optimizer)

    def run(m, i):  # measure() zeroes the gradients between steps
        _run(m, i, optimizer)

    result = common.measure(wrapped, inputs, device=dev, warmup=args.warmup, repeats=args.repeats, run=run)
    return {"cp": cp, "mode": mode, **held, "peak": result["peak"], "time": result["time"], "cpu": result["cpu"]}


def configurations(args) -> list[tuple[int, str]]:
    return [(cp, mode) for cp in args.cps for mode in args.modes]


def _worker(rank: int, world: int, configs: list, args) -> list[dict]:
    return [_config(cp, mode, args) for cp, mode in configs]


def _row(per_rank: list[dict]) -> dict:
    first = per_rank[0]
    state = max(r["params"] + r["grads"] + r["optimizer"] for r in per_rank)
    return {
        "cp": first["cp"],
        "mode": first["mode"],
        "state": state,
        "params": max(r["params"] for r in per_rank),
        "peak": max(r["peak"] for r in per_rank),
        "time": max(r["time"] for r in per_rank),
        "cpu": sum(r["cpu"] for r in per_rank),
    }


def render(rows: list[dict], args) -> str:
    ddp = {r["cp"]: r for r in rows if r["mode"] == "ddp"}
    body = []
    for r in rows:
        base = ddp.get(r["cp"])
        body.append(
            [
                f"{WORLD // r['cp']} x {r['cp']}",
                r["mode"],
                common.mib(r["params"]),
                common.mib(r["state"]),
                f"{r['state'] / base['state']:.3f}" if base else "-",
                common.mib(r["peak"]),
                common.mib(r["state"] + r["peak"]),
                f"{(r['state'] + r['peak']) / (base['state'] + base['peak']):.3f}" if base else "-",
                f"{r['time']:.3f}",
                f"{r['time'] / base['time']:.2f}" if base else "-",
                f"{r['cpu']:.2f}",
            ]
        )
    headers = [
        "dp x cp",
        "wrapping",
        "params MiB/rank",
        "params+grads+AdamW MiB/rank",
        "vs DDP",
        "step peak MiB",
        "state + peak MiB",
        "vs DDP",
        "step s",
        "time vs DDP",
        "CPU s (all ranks)",
    ]
    note = (
        f"world {WORLD}, {args.tokens} image + {args.text_tokens} text tokens, {args.layers}+{args.layers} blocks, "
        f"{args.heads} heads x {args.head_dim}; {common.machine_line(common.device())}"
    )
    return note + "\n\n" + common.table(headers, body)


def parse(argv=None):
    parser = argparse.ArgumentParser(description="FSDP2 vs DDP: per-rank state bytes, step peak memory and time")
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--one-group", action="store_true", help="run every row in one process group (faster)")
    common.add_model_args(parser)
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    configs = configurations(args)
    if common.under_torchrun():
        import torch.distributed as dist

        common.init_torchrun(None)
        if dist.get_world_size() != WORLD:
            raise ValueError(f"this benchmark compares layouts of world {WORLD}; launch --nproc-per-node {WORLD}.")
        per_config = [common.gather_results(_config(cp, mode, args)) for cp, mode in configs]
        rank = dist.get_rank()
        dist.destroy_process_group()
        rows = [_row(p) for p in per_config]
        if rank != 0:
            return {"rows": rows}
    elif args.one_group:
        per_rank = common.launch(_worker, WORLD, configs, args, timeout=args.timeout)
        rows = [_row([r[i] for r in per_rank]) for i in range(len(configs))]
    else:
        rows = []
        for config in configs:
            print(f"running dp x cp = {WORLD // config[0]} x {config[0]}, {config[1]} ...", file=sys.stderr, flush=True)
            per_rank = common.launch(_worker, WORLD, [config], args, timeout=args.timeout)
            rows.append(_row([r[0] for r in per_rank]))
    text = render(rows, args)
    print("\n" + text + "\n")
    return {"rows": rows, "table": text}


if __name__ == "__main__":
    main()

"""Demo: a tiny diffusers transformer under context parallelism, checked against one process.

Launch with torchrun (CPU, gloo)::

    torchrun --nproc-per-node 2 -m cp_lightning.demo --model flux

Every rank builds the same random-init model and batch. Rank 0 also runs the plain model as the
single-process reference. The CP copy runs forward and backward with its sequence split across
the ranks; the demo prints how far the gathered output and the CP-summed gradients are from the
reference, and exits non-zero if they are outside the fp32 tolerances (1e-5, 1e-4 relative).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.distributed as dist

from cp_lightning import build_mesh, parallelize
from cp_lightning.tiny import MODELS, tiny_inputs, tiny_model


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="flux")
    parser.add_argument("--tokens", type=int, default=64, help="image/video tokens per sample")
    parser.add_argument("--text-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--cp", type=int, default=None, help="context-parallel degree (default: all processes)")
    return parser.parse_args(argv)


def _step(model, inputs):
    start = time.perf_counter()
    out = model(**inputs, return_dict=False)[0]
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    (out * weights).sum().backward()
    return out.detach(), time.perf_counter() - start


def main(argv=None) -> int:
    args = _parse(argv)
    if "RANK" not in os.environ:
        print("launch me with torchrun, e.g.: torchrun --nproc-per-node 2 -m cp_lightning.demo", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        cp = args.cp or world
        reference = tiny_model(args.model)
        model = copy.deepcopy(reference)
        inputs = tiny_inputs(args.model, reference, batch=args.batch, tokens=args.tokens, text_tokens=args.text_tokens)

        mesh = build_mesh(cp)
        parallelize(model, mesh=mesh)
        out, cp_time = _step(model, inputs)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        for g in grads:
            dist.all_reduce(g, group=mesh["cp"].get_group())
        if rank != 0:
            return 0
        ref_out, ref_time = _step(reference, inputs)
        out_err = (out - ref_out).abs().max().item()
        grad_err = max(
            ((g - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)).item()
            for g, p in zip(grads, reference.parameters(), strict=True)
            if p.grad is not None
        )
        ok = out_err <= 1e-5 and grad_err <= 1e-4
        print(
            f"\n{args.model} ({sum(p.numel() for p in reference.parameters()):,} parameters), batch {args.batch} x "
            f"{args.tokens} tokens, cp={cp} of {world} processes (Ulysses, gloo)\n"
        )
        print("| check | value | tolerance |")
        print("|---|---|---|")
        print(f"| max abs error, gathered output | {out_err:.2e} | 1e-05 |")
        print(f"| max relative error, CP-summed gradients | {grad_err:.2e} | 1e-04 |")
        print(f"| step time, one process / CP rank 0 | {ref_time:.2f} s / {cp_time:.2f} s | |")
        print(f"\n{'AGREES' if ok else 'DISAGREES'} with single-process training math.")
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

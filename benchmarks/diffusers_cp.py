"""Head to head: cp_lightning's context parallelism against diffusers' own, on the same step.

    python benchmarks/diffusers_cp.py --cps 2 4 --tokens 8192
    torchrun --nproc-per-node 4 benchmarks/diffusers_cp.py --tokens 32768      # one cp = 4 (nccl on CUDA)

Same model (the narrow Flux of benchmarks/scaling.py), same inputs, same cp; one forward+backward.
For each cp, Ulysses and ring, each run by cp_lightning (``parallelize``) and by diffusers' hooks and
templated attention. Reports per-rank peak memory, step time (median after warm-up) and bytes sent.

Working around diffusers on CPU, here and nowhere in the package (DESIGN.md section 6):
- ``enable_parallelism`` raises ZeroDivisionError on a CPU-only host (``rank % device_count()``), so
  :func:`apply_diffusers_cp` does its steps by hand: builds the ("ring", "ulysses") mesh and the
  ContextParallelConfig / ParallelConfig, sets the config on every attention processor and installs
  diffusers' split/gather hooks with its own ``apply_context_parallel``.
- diffusers' ring needs an attention backend that returns the log-sum-exp, and its default
  ("native", the only one on CPU) backend does not. :func:`_native_with_lse` gives diffusers' own ring algorithm
  (``TemplatedRingAttention``: all-gather K/V up front, merge, accumulator ring in backward) the
  same CPU flash kernel cp_lightning's ring uses, so the two rings differ only in algorithm.
  Note: diffusers' ring backward passes dK/dV accumulators to rank r+1 where they belong at r-1, so
  its K/V gradients are wrong at ring degree >= 3 (DESIGN.md section 6); it is timed here regardless.
- diffusers' collectives do not report to ``cp_lightning.collectives.count_bytes``; :func:`_count_diffusers_bytes`
  wraps the functional collectives it calls, counting the way cp_lightning does (an all-to-all
  sends (P-1)/P of its input, an all-gather P-1 copies of the local shard, a permute one copy).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import common  # noqa: E402

IMPLS = ("cp_lightning", "diffusers")
MODES = ("ulysses", "ring")


# ----- diffusers, by hand ---------------------------------------------------------------------------


def apply_diffusers_cp(model, *, cp: int, ring: int, device: torch.device) -> None:
    """What ``model.enable_parallelism(config=ContextParallelConfig(...))`` does, minus its CPU crash."""
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    cp_config = ContextParallelConfig(ring_degree=ring, ulysses_degree=cp // ring)
    config = ParallelConfig(context_parallel_config=cp_config)
    mesh = init_device_mesh(device.type, cp_config.mesh_shape, mesh_dim_names=cp_config.mesh_dim_names)
    config.setup(dist.get_rank(), dist.get_world_size(), device, mesh=mesh)
    model._parallel_config = config
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = config
    apply_context_parallel(model, cp_config, model._cp_plan)
    if ring > 1:  # on CUDA too: both rings then run the same local kernel (cp_lightning.kernels.pick_kernel)
        _native_with_lse()
    _count_diffusers_bytes()


def _lse_forward_op(
    ctx,
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    return_lse=False,
    _save_ctx=True,
    _parallel_config=None,
):
    """diffusers' forward-op contract on (B, S, H, D) tensors, with cp_lightning's CPU LSE kernel."""
    from cp_lightning.kernels import pick_kernel

    if attn_mask is not None or dropout_p or is_causal or enable_gqa:
        raise ValueError("this benchmark's LSE op runs plain attention only")
    kernel = pick_kernel(query.device, query.dtype, False)
    if _save_ctx:
        ctx.save_for_backward(query, key, value)
        ctx.lse_kernel, ctx.lse_scale = kernel, scale
    # B, S, H, D -> B, H, S, D for the kernel; out back to B, S, H, D and lse B, H, S -> B, S, H
    out, lse = kernel.forward(*(t.transpose(1, 2) for t in (query, key, value)), None, scale)
    out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    return (out, lse) if return_lse else out


def _lse_backward_op(ctx, grad_out, *args, query, key, value, out, lse, **kwargs):
    """diffusers' backward-op contract: (dq, dk, dv) in (B, S, H, D) for one K/V block, given the final out/lse."""
    # all B, S, H, D -> B, H, S, D; lse B, S, H -> B, H, S
    dq, dk, dv = ctx.lse_kernel.backward(
        grad_out.transpose(1, 2),
        *(t.transpose(1, 2) for t in (query, key, value, out)),
        lse.transpose(1, 2).contiguous(),
        None,
        ctx.lse_scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _native_with_lse() -> None:
    """Route diffusers' native backend's ring attention through :func:`_lse_forward_op` (this process only)."""
    from diffusers.models import attention_dispatch as ad

    registry, name = ad._AttentionBackendRegistry, ad.AttentionBackendName.NATIVE
    original = registry._backends[name]
    if getattr(original, "_benchmark_lse", False):
        return

    def native(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
        return_lse=False,
        _parallel_config=None,
    ):
        if _parallel_config is None or _parallel_config.context_parallel_config.ring_degree == 1:
            return original(
                query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, _parallel_config
            )
        return ad._templated_context_parallel_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
            forward_op=_lse_forward_op, backward_op=_lse_backward_op, _parallel_config=_parallel_config,
        )  # fmt: skip

    native._benchmark_lse = True
    registry._backends[name] = native


def _group_size(group) -> int:
    return dist.get_world_size(group) if isinstance(group, dist.ProcessGroup) else group.size()  # or a DeviceMesh


def _count_diffusers_bytes() -> None:
    """Make diffusers' collectives report to ``count_bytes`` (this process only)."""
    import torch.distributed._functional_collectives as funcol

    from cp_lightning.collectives import record_sent

    if getattr(funcol, "_benchmark_counted", False):
        return
    warnings.filterwarnings("ignore", message=".*all_gather_tensor.* is deprecated")
    all_to_all, all_gather, permute = funcol.all_to_all_single, funcol.all_gather_tensor, funcol.permute_tensor

    in_permute = []  # torch implements permute_tensor with all_to_all_single: count it once

    def all_to_all_single(x, output_split_sizes, input_split_sizes, group, *args, **kwargs):
        if not in_permute:
            world = _group_size(group)
            record_sent("all_to_all", x.numel() * x.element_size() * (world - 1) // world)
        return all_to_all(x, output_split_sizes, input_split_sizes, group, *args, **kwargs)

    def all_gather_tensor(x, gather_dim, group, *args, **kwargs):
        record_sent("all_gather", x.numel() * x.element_size() * (_group_size(group) - 1))
        return all_gather(x, gather_dim, group, *args, **kwargs)

    def permute_tensor(x, src_dst, group, *args, **kwargs):
        record_sent("permute", x.numel() * x.element_size())
        in_permute.append(True)
        try:
            return permute(x, src_dst, group, *args, **kwargs)
        finally:
            in_permute.pop()

    funcol.all_to_all_single, funcol.all_gather_tensor, funcol.permute_tensor = (
        all_to_all_single,
        all_gather_tensor,
        permute_tensor,
    )
    funcol._benchmark_counted = True


# ----- the benchmark --------------------------------------------------------------------------------


def _run(world: int, variant: tuple[str, str], args) -> dict:
    from cp_lightning import build_mesh, parallelize

    impl, mode = variant
    ring = world if mode == "ring" else 1
    dev = common.device()
    model = common.build_model(layers=args.layers, heads=args.heads, head_dim=args.head_dim).to(dev)
    if impl == "cp_lightning":
        parallelize(model, mesh=build_mesh(world), ring=ring)
    else:
        apply_diffusers_cp(model, cp=world, ring=ring, device=dev)
    inputs = common.make_inputs(model, tokens=args.tokens, text_tokens=args.text_tokens, device=dev)
    try:
        return common.measure(model, inputs, device=dev, warmup=args.warmup, repeats=args.repeats)
    finally:
        del model, inputs


def _worker(rank: int, world: int, variants: list[tuple[str, str]], args) -> list[dict]:
    return [_run(world, variant, args) for variant in variants]


def variants(args) -> list[tuple[str, str]]:
    return [(impl, mode) for mode in args.modes for impl in IMPLS]


def _row(cp: int, variant: tuple[str, str], per_rank: list[dict]) -> dict:
    return {
        "cp": cp,
        "impl": variant[0],
        "mode": variant[1],
        "peak": max(r["peak"] for r in per_rank),
        "time": max(r["time"] for r in per_rank),
        "cpu": sum(r["cpu"] for r in per_rank),
        "sent": max(sum(r["sent"].values()) for r in per_rank),
    }


def render(rows: list[dict], args) -> str:
    body = []
    for r in rows:
        other = next(
            (o for o in rows if o["cp"] == r["cp"] and o["mode"] == r["mode"] and o["impl"] == "diffusers"), None
        )
        peak, time, cpu, sent = (f"{r[k] / other[k]:.2f}" if other else "-" for k in ("peak", "time", "cpu", "sent"))
        body.append(
            [r["cp"], r["mode"], r["impl"], common.mib(r["peak"]), peak, f"{r['time']:.2f}", time]
            + [f"{r['cpu']:.1f}", cpu, common.mib(r["sent"]), sent]
        )
    headers = ["cp", "mode", "impl", "peak MiB/rank", "vs diffusers", "step s", "vs diffusers"]
    headers += ["CPU s", "vs diffusers", "MiB sent/rank", "vs diffusers"]
    title = (
        f"Flux-architecture, {args.layers}+{args.layers} blocks, {args.heads} heads x {args.head_dim}, batch 1 x "
        f"({args.tokens} + {args.text_tokens}) tokens, fp32, {common.machine_line(common.device())}, one thread per "
        f"process; step time = median of {args.repeats} after {args.warmup} warm-up; CPU s = the step's CPU "
        "seconds summed over ranks"
    )
    return title + "\n\n" + common.table(headers, body)


def parse(argv=None):
    parser = argparse.ArgumentParser(description="cp_lightning vs diffusers' context parallelism on one step")
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--tokens", type=int, default=8192)
    common.add_model_args(parser)
    parser.add_argument(
        "--one-group", action="store_true", help="run every variant of a cp in one group (faster; for tests)"
    )
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    rows = []
    if common.under_torchrun():
        common.init_torchrun(None)
        cp = dist.get_world_size()
        for variant in variants(args):
            rows.append(_row(cp, variant, common.gather_results(_run(cp, variant, args))))
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return {"rows": rows}
    else:
        for cp in args.cps:
            groups = [variants(args)] if args.one_group else [[v] for v in variants(args)]
            for group in groups:
                print(f"running cp={cp} {group} ...", file=sys.stderr, flush=True)
                per_rank = common.launch(_worker, cp, group, args, threads=1, timeout=args.timeout)
                rows += [_row(cp, v, [r[i] for r in per_rank]) for i, v in enumerate(group)]
    text = render(rows, args)
    print("\n" + text + "\n")
    return {"rows": rows, "table": text}


if __name__ == "__main__":
    main()

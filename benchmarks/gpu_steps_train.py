"""The training steps of benchmarks/gpu_check.py: fp8 linear, one end-to-end step, loading, and 2+ GPUs.

Each step is ``step(ctx) -> dict`` as in benchmarks/gpu_steps.py. The multi-GPU step launches
``torchrun`` with this file as the worker (``--parity-worker``): Ulysses, ring and USP on the tiny models
over NCCL against one process, then the scaling benchmark.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_steps import FP32_TOL, sync, timed, world_of_one  # noqa: E402

# ----- step 7: fp8 linear against bf16 ---------------------------------------------------------------


def fp8(ctx) -> dict:
    """A frozen FP8Linear (per-channel scales, upcast in forward and backward) against the bf16 linear it
    replaces: forward+backward time, and its error against the dequantized weight's exact product."""
    from cp_lightning.fp8 import FP8Linear, dequantize_fp8

    dev, cpu = ctx.device, ctx.cpu
    tokens, d_in, d_out = (64, 128, 256) if cpu else (4608, 3072, 12288)  # Flux's feed-forward at 1024 px
    dtype = torch.float32 if cpu else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    base = nn.Linear(d_in, d_out).to(dev, dtype).requires_grad_(False)
    with torch.no_grad():
        base.weight.copy_(torch.randn(d_out, d_in, generator=g) * 0.02)
    fp8_layer = FP8Linear.from_linear(copy.deepcopy(base), compute_dtype=dtype)
    x = torch.randn(tokens, d_in, generator=g).to(dev, dtype).requires_grad_()
    dout = torch.randn(tokens, d_out, generator=g).to(dev, dtype)

    def step(layer):
        x.grad = None
        layer(x).backward(dout)

    repeats = 1 if cpu else 10
    t_base, t_fp8 = timed(lambda: step(base), dev, repeats), timed(lambda: step(fp8_layer), dev, repeats)
    weight = dequantize_fp8(fp8_layer.weight.detach(), fp8_layer.weight_scale.detach(), torch.float64)
    exact = x.detach().double() @ weight.T + base.bias.double()
    out = fp8_layer(x.detach()).double()
    rel = ((out - exact).abs().max() / exact.abs().max()).item()
    weight_rel = ((weight - base.weight.double()).abs().max() / base.weight.double().abs().max()).item()
    bound = FP32_TOL["out"] if dtype == torch.float32 else 2e-2
    return {"ok": rel <= bound, "shape": [tokens, d_in, d_out], "dtype": str(dtype)[6:],
            "bf16_ms" if not cpu else "fp32_ms": t_base * 1e3, "fp8_ms": t_fp8 * 1e3, "fp8_vs_base": t_fp8 / t_base,
            "out_rel_err_vs_dequantized": rel, "bound": bound, "weight_rel_err_fp8": weight_rel}  # fmt: skip


# ----- step 8: one end-to-end step at world 1 ----------------------------------------------------------


def e2e(ctx) -> dict:
    """A Flux-architecture model through the whole stack at world 1: parallelize, gradient checkpointing with
    activation offload, fp8 frozen base, FSDP2, two optimizer steps (and, on CUDA, the same with torch.compile
    instead of offload: the two do not combine, see offload.check_offload_option)."""
    import torch.distributed as dist

    from benchmarks import common
    from cp_lightning import build_mesh, parallelize, to_fp8_base
    from cp_lightning.compilation import compile_blocks
    from cp_lightning.offload import apply_activation_offload
    from cp_lightning.sharding import FSDPOptions, apply_fsdp

    dev, cpu = ctx.device, ctx.cpu
    world_of_one(dev)
    variants = ["offload"] if cpu else ["offload", "compile"]
    layers, heads, dim, tokens, text = (1, 2, 16, 64, 8) if cpu else (2, 24, 128, 4096, 512)
    rows, ok = [], True
    try:
        for variant in variants:
            model = common.build_model(layers=layers, heads=heads, head_dim=dim)
            for name, module in model.named_modules():  # a LoRA-like run: the blocks' linear weights frozen
                if isinstance(module, nn.Linear) and "blocks" in name:
                    module.weight.requires_grad_(False)
            # fp8 under torch.compile needs Triton's fp8e4nv: sm89+ (DESIGN.md section 9.4)
            fp8_base = cpu or variant == "offload" or torch.cuda.get_device_capability(dev) >= (8, 9)
            if fp8_base:
                to_fp8_base(model, compute_dtype=None if cpu else torch.bfloat16)
            model.to(dev)
            model.enable_gradient_checkpointing()
            mesh = build_mesh(1)
            parallelize(model, mesh=mesh)
            if variant == "offload":
                apply_activation_offload(model)
            else:
                compile_blocks(model)
            param_dtype = None if cpu else torch.bfloat16
            apply_fsdp(model, mesh=mesh, plan=None, options=FSDPOptions(param_dtype=param_dtype), loss_parallel=False)
            trainable = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(trainable, lr=1e-4)
            inputs = common.make_inputs(model, tokens=tokens, text_tokens=text, device=dev)
            times, losses = [], []
            for _ in range(2):
                start = time.perf_counter()
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=not cpu):
                    out = model(**inputs, return_dict=False)[0]
                loss = out.float().square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                sync(dev)
                times.append(time.perf_counter() - start)
                losses.append(loss.item())
            finite = all(torch.isfinite(torch.tensor(losses)).tolist())
            ok &= finite
            row = dict(variant=variant, fp8_base=fp8_base, tokens=tokens, layers=layers, first_step_s=times[0],
                       second_step_s=times[1], losses=losses, finite=finite,
                       trainable=sum(p.numel() for p in trainable))  # fmt: skip
            if dev.type == "cuda":
                row["peak_mib"] = torch.cuda.max_memory_allocated(dev) / 2**20
                torch.cuda.reset_peak_memory_stats(dev)
            rows.append(row)
            del model, opt
    finally:
        dist.destroy_process_group()
    return {"ok": ok, "rows": rows}


# ----- step 9: loading onto the device ------------------------------------------------------------------


def loading(ctx) -> dict:
    """A Flux-architecture model saved in fp32 safetensors, built on meta and loaded onto the device in bf16
    (cast there) and as an fp8 base (quantized there): bytes read per second, checked against the files."""
    from diffusers import FluxTransformer2DModel

    from benchmarks import common
    from cp_lightning import loading as load
    from cp_lightning import to_fp8_base

    dev, cpu = ctx.device, ctx.cpu
    layers, heads, dim = (1, 2, 16) if cpu else (2, 24, 128)
    rows, ok = [], True
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        common.build_model(layers=layers, heads=heads, head_dim=dim).save_pretrained(tmp, safe_serialization=True)
        nbytes = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))
        reference = FluxTransformer2DModel.from_pretrained(tmp)
        for variant in ("bf16", "fp8"):
            model = load.empty_model(FluxTransformer2DModel, tmp, dtype=torch.bfloat16)
            if variant == "fp8":
                model.requires_grad_(False)
                to_fp8_base(model, compute_dtype=torch.bfloat16, exclude=["proj_out"])
            sync(dev)
            start = time.perf_counter()
            load.materialize(model, dev)
            sync(dev)
            seconds = time.perf_counter() - start
            name = "proj_out.weight"
            got = dict(model.named_parameters())[name].detach().float().cpu()
            want = dict(reference.named_parameters())[name].detach().bfloat16().float()
            good = torch.equal(got, want)  # an unconverted layer: exactly the file's value in bf16
            ok &= good
            rows.append(dict(variant=variant, file_mib=nbytes / 2**20, seconds=seconds,
                             gib_per_s=nbytes / seconds / 2**30, proj_out_exact=good))  # fmt: skip
            del model
    return {"ok": ok, "rows": rows}


# ----- step 10: 2+ GPUs: NCCL parity of every mode, then the scaling benchmark ----------------------------


def multi_gpu(ctx) -> dict:
    """Under torchrun on every GPU (2 gloo processes on CPU): the tiny models in Ulysses, ring and USP against one
    process, then benchmarks/scaling.py. The step's timeout covers both launches; a timeout kills the workers
    too (they run in sessions of their own: gpu_check kills the whole process tree)."""
    nproc = 2 if ctx.cpu else min(torch.cuda.device_count(), 8)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result_file = ctx.out / "multi_gpu_parity.json"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    worker = [*launch, str(Path(__file__)), "--parity-worker", str(result_file)]
    if ctx.cpu:
        worker += ["--models", "flux"]
    code = subprocess.run(worker, cwd=ROOT, env=env).returncode
    parity = json.loads(result_file.read_text()) if result_file.exists() else {"rows": [], "ok": False}
    out = {"ok": code == 0 and parity["ok"], "parity_exit": code, "parity": parity, "nproc": nproc}
    if not ctx.cpu:
        plot = ctx.out / "scaling.png"
        scaling = [*launch, str(ROOT / "benchmarks" / "scaling.py"), "--plot", str(plot)]
        out["scaling_exit"] = subprocess.run(scaling, cwd=ROOT, env=env).returncode
        out["ok"] &= out["scaling_exit"] == 0
    return out


def parity_worker(result_file: str, models: list[str] | None) -> int:
    """Under torchrun: every tiny model in every mode the world allows, even and uneven lengths; rank 0 writes
    the rows. Each row records the ring degree the parallelized model actually runs (not just the one asked)."""
    import torch.distributed as dist

    from benchmarks import common
    from cp_lightning import build_mesh, parallelize
    from cp_lightning.parallelize import parallel_state
    from cp_lightning.tiny import MODELS, tiny_inputs, tiny_model

    common.init_torchrun(1)
    world, rank, dev = dist.get_world_size(), dist.get_rank(), common.device()
    modes = [("ulysses", 1), ("ring", world)] + ([("usp", 2)] if world >= 4 and world % 2 == 0 else [])
    rows, ok = [], True
    for model_name in models or sorted(MODELS):
        for mode, ring in modes:
            for tokens in (64, 61):
                reference = tiny_model(model_name).to(dev)
                model = parallelize(copy.deepcopy(reference), mesh=build_mesh(world), ring=ring)
                ring_size = parallel_state(model).groups.ring_size
                inputs = tiny_inputs(model_name, reference, batch=2, tokens=tokens)
                inputs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
                out = model(**inputs, return_dict=False)[0]
                weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(dev)
                (out * weights).sum().backward()
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
                for g in grads:
                    dist.all_reduce(g)
                ref_out = reference(**inputs, return_dict=False)[0]
                (ref_out * weights).sum().backward()
                out_err = (out - ref_out).abs().max().item()
                grad_err = max(
                    ((g - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)).item()
                    for g, p in zip(grads, reference.parameters(), strict=True)
                    if p.grad is not None
                )
                good = out_err <= FP32_TOL["out"] and grad_err <= FP32_TOL["grad"] and ring_size == ring
                ok &= good
                rows.append(dict(model=model_name, mode=mode, ulysses=world // ring, ring=ring_size, tokens=tokens,
                                 out_err=out_err, grad_err=grad_err, ok=good))  # fmt: skip
    backend = dist.get_backend()
    dist.destroy_process_group()
    if rank == 0:
        Path(result_file).write_text(json.dumps({"backend": backend, "world": world, "ok": ok, "rows": rows}))
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--parity-worker"]:
        models = sys.argv[sys.argv.index("--models") + 1 :] if "--models" in sys.argv else None
        sys.exit(parity_worker(sys.argv[2], models))
    sys.exit("usage: run through benchmarks/gpu_check.py")

"""One script for the first CUDA machine: are the CUDA attention kernels right, how fast are they, and
do Ulysses, ring and USP agree with one process over NCCL?

    python benchmarks/gpu_check.py             # on a machine with one or more CUDA GPUs (< 5 min on one H200)
    python benchmarks/gpu_check.py --dry-run   # CPU: every step but the CUDA calls (CI runs it)

It prints three Markdown tables (paste them into docs/benchmarks.md):

1. accuracy: every CUDA kernel (``cuda_efficient``, ``cuda_flash``, and ``flash_attn`` when the
   flash-attn package is importable), forward and backward, fp32 and bf16, S_q in {64, 33, 4103},
   with and without a key mask, called once on the whole sequence and merged block by block the way
   the ring merges (a ring simulated in one process); errors against fp64 attention, next to the
   CPU tolerances (fp32: outputs 1e-5, gradients 1e-4 relative) and, for bf16, next to plain bf16
   SDPA's own error;
2. speed: forward+backward TFLOP/s of one ring rank's work (S/P queries over P key blocks) at
   Flux-like shapes (B=1, H=24, D=128, 4096 and 16384 tokens, P in {2, 4, 8}) against plain
   ``F.scaled_dot_product_attention`` on the whole sequence;
3. with 2+ GPUs: NCCL parity of Ulysses, ring and USP on the test suite's tiny models (even and
   uneven lengths), then the scaling benchmark (benchmarks/scaling.py) under torchrun.

In ``--dry-run`` the CPU stands in: the kernels are ``cpu_flash`` and ``math``, shapes are small,
and part 3 runs on 2 gloo processes. Exit status: non-zero when any check is outside tolerance.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cp_lightning.kernels import KERNELS, Kernel  # noqa: E402
from cp_lightning.ring import _masked_lse, merge  # noqa: E402

NEEDS = (
    "needs: torch with CUDA and one or more CUDA GPUs (NCCL for part 3, 2+ GPUs); the project's own "
    "dependencies; optional: flash-attn >= 2.7 (its kernel is checked when importable)"
)
FP32_TOL = {"out": 1e-5, "grad": 1e-4}


# ----- one-process references ---------------------------------------------------------------------


def reference_attention(q, k, v, bias, dout):
    """(out, dq, dk, dv) of attention in fp64 with torch's math backend, through autograd."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qf, kf, vf = (t.detach().double().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=None if bias is None else bias.double())
    out.backward(dout.double())
    return out.detach(), qf.grad, kf.grad, vf.grad


def simulated_ring(kernel: Kernel, q, k, v, bias, dout, blocks: int):
    """(out, dq, dk, dv) of ring attention in one process: K/V (and the mask) cut into ``blocks`` blocks of
    unequal length when ``blocks`` does not divide S_k, each held as the ring holds it (a contiguous
    B, S, H, D block seen as B, H, S, D), forward merged by LSE, backward re-run per block with the final
    output and LSE, exactly as cp_lightning.ring does across ranks."""
    pieces = [
        (
            kb.transpose(1, 2).contiguous().transpose(1, 2),
            vb.transpose(1, 2).contiguous().transpose(1, 2),
            None if bias is None else bb.contiguous(),
        )
        for kb, vb, bb in zip(
            k.tensor_split(blocks, dim=2),
            v.tensor_split(blocks, dim=2),
            [None] * blocks if bias is None else bias.tensor_split(blocks, dim=-1),
            strict=True,
        )
    ]
    out = lse = None
    for kb, vb, bb in pieces:
        block_out, block_lse = kernel.forward(q, kb, vb, bb, None)
        out, lse = merge(out, lse, block_out, _masked_lse(block_lse, bb))
    out = out.to(q.dtype)
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
    dq = torch.zeros_like(q, dtype=torch.float32)
    dks, dvs = [], []
    for kb, vb, bb in pieces:
        dq_b, dk_b, dv_b = kernel.backward(dout, q, kb, vb, out, lse, bb, None)
        dq += dq_b.float()
        dks.append(dk_b)
        dvs.append(dv_b)
    return out, dq.to(q.dtype), torch.cat(dks, dim=2), torch.cat(dvs, dim=2)


def _inputs(batch, heads, s_q, s_k, dim, dtype, device, masked, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q, k, v = rand(batch, heads, s_q, dim), rand(batch, heads, s_k, dim), rand(batch, heads, s_k, dim)
    dout = rand(batch, heads, s_q, dim)
    bias = None
    if masked:  # per-sample key padding: sample b keeps its first s_k - 5 b keys (padded text)
        keep = torch.arange(s_k).unsqueeze(0) < torch.tensor([s_k - 5 * b for b in range(batch)]).unsqueeze(1)
        bias = torch.zeros(batch, 1, 1, s_k).masked_fill(~keep[:, None, None], float("-inf")).to(device, dtype)
    return q, k, v, bias, dout


def _errors(got, ref) -> tuple[float, float]:
    out_err = (got[0].double() - ref[0]).abs().max().item()
    grad_err = max(
        ((g.double() - r).abs().max() / r.abs().max().clamp_min(1e-12)).item()
        for g, r in zip(got[1:], ref[1:], strict=True)
    )
    return out_err, grad_err


# ----- part 1: accuracy -----------------------------------------------------------------------------


def kernels_to_check(dry_run: bool) -> list[str]:
    if dry_run:
        return ["cpu_flash", "math"]
    return [n for n in ("cuda_efficient", "cuda_flash", "flash_attn") if KERNELS[n].available()]


def accuracy(device, dry_run: bool) -> tuple[str, bool]:
    lengths = (64, 33, 71) if dry_run else (64, 33, 4096 + 7)
    heads, dim, batch, blocks = (2, 16, 2, 3) if dry_run else (4, 64, 2, 4)
    rows, ok = [], True
    for name in kernels_to_check(dry_run):
        kernel = KERNELS[name]
        for dtype in (torch.float32, torch.bfloat16):
            for s_q in lengths:
                for masked in (False, True):
                    why = kernel.refusal(device, dtype, masked, dim)
                    if why is not None:
                        rows.append([name, str(dtype)[6:], s_q, "key" if masked else "-", "refused", why, "", ""])
                        continue
                    q, k, v, bias, dout = _inputs(batch, heads, s_q, s_q, dim, dtype, device, masked)
                    ref = reference_attention(q, k, v, bias, dout)
                    if dtype == torch.float32:
                        tol = FP32_TOL
                    else:  # bf16: what plain bf16 attention itself misses by, with 2x headroom
                        base = _errors(_sdpa_in(dtype, q, k, v, bias, dout), ref)
                        tol = {"out": 2 * base[0] + 1e-3, "grad": 2 * base[1] + 1e-3}
                    for label, nblocks in (("one call", 1), (f"ring of {blocks}", blocks)):
                        out_err, grad_err = _errors(simulated_ring(kernel, q, k, v, bias, dout, nblocks), ref)
                        good = out_err <= tol["out"] and grad_err <= tol["grad"]
                        ok &= good
                        rows.append([
                            name, str(dtype)[6:], s_q, "key" if masked else "-", label,
                            f"{out_err:.1e} / {tol['out']:.0e}", f"{grad_err:.1e} / {tol['grad']:.0e}",
                            "ok" if good else "FAIL",
                        ])  # fmt: skip
    headers = ["kernel", "dtype", "S_q = S_k", "mask", "call", "out max abs / tol", "grad max rel / tol", ""]
    return _table(headers, rows), ok


def _sdpa_in(dtype, q, k, v, bias, dout):
    """Plain SDPA in ``dtype`` (torch picks its kernel): the error floor a kernel in that dtype has."""
    qd, kd, vd = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=bias)
    out.backward(dout.to(dtype))
    return out.detach(), qd.grad, kd.grad, vd.grad


# ----- part 2: speed --------------------------------------------------------------------------------


def _time(fn, args: tuple, device, repeats: int) -> float:
    fn(*args)  # warm-up
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    _sync(device)
    return (time.perf_counter() - start) / repeats


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plain_step(q, k, v, dout):
    qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(qd, kd, vd).backward(dout)


def speed(device, dry_run: bool) -> str:
    heads, dim, totals, repeats = (2, 16, (128, 256), 1) if dry_run else (24, 128, (4096, 16384), 5)
    dtype = torch.bfloat16
    rows = []
    for total in totals:
        q, k, v, _, dout = _inputs(1, heads, total, total, dim, dtype, device, False)

        flops = 3.5 * 4 * heads * total * total * dim  # forward 4 B H S_q S_k D; backward 2.5x (recompute)
        t_plain = _time(_plain_step, (q, k, v, dout), device, repeats)
        rows.append(["plain SDPA", total, 1, f"{t_plain * 1e3:.2f}", f"{flops / t_plain / 1e12:.2f}", "1.00"])
        for name in kernels_to_check(dry_run):
            kernel = KERNELS[name]
            if kernel.refusal(device, dtype, False, dim) is not None:
                continue
            for blocks in (2, 4, 8):
                queries = q[:, :, : total // blocks]  # one rank's queries, over every rank's key block
                grad = dout[:, :, : total // blocks]
                t = _time(simulated_ring, (kernel, queries, k, v, None, grad, blocks), device, repeats)
                rank_flops = flops / blocks
                rows.append([
                    name, total, blocks, f"{t * 1e3:.2f}", f"{rank_flops / t / 1e12:.2f}",
                    f"{(rank_flops / t) / (flops / t_plain):.2f}",
                ])  # fmt: skip
    headers = ["kernel", "tokens", "ring ranks P", "ms per rank (fwd+bwd)", "TFLOP/s", "vs plain SDPA"]
    return _table(headers, rows)


# ----- part 3: NCCL parity and the scaling benchmark ------------------------------------------------


def parity_worker(args) -> int:
    """Under torchrun: every tiny model in every mode the world allows, even and uneven lengths."""
    import copy

    import torch.distributed as dist

    from benchmarks import common
    from cp_lightning import build_mesh, parallelize
    from cp_lightning.tiny import MODELS, tiny_inputs, tiny_model

    common.init_torchrun(1)
    world, rank, dev = dist.get_world_size(), dist.get_rank(), common.device()
    modes = [("ulysses", 1), ("ring", world)] + ([("usp", 2)] if world >= 4 and world % 2 == 0 else [])
    rows, ok = [], True
    for model_name in sorted(MODELS):
        for mode, ring in modes:
            for tokens in (64, 61):
                reference = tiny_model(model_name).to(dev)
                model = parallelize(copy.deepcopy(reference), mesh=build_mesh(world, ring=ring, device_type=dev.type))
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
                good = out_err <= FP32_TOL["out"] and grad_err <= FP32_TOL["grad"]
                ok &= good
                rows.append([model_name, mode, f"{world // ring}x{ring}", tokens, f"{out_err:.1e}", f"{grad_err:.1e}",
                             "ok" if good else "FAIL"])  # fmt: skip
    backend = dist.get_backend()
    dist.destroy_process_group()
    if rank == 0:
        headers = ["model", "mode", "ulysses x ring", "tokens", "out max abs", "grad max rel", ""]
        print(f"\nparity over {backend}, {world} processes:\n\n" + _table(headers, rows) + "\n", flush=True)
    return 0 if ok else 1


def _torchrun(nproc: int, argv: list[str], timeout: float) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *argv]
    print(f"$ {' '.join(cmd[2:])}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout).returncode


def distributed(dry_run: bool, timeout: float) -> bool:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not dry_run and gpus < 2:
        print(f"\npart 3 skipped: {gpus} GPU(s); NCCL parity needs 2 or more.\n")
        return True
    nproc = 2 if dry_run else min(gpus, 8)
    ok = _torchrun(nproc, [str(Path(__file__)), "--parity-worker"], timeout) == 0
    scaling = ["--tokens", "256", "--text-tokens", "16", "--layers", "1", "--repeats", "1"] if dry_run else []
    plot = ["--plot", str(Path(os.environ.get("TMPDIR", "/tmp"), "gpu_check_scaling.png"))]
    ok &= _torchrun(nproc, [str(ROOT / "benchmarks" / "scaling.py"), *scaling, *plot], timeout) == 0
    return ok


# ----- driver ---------------------------------------------------------------------------------------


def _table(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="on CPU, every step but the CUDA calls")
    parser.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    parser.add_argument("--timeout", type=float, default=240, help="seconds for each torchrun launch of part 3")
    parser.add_argument("--parity-worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.parity_worker:
        return parity_worker(args)
    print(NEEDS, flush=True)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device here; run with --dry-run to exercise the script on CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references in fp32, not TF32
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)} x {torch.cuda.device_count()}, torch {torch.__version__}")
    ok = True
    if 1 in args.parts:
        text, good = accuracy(device, args.dry_run)
        ok &= good
        print("\n## 1. Kernels against fp64 attention\n\n" + text + "\n", flush=True)
    if 2 in args.parts:
        print(
            "\n## 2. Forward+backward speed, one ring rank (bf16)\n\n" + speed(device, args.dry_run) + "\n", flush=True
        )
    if 3 in args.parts:
        print("\n## 3. Ulysses, ring and USP against one process, then the scaling benchmark\n", flush=True)
        ok &= distributed(args.dry_run, args.timeout)
    print("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

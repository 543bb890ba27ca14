"""The attention steps of benchmarks/gpu_check.py: facts, kernel contracts, the ring loop, compile.

Each step is ``step(ctx) -> dict``: the figures it measured, and ``"ok": False`` when a check failed. ``ctx``
(gpu_check.Context) gives the device and whether this is the CPU run (tiny shapes, CPU kernels). Errors are
measured against attention in fp64 (torch's math backend, through autograd) over the same inputs; the bounds
are the test suite's in fp32 (outputs 1e-5 absolute, gradients 1e-4 relative), 1e-12 in fp64, and in bf16
twice what plain bf16 SDPA misses by, plus 1e-3.
"""

from __future__ import annotations

import itertools
import platform
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cp_lightning.collectives import chunk_sizes
from cp_lightning.kernels import KERNELS, Kernel, pick_kernel
from cp_lightning.ring import _CHUNK_KEYS, _key_chunks, _masked_lse, merge
from cp_lightning.ring_threads import run_ring

FP32_TOL = {"out": 1e-5, "grad": 1e-4}
FP64_TOL = {"out": 1e-12, "grad": 1e-12}


# ----- references and inputs ------------------------------------------------------------------------


def reference_attention(q, k, v, bias, dout):
    """(out, dq, dk, dv) of attention in fp64 with torch's math backend, through autograd."""
    qf, kf, vf = (t.detach().double().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=None if bias is None else bias.double())
    out.backward(dout.double())
    return out.detach(), qf.grad, kf.grad, vf.grad


def _plain(dtype, q, k, v, bias, dout):
    """Plain SDPA in ``dtype`` (torch picks its kernel): the error floor of a kernel in that dtype."""
    qd, kd, vd = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=None if bias is None else bias.to(dtype))
    out.backward(dout.to(dtype))
    return out.detach(), qd.grad, kd.grad, vd.grad


def errors(got, ref) -> tuple[float, float]:
    """(output max abs error, largest gradient max error relative to that gradient's max)."""
    out_err = (got[0].double() - ref[0]).abs().max().item()
    grad_err = max(
        ((g.double() - r).abs().max() / r.abs().max().clamp_min(1e-12)).item()
        for g, r in zip(got[1:], ref[1:], strict=True)
    )
    return out_err, grad_err


def tolerance(dtype, q, k, v, bias, dout, ref) -> dict:
    if dtype == torch.float64:
        return FP64_TOL
    if dtype == torch.float32:
        return FP32_TOL
    base = errors(_plain(dtype, q, k, v, bias, dout), ref)
    return {"out": 2 * base[0] + 1e-3, "grad": 2 * base[1] + 1e-3}


def make_inputs(batch, heads, s_q, s_k, dim, dtype, device, mask, *, blocks=1, seed=0):
    """q (B, H, S_q, D), k and v as the ring holds them ((B, S, H, D) blocks seen as (B, H, S, D)), dout, and a
    key mask: None, "key" (sample b keeps its first s_k - 5 b keys: padded text) or "block" (sample 1's last
    of ``blocks`` key blocks fully masked, the rows that see nothing in it)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)

    q, dout = rand(batch, heads, s_q, dim), rand(batch, heads, s_q, dim)
    k, v = (rand(batch, s_k, heads, dim).transpose(1, 2) for _ in range(2))
    bias = None
    if mask is not None:
        keep = torch.ones(batch, s_k, dtype=torch.bool)
        for b in range(batch):
            if mask == "key":
                keep[b, s_k - 5 * b :] = b == 0
            elif b == 1:
                keep[b, s_k - chunk_sizes(s_k, blocks)[-1] :] = False
        bias = torch.zeros(batch, 1, 1, s_k, dtype=torch.float64).masked_fill(~keep[:, None, None], float("-inf"))
        bias = bias.to(device=device, dtype=dtype)
    return q, k, v, bias, dout


def simulated_ring(kernel: Kernel, q, k, v, bias, dout, blocks: int, chunk_align: int | None = None):
    """(out, dq, dk, dv) of ring attention in one process: K/V (and the mask) cut into ``blocks`` blocks (of
    unequal length when ``blocks`` does not divide S_k), each held as the ring holds it (contiguous
    (B, S, H, D)), forward merged by LSE, backward re-run per block with the final output and LSE. With
    ``chunk_align``, each block's backward runs over the key chunks (mask slices included) that
    ``ring._key_chunks`` gives the ring's backward, aligned to that many keys (1: the CPU's quarter)."""
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
    dq = torch.zeros_like(q, dtype=torch.promote_types(q.dtype, torch.float32))
    dks, dvs = [], []
    for kb, vb, bb in pieces:
        chunks = [(0, kb.shape[2])] if chunk_align is None else _key_chunks(kb.shape[2], True, chunk_align)
        dk_b, dv_b = torch.zeros_like(kb, dtype=dq.dtype), torch.zeros_like(vb, dtype=dq.dtype)
        for lo, hi in chunks:
            chunk_bias = None if bb is None else bb[..., lo:hi]  # a slice at an offset, as the ring passes it
            grads = kernel.backward(dout, q, kb[:, :, lo:hi], vb[:, :, lo:hi], out, lse, chunk_bias, None)
            dq += grads[0]
            dk_b[:, :, lo:hi] += grads[1]
            dv_b[:, :, lo:hi] += grads[2]
        dks.append(dk_b)
        dvs.append(dv_b)
    return out, dq.to(q.dtype), torch.cat(dks, dim=2).to(k.dtype), torch.cat(dvs, dim=2).to(v.dtype)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int, warmup: int = 1) -> float:
    """Median-free mean seconds of ``fn()`` over ``repeats`` runs after ``warmup``."""
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeats


def world_of_one(dev: torch.device) -> str:
    """A default process group of one rank: NCCL on CUDA (the one group a single GPU allows), gloo on CPU."""
    import torch.distributed as dist

    backend = "gloo" if dev.type == "cpu" else "nccl"
    device_id = None if dev.type == "cpu" else dev  # NCCL connects now, not at the first collective
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id)
    return backend


# ----- step 1: facts ---------------------------------------------------------------------------------


def facts(ctx) -> dict:
    """Versions, the device, its memory, and which SDPA backends run bf16 attention at head dims 64/128/36."""
    dev = ctx.device
    out = {"torch": torch.__version__, "python": platform.python_version(), "device": str(dev)}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        free, total = torch.cuda.mem_get_info(dev)
        out |= {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "sms": props.multi_processor_count,
            "memory_total_gib": round(total / 2**30, 2),
            "memory_free_gib": round(free / 2**30, 2),
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "gpus": torch.cuda.device_count(),
        }
    else:
        out |= {"name": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    try:
        import flash_attn

        out["flash_attn"] = flash_attn.__version__
    except ImportError:
        out["flash_attn"] = None
    out["flash_attn_usable"] = KERNELS["flash_attn"].available()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    backends = {}
    for dim in (64, 128, 36):
        for name, backend in (
            ("flash", SDPBackend.FLASH_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION),
            ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("math", SDPBackend.MATH),
        ):
            q = torch.randn(1, 2, 128, dim, device=dev, dtype=dtype, requires_grad=True)
            try:
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, q, q).sum().backward()
                backends[f"{name}/d{dim}"] = "runs"
            except RuntimeError as err:
                backends[f"{name}/d{dim}"] = f"refused: {str(err).splitlines()[0][:120]}"
    out["sdpa_backends_bf16" if dtype == torch.bfloat16 else "sdpa_backends_fp32"] = backends
    out["ring_kernel_choices"] = {
        f"{str(dt)[6:]}/d{dim}/{'mask' if masked else 'nomask'}": pick_kernel(
            torch.device("cuda"), dt, masked, head_dim=dim
        ).name
        for dt in (torch.bfloat16, torch.float32)
        for dim in (64, 128, 36)
        for masked in (False, True)
    }
    return out


# ----- step 2: kernel contracts at production shapes --------------------------------------------------


PRODUCTION_KEYS = (16, 1032, 1040, 4103)  # 1032 in bf16: the ring's second key chunk starts 516 bytes in


def kernels(ctx) -> dict:
    """Every kernel that can run here, at the shapes and key chunks the ring hands it, against fp64; and the
    16-bit head dim no CUDA kernel takes (36) passed over for ``math`` rather than launched."""
    dev, cpu = ctx.device, ctx.cpu
    names = ["cpu_flash", "math"] if cpu else ["cuda_efficient", "cuda_flash", "flash_attn"]
    dtypes = (torch.float64, torch.float32) if cpu else (torch.bfloat16, torch.float32)
    dims, keys, heads, blocks = ((16, 36), (16, 40, 103), 2, 3) if cpu else ((64, 128, 36), PRODUCTION_KEYS, 4, 4)
    # the backward's key chunks as the ring cuts them: the quarter (1032 keys in bf16: 516 bytes into the
    # mask) and, on CUDA, the 128-key boundary; (label, blocks, chunk alignment or None for whole blocks)
    calls = [("one call", 1, None), (f"ring of {blocks}", blocks, None)]
    calls += [("one block, chunks /1", 1, 1), (f"ring of {blocks}, chunks /1", blocks, 1)]
    calls += [] if cpu else [(f"one block, chunks /{_CHUNK_KEYS}", 1, _CHUNK_KEYS)]
    rows, routing = [], {}
    for dtype, dim, s_k, batch, mask in itertools.product(dtypes, dims, keys, (1, 2), (None, "key", "block")):
        chosen = pick_kernel(dev, dtype, mask is not None, head_dim=dim).name
        routing[f"{str(dtype)[6:]}/d{dim}/{mask}"] = chosen
        run = [n for n in names if KERNELS[n].refusal(dev, dtype, mask is not None, dim) is None]
        run += [] if chosen in run else [chosen]  # what ring attention runs (math for 16-bit at d36)
        q, k, v, bias, dout = make_inputs(batch, heads, s_k, s_k, dim, dtype, dev, mask, blocks=blocks)
        ref = reference_attention(q, k, v, bias, dout)
        tol = tolerance(dtype, q, k, v, bias, dout, ref)
        for name, (label, nblocks, align) in itertools.product(run, calls):
            out_err, grad_err = errors(simulated_ring(KERNELS[name], q, k, v, bias, dout, nblocks, align), ref)
            rows.append(dict(kernel=name, dtype=str(dtype)[6:], head_dim=dim, keys=s_k, batch=batch, mask=mask,
                             call=label, out_err=out_err, grad_err=grad_err, out_tol=tol["out"], grad_tol=tol["grad"],
                             ok=out_err <= tol["out"] and grad_err <= tol["grad"]))  # fmt: skip
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    # no 16-bit CUDA kernel has head dim 36 ("no kernel found to launch"): it must go to math
    refused = all(v == "math" for key, v in routing.items() if "/d36/" in key and not key.startswith("float32"))
    failed = sum(not r["ok"] for r in rows)
    return {"ok": failed == 0 and (cpu or refused), "checked": len(rows), "failed": failed, "routing": routing,
            "rows": rows}  # fmt: skip


# ----- step 3: the shipped ring loop through the thread communicator ------------------------------------


def ring(ctx) -> dict:
    """_ring_forward / _ring_backward at P = 2, 4, 8 (threads as ranks), uneven lengths, with and without masks."""
    dev, cpu = ctx.device, ctx.cpu
    dtypes = (torch.float64, torch.float32) if cpu else (torch.bfloat16, torch.float32)
    heads, dim, total = (2, 16, 61) if cpu else (4, 128, 4103)
    rows, ok = [], True
    for world in (2, 4, 8):
        lengths = chunk_sizes(total, world)  # uneven: 4103 and 61 divide by none of them
        for dtype in dtypes:
            for mask in (None, "key", "block"):
                q, k, v, bias, dout = make_inputs(2, heads, total, total, dim, dtype, dev, mask, blocks=world)
                ref = reference_attention(q, k, v, bias, dout)
                tol = tolerance(dtype, q, k, v, bias, dout, ref)
                kernel = pick_kernel(dev, dtype, mask is not None, head_dim=dim).name

                masks = None if bias is None else list(bias.split(lengths, dim=-1))
                blocks = [list(t.split(lengths, dim=2)) for t in (q, k, v, dout)]
                per_rank = run_ring(*blocks, kernel=kernel, bias=masks)
                got = [torch.cat([r[i] for r in per_rank], dim=2) for i in range(4)]
                out_err, grad_err = errors(got, ref)
                good = out_err <= tol["out"] and grad_err <= tol["grad"]
                ok &= good
                rows.append(dict(P=world, lengths=lengths, dtype=str(dtype)[6:], mask=mask, kernel=kernel,
                                 out_err=out_err, grad_err=grad_err, out_tol=tol["out"], grad_tol=tol["grad"],
                                 ok=good))  # fmt: skip
    return {"ok": ok, "rows": rows}


# ----- step 4: the ring's custom ops and torch.compile over a one-rank process group ----------------------


def compile_ops(ctx) -> dict:
    """ring_attention through its custom ops, eager and ``torch.compile(fullgraph=True)``, over a world of one
    (NCCL on CUDA: the one group a single GPU allows; gloo on CPU)."""
    import torch.distributed as dist

    from cp_lightning.ring import ring_attention

    dev, cpu = ctx.device, ctx.cpu
    backend = world_of_one(dev)
    try:
        dtype = torch.float32 if cpu else torch.bfloat16
        heads, dim, tokens = (2, 16, 40) if cpu else (8, 128, 2048)
        q, k, v, bias, dout = make_inputs(2, heads, tokens, tokens, dim, dtype, dev, "key")
        kernel = pick_kernel(dev, dtype, True, head_dim=dim)

        def attend(q, k, v, bias):
            return ring_attention(q, k, v, group=dist.group.WORLD, kernel=kernel, bias=bias)

        def run(fn):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = fn(*leaves, bias)
            out.backward(dout)
            return (out.detach(), *(t.grad for t in leaves))

        eager = run(attend)
        start = time.perf_counter()
        compiled = run(torch.compile(attend, fullgraph=True, backend="aot_eager" if cpu else "inductor"))
        compile_s = time.perf_counter() - start
        diffs = [(a.double() - b.double()).abs().max().item() for a, b in zip(eager, compiled, strict=True)]
        ref = reference_attention(q, k, v, bias, dout)
        out_err, grad_err = errors(eager, ref)
        tol = tolerance(dtype, q, k, v, bias, dout, ref)
        good = max(diffs) == 0.0 or max(diffs) <= tol["out"]
        good &= out_err <= tol["out"] and grad_err <= tol["grad"]
        return {"ok": good, "backend": backend, "kernel": kernel.name, "compiled_vs_eager_max_diff": diffs,
                "out_err": out_err, "grad_err": grad_err, "tol": tol, "compile_s": compile_s}  # fmt: skip
    finally:
        dist.destroy_process_group()

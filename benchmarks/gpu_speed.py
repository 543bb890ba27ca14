"""The speed and memory steps of benchmarks/gpu_check.py: one ring rank against SDPA, the backend pinned.

One ring rank is timed alone through the shipped loop (``ring._ring_forward`` / ``_ring_backward``) with a
communicator that hands the rank its own block back (:class:`SelfComm`): every rank's blocks have the same
shape, so the compute is one rank's, and the P2P that overlaps it on a real ring is left out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.gpu_steps import timed
from cp_lightning.kernels import KERNELS, Kernel, pick_kernel
from cp_lightning.ring import _ring_backward, _ring_forward


def device_inputs(batch, heads, s_q, s_k, dim, dtype, device):
    """q and dout (B, H, S_q, D), k and v as the ring holds them, drawn on the device (the Wan-720p shapes hold
    387M elements each: drawing them on the host in fp64, as the accuracy steps do, would take seconds)."""
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    q, dout = rand(batch, heads, s_q, dim), rand(batch, heads, s_q, dim)
    k, v = (rand(batch, s_k, heads, dim).transpose(1, 2) for _ in range(2))
    return q, k, v, dout


class SelfComm:
    """One ring rank's communicator for timing it alone: every "received" block is the one sent (the other
    ranks' blocks have the same shapes, so the compute is the same); ``copy``: into a fresh buffer, as a real
    receive allocates (for memory), else none (for speed: real transfers overlap the compute)."""

    def __init__(self, world: int, copy: bool = False) -> None:
        self.world, self.rank, self.copy = world, 0, copy

    def start(self, tensors, tags, shapes=None):
        return [t.clone() if self.copy else t for t in tensors]

    def finish(self, pending):
        return pending

    def incoming_length(self, lengths, step):
        return None


def one_rank(q, k_block, v_block, dout, kernel: Kernel, world: int, copy: bool = False) -> None:
    """Forward and backward of one ring rank of ``world``: its queries over ``world`` key blocks."""
    comm = SelfComm(world, copy)
    out, lse = _ring_forward(q, k_block, v_block, None, comm, kernel, None, None)
    _ring_backward(dout, q, k_block, v_block, out, lse, None, comm, kernel, None, None)


SHAPES = {  # batch, heads, tokens, head dim, ring ranks P
    "flux-1024": (1, 24, 4096 + 512, 128, 4),  # 64 x 64 latent patches + 512 text tokens
    "wan14b-720p": (1, 40, 21 * 45 * 80, 128, 8),  # 81 frames at 1280 x 720: 21 x 45 x 80 latent patches
}
CPU_SHAPES = {"tiny": (1, 2, 256, 16, 2)}


def speed(ctx) -> dict:
    """Forward+backward TFLOP/s of public SDPA with each backend pinned, and of one ring rank with the kernel of
    the same family, on its queries (S/P) over all S keys: the ring's time as a percentage of SDPA's."""
    dev, cpu = ctx.device, ctx.cpu
    dtype = torch.float32 if cpu else torch.bfloat16
    families = [("flash", SDPBackend.FLASH_ATTENTION, "cpu_flash" if cpu else "cuda_flash")]
    families += [("math", SDPBackend.MATH, "math")] if cpu else [
        ("efficient", SDPBackend.EFFICIENT_ATTENTION, "cuda_efficient"),
        ("cudnn", SDPBackend.CUDNN_ATTENTION, None),
    ]  # fmt: skip
    repeats = 1 if cpu else 3
    rows = []
    for shape, (batch, heads, tokens, dim, world) in (CPU_SHAPES if cpu else SHAPES).items():
        s_q = tokens // world
        q, k, v, dout = device_inputs(batch, heads, s_q, tokens, dim, dtype, dev)
        flops = 3.5 * 4 * batch * heads * s_q * tokens * dim  # forward 4 B H S_q S_k D; backward 2.5x that
        for family, backend, kernel in families:
            row = dict(shape=shape, P=world, queries=s_q, keys=tokens, backend=family, ring_kernel=kernel)
            row |= _speed_row(q, k, v, dout, backend, kernel, world, flops, repeats)
            rows.append(row)
        del q, k, v, dout
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows}


def _speed_row(q, k, v, dout, backend, kernel: str | None, world: int, flops: float, repeats: int) -> dict:
    dev, s_q = q.device, q.shape[2]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    row, t_sdpa = {}, None
    try:
        with sdpa_kernel(backend):
            t_sdpa = timed(lambda: F.scaled_dot_product_attention(*leaves).backward(dout), dev, repeats)
        row |= {"sdpa_ms": t_sdpa * 1e3, "sdpa_tflops": flops / t_sdpa / 1e12}
    except RuntimeError as err:
        row["sdpa_error"] = str(err).splitlines()[0][:160]
    if kernel is not None:
        k_block, v_block = k[:, :, :s_q], v[:, :, :s_q]  # every rank's block has this rank's shape
        t_ring = timed(lambda: one_rank(q, k_block, v_block, dout, KERNELS[kernel], world), dev, repeats)
        row |= {"ring_ms": t_ring * 1e3, "ring_tflops": flops / t_ring / 1e12}
        if t_sdpa is not None:
            row["ring_vs_sdpa_pct"] = 100 * t_sdpa / t_ring
    return row


# ----- step 6: peak memory of a ring rank against SDPA ------------------------------------------------------


def memory(ctx) -> dict:
    """CUDA allocator peak above the step's start: SDPA forward+backward over the whole sequence, and one ring
    rank (S/P queries, two S/P key blocks in flight) of the same sequence. Ideal ratio: about 1/P."""
    dev = ctx.device
    batch, heads, tokens, dim, world = 1, 24, 32768, 128, 8
    rows = []

    def peak(fn) -> int:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        fn()
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - base

    def sdpa():
        q, k, v, dout = device_inputs(batch, heads, tokens, tokens, dim, torch.bfloat16, dev)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*leaves).backward(dout)

    def ring_rank():
        s = tokens // world
        q, k, v, dout = device_inputs(batch, heads, s, s, dim, torch.bfloat16, dev)
        kernel = pick_kernel(dev, torch.bfloat16, False, head_dim=dim)
        one_rank(q, k, v, dout, kernel, world, copy=True)

    full, rank = peak(sdpa), peak(ring_rank)
    rows.append(dict(tokens=tokens, heads=heads, head_dim=dim, P=world, sdpa_peak_mib=full / 2**20,
                     ring_rank_peak_mib=rank / 2**20, ratio=rank / full, ideal=1 / world))  # fmt: skip
    return {"rows": rows, "measured": "torch.cuda.max_memory_allocated above memory_allocated at the start"}

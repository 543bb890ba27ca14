"""The shipped ring loop at P = 2, 4, 8 in one process: virtual ranks as threads (cp_lightning.ring_threads).

``ring._ring_forward`` / ``_ring_backward`` run as they do across processes (custom ops, autograd, key
chunking, masks, uneven block lengths), each virtual rank a thread, against attention in fp64 over the whole
sequence: 1e-12 in fp64, the suite's tolerances in fp32 (outputs 1e-5, gradients 1e-4 relative). The same
harness runs on a GPU in benchmarks/gpu_check.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cp_lightning.ring_threads import ThreadRing, run_ring

TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-4)}


def reference(q, k, v, bias, dout):
    """(out, dq, dk, dv) of attention over the whole sequence, in fp64, through autograd."""
    qf, kf, vf = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=None if bias is None else bias.double())
    out.backward(dout.double())
    return out.detach(), qf.grad, kf.grad, vf.grad


def ring_case(world: int, dtype: torch.dtype, *, uneven: bool, masked: bool, kernel: str, autograd: bool):
    """Relative errors (out, dq, dk, dv) of the thread ring against :func:`reference`."""
    g = torch.Generator().manual_seed(world)
    b, h, d = 2, 2, 8
    lengths = [5 + r % 3 for r in range(world)] if uneven else [6] * world  # B, H, S_r, D blocks
    total = sum(lengths)
    q, k, v, dout = (torch.randn(b, h, total, d, generator=g, dtype=torch.float64) for _ in range(4))
    bias = None
    if masked:  # key padding: sample 1 loses its last 7 keys, a whole block at P = 8
        keep = torch.ones(b, total, dtype=torch.bool)
        keep[1, -7:] = False
        bias = torch.zeros(b, 1, 1, total, dtype=torch.float64).masked_fill(~keep[:, None, None], float("-inf"))
    ref = reference(q, k, v, bias, dout)

    def blocks(t, dim=2):
        return list(t.to(dtype).split(lengths, dim=dim))

    masks = None if bias is None else blocks(bias, -1)
    per_rank = run_ring(blocks(q), blocks(k), blocks(v), blocks(dout), kernel=kernel, bias=masks, autograd=autograd)
    got = [torch.cat([rank[i] for rank in per_rank], dim=2) for i in range(4)]
    return [((a.double() - r).abs().max() / r.abs().max()).item() for a, r in zip(got, ref, strict=True)]


CASES = [
    (world, dtype, uneven, masked, kernel, autograd)
    for world in (2, 4, 8)
    for dtype in (torch.float64, torch.float32)
    for uneven in (False, True)
    for masked in (False, True)
    for kernel, autograd in (("cpu_flash", False), ("cpu_flash", True), ("math", False))
]


@pytest.mark.parametrize(
    ("world", "dtype", "uneven", "masked", "kernel", "autograd"),
    CASES,
    ids=lambda x: str(x).replace("torch.", ""),
)
def test_thread_ring_matches_fp64_attention(world, dtype, uneven, masked, kernel, autograd):
    out_err, *grad_errs = ring_case(world, dtype, uneven=uneven, masked=masked, kernel=kernel, autograd=autograd)
    out_tol, grad_tol = TOL[dtype]
    assert out_err <= out_tol and max(grad_errs) <= grad_tol, (out_err, grad_errs)


def test_a_wrong_block_length_is_an_error_not_a_hang():
    """The receiver checks what arrives against the length it expects, as NCCL's buffers would."""
    with ThreadRing(2, timeout=30) as ring_:
        from cp_lightning import ring

        def rank_fn(r):
            x = torch.randn(1, 1, 4 + r, 8)  # ranks hold 4 and 5 keys, but say both hold 4
            return ring.ring_attention_forward(x, x, x, None, ring_.group_name, "cpu_flash", None, [4, 4])

        with pytest.raises(RuntimeError, match="expected .* got"):
            ring_.run(rank_fn)


def test_a_failing_rank_stops_its_peers():
    with ThreadRing(3, timeout=30) as ring_:

        def rank_fn(r):
            if r == 1:
                raise ValueError("rank 1 fails")
            ring_._take((2, r, 0, 0))  # waits for a message that never comes

        with pytest.raises(ValueError, match="rank 1 fails"):
            ring_.run(rank_fn)

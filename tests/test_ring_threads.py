"""The shipped ring loop at P = 2, 4, 8 in one process: virtual ranks as threads (cp_lightning.ring_threads).

``ring._ring_forward`` / ``_ring_backward`` run as they do across processes (custom ops, autograd, key
chunking, masks, uneven block lengths), each virtual rank a thread, against attention in fp64 over the whole
sequence: 1e-12 in fp64, the suite's tolerances in fp32 (outputs 1e-5, gradients 1e-4 relative). Grouped-query
attention too: K/V blocks with H_kv heads against SDPA with ``enable_gqa``, and 1/g of the repeated heads' P2P bytes.
The same harness runs on a GPU in benchmarks/gpu_check.py.
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


# ---------------------------------------------------------------- grouped-query attention (issue 46)
GQA_CASES = [  # (world, H, H_kv, dtype, uneven, masked, kernel, autograd)
    (2, 6, 2, torch.float64, True, True, "cpu_flash", True),
    (4, 6, 3, torch.float64, False, False, "cpu_flash", False),
    (4, 4, 1, torch.float64, True, False, "math", False),
    (3, 8, 2, torch.float32, True, True, "cpu_flash", True),
]


def gqa_case(world, heads, kv_heads, dtype, uneven, masked, kernel, autograd):
    """Relative errors (out, dq, dk, dv) of the thread ring with H_kv-head K/V blocks against fp64 SDPA with
    ``enable_gqa`` over the whole sequence."""
    g = torch.Generator().manual_seed(world + heads)
    lengths = [5 + r % 3 for r in range(world)] if uneven else [6] * world
    total = sum(lengths)
    q, dout = (torch.randn(2, heads, total, 8, generator=g, dtype=torch.float64) for _ in range(2))  # B, H, S, D
    k, v = (torch.randn(2, kv_heads, total, 8, generator=g, dtype=torch.float64) for _ in range(2))
    bias = None
    if masked:  # sample 1 loses its last 7 keys
        bias = torch.zeros(2, 1, 1, total, dtype=torch.float64)
        bias[1, ..., -7:] = float("-inf")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=bias, enable_gqa=True)
    out.backward(dout)
    ref = [out.detach(), *(t.grad for t in leaves)]

    def blocks(t, dim=2):
        return list(t.to(dtype).split(lengths, dim=dim))

    masks = None if bias is None else blocks(bias, -1)
    per_rank = run_ring(blocks(q), blocks(k), blocks(v), blocks(dout), kernel=kernel, bias=masks, autograd=autograd)
    got = [torch.cat([rank[i] for rank in per_rank], dim=2) for i in range(4)]
    assert got[2].shape == k.shape and got[3].shape == v.shape  # dK, dV folded back to the H_kv heads
    return [((a.double() - r).abs().max() / r.abs().max()).item() for a, r in zip(got, ref, strict=True)]


@pytest.mark.parametrize(
    "case", GQA_CASES, ids=lambda c: "p{}-{}q{}kv-{}-{}-autograd{}".format(*c[:3], str(c[3])[6:], c[6], c[7])
)
def test_thread_ring_carries_grouped_kv_heads(case):
    out_err, *grad_errs = gqa_case(*case)
    out_tol, grad_tol = TOL[case[3]]
    assert out_err <= out_tol and max(grad_errs) <= grad_tol, (out_err, grad_errs)


def test_thread_ring_gqa_sends_one_gth_of_the_repeated_bytes():
    """At P = 4, 8 query / 2 K/V heads: the ring's P2P bytes (K/V blocks forward, K/V and dK/dV backward) are
    1/4 of what the same attention with the K/V heads repeated to 8 sends."""
    from cp_lightning.collectives import count_bytes

    g = torch.Generator().manual_seed(0)
    q, dout = ([torch.randn(1, 8, 4, 8, generator=g, dtype=torch.float64) for _ in range(4)] for _ in range(2))
    k, v = ([torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64) for _ in range(4)] for _ in range(2))
    sent = []
    for kk, vv in ((k, v), ([t.repeat_interleave(4, dim=1) for t in k], [t.repeat_interleave(4, dim=1) for t in v])):
        with count_bytes() as counter:
            run_ring(q, kk, vv, dout, kernel="cpu_flash", autograd=False)
        sent.append(sum(n for name, n in counter.items() if name.startswith("p2p")))
    assert sent[1] == 4 * sent[0] > 0, sent


def test_thread_ring_refuses_kv_heads_that_do_not_divide():
    q, kv = [torch.randn(1, 6, 4, 8)] * 2, [torch.randn(1, 4, 4, 8)] * 2
    with pytest.raises(ValueError, match="dividing the 6 query heads"):
        run_ring(q, kv, kv, q, kernel="cpu_flash")

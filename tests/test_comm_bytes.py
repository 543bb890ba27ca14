"""Bytes each rank sends for one attention forward+backward, against the formulas of DESIGN.md.

M = b * (s/P) * h * d elements (one local q, k, v or output) at 4 bytes (fp32), P = cp degree:

- Ulysses: 4 all-to-alls of M forward, each sending (P-1)/P of it, and the same again backward.
- Ring: K and V travel P-1 hops forward: 2M(P-1). Backward they travel again (2M(P-1)) and their
  fp32 dK/dV accumulators travel P hops, the last one home (2MP): 2M(2P-1) in all, which is what
  DESIGN's "~2x the forward" rounds (2M(2P-1) against 4M(P-1)).
- USP (ring r x ulysses u): Ulysses over u, then the ring over r on (b, s/r, h/u, d) = M elements.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import spawn

B, S, H, D = 2, 64, 4, 8
P = 4
M_BYTES = B * (S // P) * H * D * 4


def expected(ring: int) -> dict[str, float]:
    u = P // ring
    a2a = 4 * M_BYTES * (u - 1) / u
    ring_fwd = 2 * M_BYTES * (ring - 1)
    ring_bwd = 2 * M_BYTES * (ring - 1) + 2 * M_BYTES * ring if ring > 1 else 0
    return {"forward": a2a + ring_fwd, "backward": a2a + ring_bwd}


def _count(rank, world):
    from cp_lightning import build_mesh, collectives
    from cp_lightning.attention import cp_attention
    from cp_lightning.mesh import cp_groups

    mesh = build_mesh(P)
    g = torch.Generator().manual_seed(0)
    out = {}
    for ring in (1, 2, 4):
        groups = cp_groups(mesh, ring)
        q, k, v = (torch.randn(B, S // P, H, D, generator=g, requires_grad=True) for _ in range(3))
        with collectives.count_bytes() as fwd:
            o = cp_attention(q, k, v, groups=groups)
        with collectives.count_bytes() as bwd:
            o.backward(torch.ones_like(o))
        out[ring] = {"forward": sum(fwd.values()), "backward": sum(bwd.values()), "kinds": dict(fwd) | dict(bwd)}
    return out


@pytest.fixture(scope="module")
def counted():
    return spawn(_count, P)


@pytest.mark.parametrize("ring", [1, 2, 4], ids=["ulysses", "usp-r2", "ring"])
def test_bytes_sent_match_the_formulas(counted, ring):
    want = expected(ring)
    for rank, result in enumerate(counted):
        got = result[ring]
        for phase in ("forward", "backward"):
            assert abs(got[phase] - want[phase]) <= 0.05 * want[phase], (rank, phase, got, want)
        if ring == P:
            assert "all_to_all" not in got["kinds"] and "all_gather" not in got["kinds"], got  # P2P only

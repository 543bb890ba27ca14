"""Which tokens each CP rank holds, and the rectangles of a mask that a rank's attention executes.

A :class:`Layout` gives every CP rank its tokens as runs of original positions, in the rank's local order.
``contiguous`` is today's split (rank r holds one run, ``torch.tensor_split``'s sizes) and stays the default
for full attention. Under a causal mask a contiguous ring gives the last rank all the work (1.4-1.75x the
mean on the shapes of DESIGN.md section 9.1); ``head_tail`` (rank r holds runs r and 2P-1-r of 2P) pairs an
early, cheap run with a late, expensive one and is balanced to within a few percent.

:func:`pieces` intersects a :class:`~cp_lightning.masks.MaskSpec` with the tokens on each side of one
attention call (queries in one order, keys in another) and returns rectangles in *local* coordinates:
full ones, which the kernels run with no mask at all, and small causal tiles (at most ``CAUSAL_TILE``
queries) that carry a tile-sized triangular bias. Their total area is the work executed, which is what
:func:`ring_areas` and :func:`ring_idling` count (pure arithmetic: tests and benchmarks call them).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cp_lightning.collectives import chunk_sizes
from cp_lightning.masks import FULL, MaskSpec

Run = tuple[int, int]  # [lo, hi) in original token positions

# queries per causal tile: the masked part a tile computes anyway is at most CAUSAL_TILE / 2 keys per row
CAUSAL_TILE = 64


@dataclass(frozen=True)
class Layout:
    """``runs[r]``: the ``(lo, hi)`` token runs CP rank r holds, in its local order; together a partition of
    ``[0, length)``. Built by :meth:`contiguous` or :meth:`head_tail`."""

    runs: tuple[tuple[Run, ...], ...]
    name: str = "custom"

    def __post_init__(self) -> None:
        runs = tuple(tuple((int(lo), int(hi)) for lo, hi in rank) for rank in self.runs)
        object.__setattr__(self, "runs", runs)
        flat = sorted(run for rank in runs for run in rank)
        if not runs or not all(runs) or any(hi <= lo for lo, hi in flat) or flat[0][0] != 0:
            raise ValueError(f"layout runs {runs} must give every rank non-empty ranges, starting at token 0.")
        for (_, hi), (lo, _) in zip(flat, flat[1:], strict=False):
            if lo != hi:
                raise ValueError(f"layout runs {runs} must partition the sequence: a gap or overlap at token {hi}.")

    @classmethod
    def contiguous(cls, length: int, ranks: int) -> Layout:
        """One run per rank, sizes as ``collectives.chunk_sizes`` (the split hooks' and ``shard``'s)."""
        sizes = chunk_sizes(length, ranks)
        if min(sizes) == 0:
            raise ValueError(f"{length} tokens cannot give each of {ranks} ranks at least one.")
        starts = [sum(sizes[:r]) for r in range(ranks)]
        return cls(tuple(((s, s + n),) for s, n in zip(starts, sizes, strict=True)), "contiguous")

    @classmethod
    def head_tail(cls, length: int, ranks: int, unit: int = 1) -> Layout:
        """2P runs, rank r holding run r and run 2P-1-r: balanced work under causal masks.

        Runs are whole ``unit`` s (frames) when that keeps the ranks' token counts equal (``length / unit``
        frames, a multiple of ``ranks`` and at least ``2 * ranks``); otherwise they are cut at tokens, as even
        as ``chunk_sizes`` makes them: equal tokens per rank matter more than whole frames, since every layer
        but attention costs per token.
        """
        frames = length // unit if unit > 1 and length % unit == 0 else 0
        if frames >= 2 * ranks and frames % ranks == 0:
            sizes = [n * unit for n in chunk_sizes(frames, 2 * ranks)]
        else:
            sizes = chunk_sizes(length, 2 * ranks)
        if min(sizes) == 0:
            raise ValueError(f"a head_tail layout needs at least {2 * ranks} tokens for {ranks} ranks, got {length}.")
        starts = [sum(sizes[:i]) for i in range(2 * ranks)]
        run = [(s, s + n) for s, n in zip(starts, sizes, strict=True)]
        return cls(tuple((run[r], run[2 * ranks - 1 - r]) for r in range(ranks)), "head_tail")

    @property
    def ranks(self) -> int:
        return len(self.runs)

    @property
    def lengths(self) -> list[int]:
        """Tokens per rank."""
        return [sum(hi - lo for lo, hi in rank) for rank in self.runs]

    @property
    def length(self) -> int:
        return sum(self.lengths)

    def group_runs(self, ranks: Sequence[int]) -> tuple[Run, ...]:
        """The runs of ``ranks`` concatenated in that order: the tokens of a Ulysses group after its all-to-all."""
        return tuple(run for r in ranks for run in self.runs[r])

    def shard(self, x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s tokens of a full tensor (its runs concatenated along ``dim``)."""
        return torch.cat([x.narrow(dim, lo, hi - lo) for lo, hi in self.runs[rank]], dim=dim)

    def unshard(self, parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        """The inverse of :meth:`shard`: every rank's part back in original token order."""
        pieces = {}
        for rank, part in enumerate(parts):
            offset = 0
            for lo, hi in self.runs[rank]:
                pieces[lo] = part.narrow(dim, offset, hi - lo)
                offset += hi - lo
        return torch.cat([pieces[lo] for lo in sorted(pieces)], dim=dim)


@dataclass(frozen=True)
class Piece:
    """A rectangle of one attention call in local coordinates: queries ``[q_lo, q_hi)`` of the local query
    tensor see keys ``[k_lo, k_hi)`` of the key tensor; all of them when ``diag`` is None, else key j is seen
    by query i iff ``j <= i + diag`` (a causal tile of at most CAUSAL_TILE rows, run with a tile-sized bias)."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    diag: int | None = None

    @property
    def area(self) -> int:
        return (self.q_hi - self.q_lo) * (self.k_hi - self.k_lo)


def _causal_pieces(q_lo, q_hi, k_lo, k_hi, d, tile) -> list[Piece]:
    """A causal rectangle (key j seen by query i iff j <= i + d) as full rectangles and diagonal tiles.

    Rows that see no key drop out; rows that see every key form one full rectangle; the rows in between go in
    strips of ``tile``: keys left of the strip's first diagonal entry are full, the rest a tile whose every row
    sees at least its first key (so no kernel call has an empty softmax row).
    """
    q_lo = max(q_lo, k_lo - d)
    q_all = max(q_lo, min(q_hi, k_hi - 1 - d))  # from here on a row sees every key
    out = [Piece(q_all, q_hi, k_lo, k_hi)] if q_all < q_hi else []
    for a in range(q_lo, q_all, tile):
        b = min(a + tile, q_all)
        if a + d > k_lo:
            out.append(Piece(a, b, k_lo, a + d))
        out.append(Piece(a, b, a + d, min(k_hi, b + d), d))
    return out


def _merge_runs(rects: list[Piece], along_keys: bool) -> list[Piece]:
    """Merge full pieces that share their rows and touch in keys (``along_keys``), or share keys and touch in rows."""
    if along_keys:
        order = sorted(rects, key=lambda p: (p.q_lo, p.q_hi, p.k_lo))
    else:
        order = sorted(rects, key=lambda p: (p.k_lo, p.k_hi, p.q_lo))
    merged: list[Piece] = []
    for p in order:
        last = merged[-1] if merged else None
        if last is not None and along_keys and (last.q_lo, last.q_hi, last.k_hi) == (p.q_lo, p.q_hi, p.k_lo):
            merged[-1] = Piece(last.q_lo, last.q_hi, last.k_lo, p.k_hi)
        elif last is not None and not along_keys and (last.k_lo, last.k_hi, last.q_hi) == (p.k_lo, p.k_hi, p.q_lo):
            merged[-1] = Piece(last.q_lo, p.q_hi, last.k_lo, last.k_hi)
        else:
            merged.append(p)
    return merged


def _coalesce(found: list[Piece]) -> list[Piece]:
    """Fewer, larger kernel calls: full pieces merged along keys, then along rows (a block-causal block becomes
    one call however the runs cut it); causal tiles stay as they are."""
    rects = _merge_runs(_merge_runs([p for p in found if p.diag is None], along_keys=True), along_keys=False)
    return sorted(rects + [p for p in found if p.diag is not None], key=lambda p: (p.q_lo, p.k_lo))


@functools.lru_cache(maxsize=4096)
def pieces(
    spec: MaskSpec, q_runs: tuple[Run, ...], k_runs: tuple[Run, ...], tile: int = CAUSAL_TILE
) -> tuple[Piece, ...]:
    """The rectangles of ``spec`` between local queries ``q_runs`` and local keys ``k_runs`` (each the runs of
    original positions in local order); empty when nothing is visible. Cached: one computation per layout,
    not per layer."""
    out: list[Piece] = []
    q_off = 0
    for q_run_lo, q_run_hi in q_runs:
        k_off = 0
        for k_run_lo, k_run_hi in k_runs:
            for s in spec.slices:
                a, b = max(s.q_lo, q_run_lo), min(s.q_hi, q_run_hi)
                c, e = max(s.k_lo, k_run_lo), min(s.k_hi, k_run_hi)
                if a >= b or c >= e:
                    continue
                lq, lk = a - q_run_lo + q_off, c - k_run_lo + k_off  # local starts
                if s.kind is FULL:
                    out.append(Piece(lq, lq + b - a, lk, lk + e - c))
                    continue
                # absolute: key k seen by query q iff k - s.k_lo <= q - s.q_lo; in local coordinates
                # (k = kl - lk + c, q = ql - lq + a) that is kl <= ql + d
                d = s.k_lo - s.q_lo + a - lq - c + lk
                out.extend(_causal_pieces(lq, lq + b - a, lk, lk + e - c, d, tile))
            k_off += k_run_hi - k_run_lo
        q_off += q_run_hi - q_run_lo
    return tuple(_coalesce(out))


def executed_area(found: Sequence[Piece]) -> int:
    """(query, key) pairs the kernels compute for ``found``: the mask's area plus the causal tiles' masked part."""
    return sum(p.area for p in found)


def ring_positions(layout: Layout, ring: int) -> list[tuple[Run, ...]]:
    """The tokens of each ring position under USP: ring position i holds the runs of Ulysses group i (cp ranks
    ``i * u .. i * u + u - 1``, u = cp / ring) in rank order; with ``ring == cp`` one rank each."""
    ulysses = layout.ranks // ring
    return [layout.group_runs(range(i * ulysses, (i + 1) * ulysses)) for i in range(ring)]


def ring_areas(spec: MaskSpec, layout: Layout, ring: int) -> list[list[int]]:
    """``areas[r][s]``: executed area of ring position r at step s (it holds the keys of position r - s)."""
    held = ring_positions(layout, ring)
    return [[executed_area(pieces(spec, held[r], held[(r - s) % ring])) for s in range(ring)] for r in range(ring)]


def ring_idling(spec: MaskSpec, layout: Layout, ring: int) -> float:
    """Ring time over balanced time: steps run in lockstep (a block moves on when every rank is done), so the
    ring takes sum over steps of the busiest rank's area, against the total area spread evenly. 1.0 is ideal."""
    areas = ring_areas(spec, layout, ring)
    lockstep = sum(max(areas[r][s] for r in range(ring)) for s in range(ring))
    return lockstep * ring / max(1, sum(map(sum, areas)))


def balance(values: Sequence[int]) -> float:
    """max / mean of per-rank work (1.0: balanced)."""
    return max(values) * len(values) / max(1, sum(values))

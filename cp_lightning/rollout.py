"""KV-cache roll-out under Ulysses: a video generated chunk by chunk, each chunk attending to the cached K/V.

Self-Forcing / LongLive students and chunked inference run a causal video model one chunk (a block of latent
frames) at a time: the chunk's queries attend to ``cat(cache, chunk)``, where the cache holds the earlier
chunks' keys and values (after RoPE: the caller applies positions before attention). :func:`rollout_attention`
is that attention for one layer over a CP group, with one :class:`KVCache` per layer.

Why Ulysses and not the ring: after Ulysses' all-to-all a rank holds every token of its heads, so it keeps the
cache of its heads only (H / u heads, or the K/V heads its query heads read under GQA), and a new chunk's
queries, on the same rank for the same heads, attend to it locally: exact, with no cache traffic, the
all-to-all moving only the chunk. A ring rank would hold a sequence shard of the cache, and every chunk's
queries would need all of it: the whole cache would travel the ring at every chunk of every layer. Rings
are refused before any collective.

Eviction (``window_tokens``, ``sink_tokens``) is :func:`cp_lightning.masks.block_causal`'s, at chunk
granularity: a chunk ending at token ``T`` sees the keys ``[T - window_tokens, T)`` and the first
``sink_tokens`` tokens (LongLive's frame sink), nothing else; the cache keeps exactly those. Eviction is
arithmetic on token counts every rank shares, so it is identical on every rank. A roll-out of chunks of
``frames_per_block`` frames therefore attends exactly as ``block_causal(frames, frame_tokens,
frames_per_block, window_frames, sink_frames)`` does in training (tests/test_rollout.py checks it).

Gradients: the cache is stored detached. The chunk's own attention is differentiable with respect to its
queries, keys and values (a student trains on its last chunk); the earlier chunks are constant context, as
when they were generated under ``torch.no_grad``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cp_lightning import collectives

# the Ulysses exchanges and head checks are cp_attention's own: a chunk is sharded and gathered as it shards them
from cp_lightning.attention import _check_heads, _cp_lengths, _heads_to_seq, _kv_heads, _seq_to_heads
from cp_lightning.kernels import grouped, pick_kernel
from cp_lightning.mask_layout import Piece, pieces
from cp_lightning.masked import has_tiles, spec_attention
from cp_lightning.masks import MaskSpec, _int
from cp_lightning.mesh import CPGroups


class KVCache:
    """One attention layer's cached keys and values for a roll-out, this rank's heads only.

    ``window_tokens``: a chunk sees the keys of the last ``window_tokens`` tokens up to its own end (None: all
    of them); ``sink_tokens``: and the first ``sink_tokens`` tokens, always. After each chunk the cache holds
    those keys (of this rank's heads): ``key`` and ``value`` are ``(B, kept, H_kv_rank, D)``, detached;
    ``seen`` counts the tokens appended so far (the next chunk's first position). The first call records what
    the cache was built for (batch, head counts, head dim, dtype, device, Ulysses degree and rank); later calls
    that differ are refused. Use one cache per attention layer, and :meth:`reset` (or a new cache) per video.
    """

    def __init__(self, *, window_tokens: int | None = None, sink_tokens: int = 0) -> None:
        self.window_tokens = None if window_tokens is None else _int("window_tokens", window_tokens, 1)
        self.sink_tokens = _int("sink_tokens", sink_tokens)
        self.reset()

    def reset(self) -> None:
        """Empty the cache (a new video); the next call may be for any shapes."""
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None
        self.seen = 0
        self.built_for: dict | None = None

    @property
    def tokens(self) -> int:
        """Cached tokens (after eviction)."""
        return 0 if self.key is None else self.key.shape[1]

    def kept(self, total: int | None = None) -> tuple[tuple[int, int], ...]:
        """The positions a chunk ending at token ``total`` sees (default: the cache's, ``seen``), as runs."""
        total = self.seen if total is None else total
        sink = min(self.sink_tokens, total)
        start = sink if self.window_tokens is None else max(sink, total - self.window_tokens)
        return tuple(run for run in ((0, sink), (start, total)) if run[1] > run[0])

    def check(self, built_for: dict) -> None:
        """Refuse a call whose shapes or group differ from the ones this cache holds (no communication)."""
        if self.built_for is None or self.built_for == built_for:
            return
        diff = ", ".join(f"{k} {self.built_for[k]} -> {v}" for k, v in built_for.items() if self.built_for[k] != v)
        raise ValueError(
            f"this KVCache holds K/V built for {self.built_for}; this call differs ({diff}). A cache holds one "
            "layer's heads on one rank of one Ulysses group: use one KVCache per attention layer, the same CP groups "
            "and head counts for every chunk, and cache.reset() (or a new KVCache) for a new video."
        )

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a chunk's ``(B, n, H_kv_rank, D)`` K/V (this rank's heads, the whole chunk); evict; return the
        keys and values the chunk attends to, ``cat(cache, chunk)`` after eviction (the chunk's part keeps its
        autograd history). The cache keeps them detached."""
        n = key.shape[1]
        if self.window_tokens is not None and self.window_tokens < n:
            raise ValueError(_window_refusal(self.window_tokens, n))
        total = self.seen + n
        keys, values = key, value
        if self.key is not None:
            keys, values = torch.cat([self.key, key], dim=1), torch.cat([self.value, value], dim=1)
        # keys hold the runs kept() gave before this chunk, then the chunk's, in that order. The runs kept now are
        # [0, a') + [b', total) against [0, a) + [b, seen) before, with a' >= a and b' >= b: each lies in
        # consecutive entries (a' > a only while nothing past the sink was evicted, all positions then being held)
        held = (*self.kept(), (self.seen, total))
        starts = [sum(hi - lo for lo, hi in held[:i]) for i in range(len(held))]

        def local(position: int) -> int:
            return next(s + position - lo for s, (lo, hi) in zip(starts, held, strict=True) if lo <= position < hi)

        kept = self.kept(total)
        assert all(local(hi - 1) == local(lo) + hi - lo - 1 for lo, hi in kept)
        runs = [(local(lo), hi - lo) for lo, hi in kept]
        if sum(length for _, length in runs) < keys.shape[1]:
            keys, values = (torch.cat([t.narrow(1, at, length) for at, length in runs], dim=1) for t in (keys, values))
        self.key, self.value, self.seen = keys.detach(), values.detach(), total
        return keys, values


def _window_refusal(window: int, chunk: int) -> str:
    return (
        f"window_tokens={window} is shorter than the chunk of {chunk} tokens: the window ends at the chunk's end, so "
        "part of the chunk would not see its own keys. Use a window of at least the chunk's tokens (as block_causal "
        "refuses a window shorter than a block)."
    )


def _check_call(query, key, value, cache, groups, lengths, mask) -> tuple[int, int]:
    """Every refusal that needs no communication; returns (ulysses degree, Ulysses rank)."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a cp_lightning.rollout.KVCache, got {type(cache).__name__}.")
    if mask is not None and not isinstance(mask, MaskSpec):
        raise TypeError(
            f"mask= takes a cp_lightning.masks.MaskSpec over the chunk's tokens, got {type(mask).__name__}."
        )
    if groups is not None and groups.ring_size > 1:
        raise ValueError(
            f"KV-cache roll-out runs under Ulysses only, not under a ring (ring={groups.ring_size}): a ring rank holds "
            "a sequence shard of the cache, and every new chunk's queries need all of it, so the whole cache would "
            "travel the ring at every chunk of every layer. Under Ulysses each rank keeps the cache of its own heads "
            "and attends to it locally, with no cache traffic: build the groups with ring=1 (cp_groups(mesh, 1)); "
            "the Ulysses degree is at most the head count."
        )
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (B, S_local, H, D), got shape {tuple(t.shape)}.")
    if key.shape[1] != query.shape[1] or value.shape[:2] != key.shape[:2]:
        raise ValueError(
            f"a roll-out chunk is self-attention over its own tokens: queries {tuple(query.shape)}, keys "
            f"{tuple(key.shape)} and values {tuple(value.shape)} must have the same batch and local length."
        )
    ulysses = 1 if groups is None else groups.ulysses_size
    rank = 0 if groups is None else dist.get_rank(groups.ulysses)
    if query.shape[2] < ulysses:
        raise ValueError(
            f"Ulysses gives each of its {ulysses} ranks at least one of the {query.shape[2]} attention heads, and a "
            f"roll-out cannot use a ring: run it at a CP degree of at most {query.shape[2]}."
        )
    if lengths is not None:
        if len(lengths) != ulysses or lengths[rank] != query.shape[1]:
            raise ValueError(
                f"lengths={list(lengths)} must give each of the {ulysses} Ulysses ranks its chunk tokens; this rank "
                f"({rank}) holds {query.shape[1]}: the ranks' chunk shards are inconsistent."
            )
        total = sum(lengths)
        if cache.window_tokens is not None and cache.window_tokens < total:
            raise ValueError(_window_refusal(cache.window_tokens, total))
        if mask is not None and mask.length != total:
            raise ValueError(f"the chunk mask covers {mask.length} tokens but the chunk has {total}.")
    if mask is not None and mask.length < query.shape[1]:
        raise ValueError(f"the chunk mask covers {mask.length} tokens but this rank alone holds {query.shape[1]}.")
    return ulysses, rank


def rollout_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: KVCache,
    *,
    groups: CPGroups | None,
    scale: float | None = None,
    kernel: str | None = None,
    even: bool = False,
    lengths: list[int] | None = None,
    mask: MaskSpec | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """One roll-out chunk's attention for one layer: this rank's ``(B, S_local, H, D)`` sequence shard of the
    chunk in, its ``(B, S_local, H, D)`` output back.

    Ulysses' all-to-all gives this rank the whole chunk for its heads; the chunk's K/V join ``cache`` (this
    rank's heads, evicted to the window and sink); the chunk's queries attend to ``cat(cache, chunk)`` locally;
    the all-to-all back returns the sequence shard. The cache never travels. ``groups``: the CP groups with
    ``ring_size == 1`` (a ring is refused), or None for one process. The chunk is sharded as the split hooks
    shard (rank r holds the r-th ``chunk_sizes`` run); ``even`` / ``lengths`` (every Ulysses rank's chunk
    tokens) skip exchanging the lengths, as in :func:`cp_lightning.attention.cp_attention`.
    ``mask``: a :class:`~cp_lightning.masks.MaskSpec` over the chunk's own tokens (e.g. ``documents([n],
    causal=True)`` for a causal chunk); the cached keys are always fully visible. None: full attention to
    ``cat(cache, chunk)``, what CausVid / Self-Forcing do for a block. ``enable_gqa``: key/value with fewer
    heads dividing the queries'; each rank receives and caches only the K/V heads its query heads read.
    Refusals (bad cache, ring, inconsistent lengths, a window shorter than the chunk) come before any
    collective where they can be known locally; those that need the exchanged lengths are raised on every rank.
    """
    ulysses, rank = _check_call(query, key, value, cache, groups, lengths, mask)
    _check_heads(query, key, value, ulysses, enable_gqa)
    heads, kv_total = query.shape[2], key.shape[2]
    group = heads // kv_total  # query heads per K/V head: 1 without GQA
    head_split = collectives.chunk_sizes(heads, ulysses)
    kv_heads = None if group == 1 else [j // group for j in range(heads)]
    kv_split, kv_starts = head_split, None
    if ulysses > 1 and group > 1:
        kv_split, kv_starts, kv_heads = _kv_heads(head_split, group, rank)
        if kv_starts == [sum(kv_split[:p]) for p in range(ulysses)]:
            kv_starts = None  # every K/V head goes to one rank: the plain (reshape) path
    built_for = {
        "batch": query.shape[0],
        "heads": heads,
        "kv_heads": kv_total,
        "head_dim": query.shape[3],
        "dtype": key.dtype,
        "device": key.device,
        "ulysses": ulysses,
        "rank": rank,
    }
    cache.check(built_for)
    # the chunk's own rectangles; a named kernel that cannot take them is refused here, before any collective
    own = None if mask is None else pieces(mask, ((0, mask.length),), ((0, mask.length),))
    picked = pick_kernel(
        query.device, query.dtype, own is not None and has_tiles([own]), kernel, head_dim=query.shape[-1]
    )
    if lengths is None:
        lengths = [query.shape[1]] * ulysses if ulysses == 1 else _cp_lengths(query, key, groups.ulysses, even)[0]
    total = sum(lengths)
    # known only now when the lengths were exchanged: every rank has the same lengths and refuses alike
    if cache.window_tokens is not None and cache.window_tokens < total:
        raise ValueError(_window_refusal(cache.window_tokens, total))
    if mask is not None and mask.length != total:
        raise ValueError(f"the chunk mask covers {mask.length} tokens but the chunk has {total}.")

    if ulysses > 1:
        query = _seq_to_heads(query, groups.ulysses, lengths, head_split)
        key, value = (_seq_to_heads(t, groups.ulysses, lengths, kv_split, kv_starts) for t in (key, value))
    cache.built_for = built_for
    keys, values = cache.append(key, value)  # B, cached + n, H_kv_rank, D
    context = keys.shape[1] - total  # the cached keys before the chunk's own
    found = (Piece(0, total, 0, keys.shape[1]),)
    if own is not None:  # the cache in full, then the chunk's pieces with keys shifted past it (key j' = j + context)
        found = ((Piece(0, total, 0, context),) if context else ()) + tuple(
            Piece(p.q_lo, p.q_hi, p.k_lo + context, p.k_hi + context, None if p.diag is None else p.diag + context)
            for p in own
        )
    # B, S, H, D -> B, H, S, D for the kernels and back
    q, k, v = (t.transpose(1, 2) for t in (query, keys, values))
    out = spec_attention(q, k, v, found, kernel=grouped(picked, kv_heads), scale=scale).transpose(1, 2)
    return _heads_to_seq(out, groups.ulysses, lengths, head_split) if ulysses > 1 else out

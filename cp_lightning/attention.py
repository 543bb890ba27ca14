"""Context-parallel attention: exact attention over sequence-sharded inputs across the CP group.

:func:`cp_attention` is Ulysses, ring or USP over a :class:`CPGroups`; :class:`ContextParallelAttention`
is the callable that routing.py hands diffusers' processors (as their ``_parallel_config``, or behind
their ``F.scaled_dot_product_attention``). We do not call diffusers' ``enable_parallelism``: it fails
on CPU-only hosts (DESIGN.md section 6).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_lightning import collectives, masked_cp
from cp_lightning.kernels import pick_kernel
from cp_lightning.mask_layout import Layout
from cp_lightning.masked import check_spec
from cp_lightning.masks import MaskSpec
from cp_lightning.mesh import CPGroups
from cp_lightning.ring import ring_attention
from cp_lightning.split_table import SplitState


def _seq_to_heads(
    x: torch.Tensor, group: dist.ProcessGroup, lengths: list[int], heads: list[int], starts: list[int] | None = None
) -> torch.Tensor:
    """Ulysses scatter: sequence-sharded, all heads -> full sequence, this rank's heads.

    ``lengths[p]``: rank p's number of tokens; ``heads[p]``: the number of heads rank p attends over
    (``chunk_sizes(H, P)``). Rank p's tokens come back as block p of the full sequence. ``starts[p]``: rank p's
    first head when the ranks' heads are not consecutive runs (GQA's K/V heads, :func:`_kv_heads`: a head may
    go to two ranks).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    b, s_local, h, d = x.shape
    if starts is None and len(set(heads)) == 1:
        # B, S_local, H, D -> P, S_local, B, H/P, D: chunk p holds head group p, sent to rank p
        send = x.reshape(b, s_local, world, h // world, d).permute(2, 1, 0, 3, 4).reshape(-1)
    else:  # head groups of different sizes, or overlapping ones: the same layout, built group by group
        starts = starts if starts is not None else [sum(heads[:p]) for p in range(world)]
        # B, S_local, heads[p], D -> S_local, B, heads[p], D per rank p. A head sent to two ranks is two slices of
        # x: autograd sums both replicas' gradients into it (the adjoint of the copy), so backward needs no rule
        parts = [x[:, :, a : a + n].permute(1, 0, 2, 3).reshape(-1) for a, n in zip(starts, heads, strict=True)]
        send = torch.cat(parts)
    row = b * d
    out = collectives.all_to_all(
        send, group, send=[s_local * n * row for n in heads], recv=[length * heads[rank] * row for length in lengths]
    )
    # blocks [S_p, B, H_rank, D] in rank order are one contiguous [S, B, H_rank, D]
    return out.view(sum(lengths), b, heads[rank], d).permute(1, 0, 2, 3)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, lengths: list[int], heads: list[int]) -> torch.Tensor:
    """Ulysses gather: full sequence, this rank's heads -> sequence-sharded, all heads (the inverse)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    b, s, h_local, d = x.shape
    s_local, row = lengths[rank], b * d
    # B, S, H_rank, D -> S, B, H_rank, D: dim-0 block p holds rank p's tokens
    send = x.permute(1, 0, 2, 3).reshape(-1)
    out = collectives.all_to_all(
        send, group, send=[length * h_local * row for length in lengths], recv=[s_local * n * row for n in heads]
    )
    if len(set(heads)) == 1:
        # P(head group), S_local, B, H/P, D -> B, S_local, P, H/P, D -> B, S_local, H, D
        out = out.view(world, s_local, b, heads[0], d).permute(2, 1, 0, 3, 4)
        return out.reshape(b, s_local, world * heads[0], d)
    chunks = out.split([s_local * n * row for n in heads])
    parts = [chunk.view(s_local, b, n, d) for chunk, n in zip(chunks, heads, strict=True)]
    return torch.cat(parts, dim=2).permute(1, 0, 2, 3)


def _check_mask(mask: torch.Tensor, heads: int) -> None:
    """Only key-padding masks, broadcastable to (B, H, 1, S_k_local), can follow their keys.

    A mask with one row per query cannot be supported: a rank only sees its own block of such a
    matrix, not the rows and columns the other ranks hold.
    """
    if mask.requires_grad:
        raise ValueError(
            "attention masks that require grad (learned biases) are not supported under context parallelism."
        )
    if mask.dim() > 4 or (mask.dim() >= 2 and mask.shape[-2] != 1):
        raise ValueError(
            f"attention mask of shape {tuple(mask.shape)} has one row per query; under context parallelism only "
            "key-padding masks (size 1 in the query dim, e.g. (B, 1, 1, S_k)) are supported."
        )
    if mask.dim() >= 3 and mask.shape[-3] not in (1, heads):
        raise ValueError(
            f"attention mask of shape {tuple(mask.shape)}: its head dim must be 1 or the head count {heads}."
        )


def collapse_mask(mask: torch.Tensor | None, q_len: int, k_len: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A boolean per-query mask that is an outer product ``q_valid x k_valid`` -> key mask and row mask.

    HunyuanVideo-1.5 and Chroma build their text-padding masks as ``(B, 1, S, S)`` outer products of one
    key-padding vector. Such a mask is exactly the key mask ``k_valid`` followed by zeroing the query
    rows that see no key (SDPA returns 0 for a fully masked row). This is checked, not assumed: the
    mask must equal the outer product of its own row and column ``any``. Returns ``(key_mask, rows)``,
    ``rows`` of shape ``(B, S_q, 1 | H, 1)`` multiplying the ``(B, S_q, H, D)`` output, or None when
    nothing is to be zeroed. Key masks pass through; anything else per query raises ValueError.
    """
    if mask is None or mask.dim() < 2 or mask.shape[-2] == 1:
        return mask, None
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-2] != q_len or mask.shape[-1] != k_len:
        raise ValueError(
            f"attention mask of shape {tuple(mask.shape)} has one row per query; under context parallelism only "
            "key-padding masks (size 1 in the query dim, e.g. (B, 1, 1, S_k)) and boolean (B, 1|H, S_q, S_k) outer "
            f"products of padding vectors over this rank's {q_len} queries and {k_len} keys are supported."
        )
    q_valid, k_valid = mask.any(dim=-1), mask.any(dim=-2)  # B, H|1, S_q and B, H|1, S_k
    if not torch.equal(mask, q_valid[..., :, None] & k_valid[..., None, :]):
        raise ValueError(
            f"boolean attention mask of shape {tuple(mask.shape)} is not an outer product of query and key padding "
            "vectors (it differs from valid_q[:, :, :, None] & valid_k[:, :, None, :]); such per-query masks "
            "(e.g. block-causal) cannot follow their keys under context parallelism."
        )
    rows = None if bool(q_valid.all()) else q_valid.transpose(1, 2).unsqueeze(-1).to(torch.float32)
    return k_valid.unsqueeze(-2), rows


def _gather_mask(mask: torch.Tensor, group: dist.ProcessGroup, lengths: list[int], heads: list[int]) -> torch.Tensor:
    """(B, H or 1, 1, S_k_local) key-padding mask -> (B, H_rank or 1, 1, S_k) for Ulysses.

    Keys (last dim) are sharded like the keys themselves, so an all-gather in rank order matches the
    key order after the all-to-all. A per-head mask keeps this rank's heads.
    """
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    mask = collectives.all_gather_no_grad(mask, -1, group, None if len(set(lengths)) == 1 else lengths)
    if mask.shape[1] == sum(heads) > 1:
        rank = dist.get_rank(group)
        mask = mask[:, sum(heads[:rank]) : sum(heads[: rank + 1])]
    return mask


def _to_bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A key mask as the additive bias LSE kernels take: (B|1, H|1, 1, S_k), 0 or -inf for booleans."""
    if mask is None:
        return None
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def _check_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ulysses: int, gqa: bool) -> None:
    """Head counts, before any collective: equal, or (``gqa``, SDPA's ``enable_gqa``) K/V heads dividing the
    queries'; at least one query head per Ulysses rank."""
    heads, kv_heads = query.shape[2], key.shape[2]
    if value.shape[2] != kv_heads:
        raise ValueError(f"keys have {kv_heads} heads but values {value.shape[2]}; they must be equal.")
    if not gqa and kv_heads != heads:
        raise ValueError(
            f"queries have {heads} heads but keys {kv_heads}; pass enable_gqa=True for grouped-query attention "
            "(K/V heads dividing the query heads), else give them equal head counts."
        )
    if gqa and heads % kv_heads:
        raise ValueError(
            f"grouped-query attention needs the key/value heads to divide the query heads; got {heads} query "
            f"heads and {kv_heads} key/value heads."
        )
    if heads < ulysses:
        raise ValueError(
            f"Ulysses gives each of its {ulysses} ranks at least one of the {heads} attention heads; use a Ulysses "
            f"degree (cp / ring) of at most {heads}, e.g. a larger ring degree."
        )


def _kv_heads(head_split: list[int], group: int, rank: int) -> tuple[list[int], list[int], list[int]]:
    """GQA under Ulysses: the K/V heads each rank receives, ``(counts, starts, local)``.

    Query head i reads K/V head i // ``group`` (g = H_q / H_kv, as SDPA's ``enable_gqa``). Rank p attends over
    query heads [a_p, a_p + n_p) (``head_split``) and receives exactly the K/V heads they read, a_p // g to
    (a_p + n_p - 1) // g: a group that straddles two ranks goes to both (H_kv < u included), no other K/V head
    travels. ``local[j]``: which of this rank's received K/V heads its j-th query head reads.
    """
    counts, starts = [], []
    for p, n in enumerate(head_split):
        first = sum(head_split[:p])
        starts.append(first // group)
        counts.append((first + n - 1) // group + 1 - first // group)
    first = sum(head_split[:rank])
    return counts, starts, [(first + j) // group - starts[rank] for j in range(head_split[rank])]


def _grouped_sdpa(q, k, v, attn_mask, scale, kv_heads: list[int] | None) -> torch.Tensor:
    """SDPA of (B, H_q, S, D) queries over (B, H_kv, S, D) K/V, query head j reading K/V head ``kv_heads[j]``."""
    if kv_heads is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    group = len(kv_heads) // k.shape[1]
    if group * k.shape[1] == len(kv_heads) and kv_heads == [j // group for j in range(len(kv_heads))]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=True)
    # this rank's query heads start or end inside a group: pick each one's K/V head (autograd sums the copies)
    index = torch.tensor(kv_heads, device=k.device)
    k, v = k.index_select(1, index), v.index_select(1, index)  # B, H_kv_rank, S, D -> B, H_rank, S, D
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def _cp_lengths(query, key, group: dist.ProcessGroup, even: bool) -> tuple[list[int], list[int]]:
    """Every CP rank's query and key lengths: equal when ``even``, else exchanged (one small all-gather)."""
    world = dist.get_world_size(group)
    if even:
        return [query.shape[1]] * world, [key.shape[1]] * world
    if torch.compiler.is_compiling():
        raise ValueError(
            "cp_attention under torch.compile needs the ranks' lengths without exchanging them: pass even=True "
            "or lengths=, or call it through a parallelized model (whose split hooks know them)."
        )
    rows = collectives.exchange_lengths([query.shape[1], key.shape[1]], group, query.device)
    return [row[0] for row in rows], [row[1] for row in rows]


def cp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    groups: CPGroups,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    kernel: str | None = None,
    even: bool = False,
    lengths: tuple[list[int], list[int]] | None = None,
    mask: MaskSpec | None = None,
    layout: Layout | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Exact attention over sequence-sharded ``(B, S_local, H, D)`` inputs across the CP group.

    Ulysses (all-to-all) over the inner ``ulysses`` axis, then, when ``ring > 1``, ring attention
    over the outer ``ring`` axis (USP). Each rank holds its own shard of queries and of keys/values;
    shards may differ in length between ranks (a sequence the CP degree does not divide) and queries
    from keys (cross-attention to split text). It gets back its own ``(B, S_local, H, D)`` output.
    ``even=True`` promises that every rank's shards have the same lengths; ``lengths`` gives every CP
    rank's query and key lengths (both skip exchanging them; see ``split_table.SplitState``). Heads are
    dealt out as evenly as possible (:func:`collectives.chunk_sizes`): a head count the Ulysses degree
    does not divide leaves some ranks one head more, with no padding.
    ``mask``: a :class:`~cp_lightning.masks.MaskSpec` over the whole self-attention sequence (no attn_mask
    then), run as rectangles with no S x S tensor (cp_lightning.masked_cp); ``layout``: the tokens each rank
    holds (default ``Layout.contiguous``, the split hooks' sharding; ``Layout.head_tail`` balances rings
    under causal masks); the shard lengths then come from the layout, with no exchange.
    ``enable_gqa``: grouped-query attention as SDPA's, key/value ``(B, S_local, H_kv, D)`` with H_kv dividing H;
    Ulysses sends each rank only the K/V heads its query heads read (:func:`_kv_heads`), the ring's blocks carry
    H_kv heads (``ring.ring_attention``'s ``kv_heads``).
    Everything that can be refused is checked before communicating.
    """
    heads, ulysses = query.shape[2], groups.ulysses_size
    _check_heads(query, key, value, ulysses, enable_gqa)
    group = heads // key.shape[2]  # query heads per K/V head: 1 without GQA
    if mask is not None:
        check_spec(mask, query, key, attn_mask)
        # the sequence length, where it is known without communicating
        total = sum(lengths[0]) if lengths is not None else (query.shape[1] * groups.cp_size if even else None)
        layout = masked_cp.resolve_layout(mask, layout, query, groups.cp_size, dist.get_rank(groups.cp), total)
        lengths = (layout.lengths, layout.lengths)
    if attn_mask is not None:
        _check_mask(attn_mask, heads)
    ring_kernel = None
    if groups.ring_size > 1 and mask is None:
        ring_kernel = pick_kernel(query.device, query.dtype, attn_mask is not None, kernel, head_dim=query.shape[-1])

    q_cp, k_cp = _cp_lengths(query, key, groups.cp, even) if lengths is None else lengths
    # cp rank = ring position x ulysses + ulysses position (mesh.cp_groups): this rank's Ulysses group
    # holds a run of consecutive cp ranks, and ring position i attends over Ulysses group i's tokens
    first = dist.get_rank(groups.cp) // ulysses * ulysses
    q_lengths, k_lengths = q_cp[first : first + ulysses], k_cp[first : first + ulysses]
    # which local K/V head each local query head reads (None: the same head)
    kv_heads = None if group == 1 else [j // group for j in range(heads)]
    if ulysses > 1:
        head_split = collectives.chunk_sizes(heads, ulysses)
        query = _seq_to_heads(query, groups.ulysses, q_lengths, head_split)
        kv_split, kv_starts = head_split, None
        if group > 1:
            kv_split, kv_starts, kv_heads = _kv_heads(head_split, group, dist.get_rank(groups.ulysses))
            if kv_starts == [sum(kv_split[:p]) for p in range(ulysses)]:
                kv_starts = None  # every K/V head goes to one rank: the plain (reshape) path
        key, value = (_seq_to_heads(t, groups.ulysses, k_lengths, kv_split, kv_starts) for t in (key, value))
        if attn_mask is not None:
            attn_mask = _gather_mask(attn_mask, groups.ulysses, k_lengths, head_split)
    # B, S, H/u, D -> B, H/u, S, D for the kernels and back
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if mask is not None:
        out = masked_cp.attend(q, k, v, mask, layout, groups, kernel=kernel, scale=scale, kv_heads=kv_heads)
    elif ring_kernel is None:
        out = _grouped_sdpa(q, k, v, attn_mask, scale, kv_heads)
    else:
        block_lengths = [sum(k_cp[i : i + ulysses]) for i in range(0, groups.cp_size, ulysses)]
        bias = _to_bias(attn_mask, q.dtype)
        out = ring_attention(
            q, k, v, group=groups.ring, kernel=ring_kernel, bias=bias, scale=scale, block_lengths=block_lengths,
            kv_heads=kv_heads,
        )  # fmt: skip
    out = out.transpose(1, 2)
    return _heads_to_seq(out, groups.ulysses, q_lengths, head_split) if ulysses > 1 else out


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Ulysses attention over every rank of ``group`` (see :func:`cp_attention`)."""
    size = dist.get_world_size(group)
    groups = CPGroups(cp=group, ulysses=group, ring=None, cp_size=size, ring_size=1)
    return cp_attention(query, key, value, groups=groups, attn_mask=attn_mask, scale=scale)


class ContextParallelAttention:
    """The ``_parallel_config`` cp_lightning puts on a processor: attention over the CP group."""

    def __init__(self, groups: CPGroups, kernel: str | None = None, state: SplitState | None = None) -> None:
        self.groups = groups
        self.kernel = kernel
        # the model's split hooks record every rank's shard lengths in it: attention looks its own up
        self.state = SplitState(groups.cp) if state is None and groups is not None else state
        # the token layout of mask-spec calls (None: contiguous, as the split hooks shard)
        self.layout: Layout | None = None

    def __call__(
        self,
        query,
        key,
        value,
        *,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
        where: str | None = None,
    ) -> torch.Tensor:
        """``(B, S_local, H, D)`` in and out; ``where`` (the attention module's path) prefixes errors.

        ``attn_mask`` may be a :class:`~cp_lightning.masks.MaskSpec` (a stand-in processor's block-causal or
        segment mask): it runs as ``cp_attention(..., mask=spec, layout=self.layout)``."""
        spec = attn_mask if isinstance(attn_mask, MaskSpec) else None
        try:
            if dropout_p or is_causal:
                raise ValueError(
                    "context-parallel attention supports neither attention dropout nor causal masking "
                    f"(got dropout_p={dropout_p}, is_causal={is_causal}); express a causal mask as a "
                    "cp_lightning.masks.MaskSpec."
                )
            if spec is None:
                attn_mask, rows = collapse_mask(attn_mask, query.shape[1], key.shape[1])
            else:
                attn_mask, rows = None, None
            # before the lengths exchange below: a refusal must come before any collective
            _check_heads(query, key, value, self.groups.ulysses_size, enable_gqa)
        except ValueError as err:
            raise ValueError(f"{where}: {err}" if where else str(err)) from None
        lengths = None
        if not self.state.even and torch.compiler.is_compiling():
            lengths = (
                self.state.lengths_of(query, 1, "attention queries"),
                self.state.lengths_of(key, 1, "attention keys"),
            )
        elif not self.state.even:
            # eager: both lengths in one all-gather (one host sync per call, not two); why eager code exchanges
            # rather than looking them up is in SplitState.lengths_of
            lengths = _cp_lengths(query, key, self.state.group, even=False)
        try:
            out = cp_attention(
                query,
                key,
                value,
                groups=self.groups,
                attn_mask=attn_mask,
                scale=scale,
                kernel=self.kernel,
                even=self.state.even,
                lengths=lengths,
                mask=spec,
                layout=self.layout,
                enable_gqa=enable_gqa,
            )
        except ValueError as err:  # a spec's refusals name the module (the others predate this)
            if spec is None or not where:
                raise
            raise ValueError(f"{where}: {err}") from None
        return out if rows is None else out * rows.to(out.dtype)

    def __repr__(self) -> str:
        return f"ContextParallelAttention(cp={self.groups.cp_size}, ring={self.groups.ring_size})"

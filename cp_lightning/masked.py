"""Masked attention as rectangles: the unmasked LSE kernels run per :class:`~cp_lightning.mask_layout.Piece`.

A mask spec never becomes an S x S tensor. After Ulysses' all-to-all a rank holds every token of its heads,
so :func:`spec_attention` runs the spec's pieces over them (the work is the mask's area, the same on every
rank); a ring step runs the pieces between its queries and the arriving key block (cp_lightning.ring calls
:func:`forward_pieces` / :func:`backward_pieces` with the step's pieces, and skips steps with none).

Forward: each piece's partial output is merged into the rows it covers with its log-sum-exp, in fp32 (fp64
for fp64), as the ring merges blocks (``ring.merge``). Backward: each piece's gradient is recomputed from the
*final* output and LSE, which makes it exact (the softmax normaliser is the global one; the ring's module
docstring), and added into the rows and keys it covers. Causal tiles take a tile-sized additive bias.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cp_lightning.kernels import Kernel, as_bshd, grouped, pick_kernel
from cp_lightning.mask_layout import Piece, pieces
from cp_lightning.masks import MaskSpec


def tile_bias(piece: Piece, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """A causal tile's (1, 1, rows, keys) additive mask (0 where key j <= row i + diag, else -inf); None for a
    full piece. At most CAUSAL_TILE x CAUSAL_TILE elements."""
    if piece.diag is None:
        return None
    rows = torch.arange(piece.q_lo, piece.q_hi, device=device)[:, None]
    keys = torch.arange(piece.k_lo, piece.k_hi, device=device)[None, :]
    bias = torch.zeros(rows.shape[0], keys.shape[1], dtype=dtype, device=device)
    return bias.masked_fill_(keys > rows + piece.diag, float("-inf"))[None, None]


def forward_pieces(q, k, v, found: Sequence[Piece], kernel: Kernel, scale, out, lse) -> None:
    """Add ``found`` (q: (B, H, S_q, D); k, v: (B, H, S_k, D)) into ``out`` (B, H, S_q, D) and ``lse``
    (B, H, S_q), both in the accumulation dtype; rows start at out 0 and lse -inf."""
    for p in found:
        rows = slice(p.q_lo, p.q_hi)
        block_out, block_lse = kernel.forward(
            q[:, :, rows], k[:, :, p.k_lo : p.k_hi], v[:, :, p.k_lo : p.k_hi], tile_bias(p, q.dtype, q.device), scale
        )
        old = lse[:, :, rows]
        new = torch.logaddexp(old, block_lse)
        # weights exp(lse - new) <= 1; a row's first piece has old = -inf, weight 0 (see ring.merge)
        out[:, :, rows].mul_(torch.exp(old - new).unsqueeze(-1)).addcmul_(
            block_out, torch.exp(block_lse - new).unsqueeze(-1)
        )
        lse[:, :, rows] = new


def backward_pieces(dout, q, k, v, out, lse, found: Sequence[Piece], kernel: Kernel, scale, dq, dk, dv) -> None:
    """Add the gradients of ``found`` into ``dq`` (B, H, S_q, D) and ``dk``, ``dv`` (B, H, S_k, D) (accumulation
    dtype), from the final ``out`` and ``lse``."""
    for p in found:
        rows, keys = slice(p.q_lo, p.q_hi), slice(p.k_lo, p.k_hi)
        dq_part, dk_part, dv_part = kernel.backward(
            dout[:, :, rows],
            q[:, :, rows],
            k[:, :, keys],
            v[:, :, keys],
            out[:, :, rows],
            lse[:, :, rows],
            tile_bias(p, q.dtype, q.device),
            scale,
        )
        dq[:, :, rows] += dq_part
        dk[:, :, keys] += dk_part
        dv[:, :, keys] += dv_part


def empty_output(q: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) before any piece: zeros laid out as contiguous (B, S, H, D), and -inf."""
    b, h, s, d = q.shape
    out = q.new_zeros((b, s, h, d), dtype=acc).transpose(1, 2)  # B, S, H, D -> B, H, S, D view
    return out, q.new_full((b, h, s), float("-inf"), dtype=acc)


class _SpecAttention(torch.autograd.Function):
    """Attention of (B, H, S, D) q, k, v under ``found`` pieces, all tokens local (Ulysses, or one process).

    Forward merges the pieces' partial outputs by LSE; backward recomputes each piece with the final output
    and LSE (exact, see the module docstring), so no piece's probabilities are kept."""

    @staticmethod
    def forward(ctx, q, k, v, found, kernel, scale):
        acc = torch.promote_types(q.dtype, torch.float32)
        out, lse = empty_output(q, acc)
        forward_pieces(q, k, v, found, kernel, scale, out, lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.found, ctx.kernel, ctx.scale = found, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        acc = lse.dtype
        if q.device.type != "cpu":
            dout = as_bshd(dout)  # the CUDA backward ops' layout (kernels.as_bshd)
        dq, dk, dv = (torch.zeros_like(t, dtype=acc) for t in (q, k, v))
        backward_pieces(dout, q, k, v, out, lse, ctx.found, ctx.kernel, ctx.scale, dq, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def spec_attention(q, k, v, found: Sequence[Piece], *, kernel: Kernel, scale=None) -> torch.Tensor:
    """(B, H, S_q, D) attention of local q over local k, v under the pieces ``found``."""
    return _SpecAttention.apply(q, k, v, tuple(found), kernel, scale)


def local_attention(query, key, value, spec: MaskSpec, *, scale=None, kernel: str | None = None) -> torch.Tensor:
    """One process, (B, S, H, D) in and out: the spec over the whole sequence (a routed module running locally).
    Fewer key/value heads than query heads (dividing them) is grouped-query attention, as SDPA's ``enable_gqa``."""
    check_spec(spec, query, key, None)
    heads, kv = query.shape[2], key.shape[2]
    if heads % kv:
        raise ValueError(f"grouped-query attention needs the {kv} key/value heads to divide the {heads} query heads.")
    runs = ((0, spec.length),)
    found = pieces(spec, runs, runs)
    picked = pick_kernel(query.device, query.dtype, has_tiles([found]), kernel, head_dim=query.shape[-1])
    picked = grouped(picked, None if kv == heads else [j // (heads // kv) for j in range(heads)])
    # B, S, H, D -> B, H, S, D for the kernels and back
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    return spec_attention(q, k, v, found, kernel=picked, scale=scale).transpose(1, 2)


def has_tiles(steps: Sequence[Sequence[Piece]]) -> bool:
    return any(p.diag is not None for step in steps for p in step)


def encode(steps: Sequence[Sequence[Piece]]) -> list[int]:
    """Per-step pieces as the flat ints a custom op takes: per step its count, then 6 ints per piece."""
    flat: list[int] = []
    for step in steps:
        flat.append(len(step))
        for p in step:
            flat.extend((p.q_lo, p.q_hi, p.k_lo, p.k_hi, p.diag is not None, 0 if p.diag is None else p.diag))
    return flat


def decode(flat: Sequence[int]) -> list[list[Piece]]:
    steps, i = [], 0
    while i < len(flat):
        count, i = flat[i], i + 1
        step = []
        for _ in range(count):
            q_lo, q_hi, k_lo, k_hi, causal, diag = flat[i : i + 6]
            step.append(Piece(q_lo, q_hi, k_lo, k_hi, diag if causal else None))
            i += 6
        steps.append(step)
    return steps


def check_spec(spec: MaskSpec, query: torch.Tensor, key: torch.Tensor, attn_mask) -> None:
    """Refusals that need no communication: a spec is self-attention over one sequence, alone."""
    if not isinstance(spec, MaskSpec):
        raise TypeError(f"mask= takes a cp_lightning.masks.MaskSpec, got {type(spec).__name__}.")
    if attn_mask is not None:
        raise ValueError("pass either a mask spec or an attn_mask tensor, not both (key padding with a spec is not "
                         "supported yet).")  # fmt: skip
    if query.shape[1] != key.shape[1]:
        raise ValueError(
            f"a mask spec describes self-attention over one sequence; got {query.shape[1]} local queries and "
            f"{key.shape[1]} local keys."
        )

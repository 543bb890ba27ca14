"""Attention masks as data: a few rectangles in token coordinates, never an S x S tensor.

The masks video and image DiTs train with (block-causal video, teacher forcing, packed documents, Flux.2's
reference tokens, Qwen-Image 2.1's segments) are a handful of rectangles at frame or segment granularity.
A :class:`MaskSpec` is the ordered list of those rectangles, :class:`Slice` ``(q_lo, q_hi, k_lo, k_hi, kind)``
in the original token order of one self-attention sequence: queries ``[q_lo, q_hi)`` see keys ``[k_lo, k_hi)``,
all of them (``FULL``) or a causal triangle (``CAUSAL``: query ``q_lo + i`` sees keys up to ``k_lo + i``, the
diagonal through the rectangle's top-left corner, as SDPA's ``is_causal``). Every other pair is masked.

A spec is validated when it is built, on every rank alike and before any communication: slices lie inside
the sequence and do not overlap, and every query row sees at least one key (a row with none has no softmax).
:func:`cp_lightning.attention.cp_attention` runs a spec by intersecting its slices with the tokens each rank
holds (cp_lightning.mask_layout) and calling the unmasked kernels per rectangle (cp_lightning.masked).
:meth:`MaskSpec.to_dense` exists for tests and refuses large sequences.

Constructors, in latent frames of ``frame_tokens`` tokens each (DESIGN.md section 9.1, docs/masks.md):
:func:`block_causal` (SkyReels-V2 diffusion forcing, CausVid, LongLive), :func:`teacher_forcing` (CausVid /
Self-Forcing's [clean | noisy] sequence), :func:`documents` (packed samples), :func:`prefix_only` (Flux.2's KV
mode) and :func:`qwen_image_segments` (Qwen-Image 2.1).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class Kind(enum.Enum):
    """How a slice's queries see its keys: all of them, or the causal triangle through its top-left corner."""

    FULL = "full"
    CAUSAL = "causal"


FULL, CAUSAL = Kind.FULL, Kind.CAUSAL

# to_dense refuses sequences longer than this: it is S x S booleans, for tests only
DENSE_LIMIT = 1 << 14


def _int(name: str, value: object, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r}).")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}.")
    return value


@dataclass(frozen=True)
class Slice:
    """Queries ``[q_lo, q_hi)`` see keys ``[k_lo, k_hi)``: all of them (FULL) or causally (CAUSAL, see the module)."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    kind: Kind = FULL

    def visible(self, q: int) -> tuple[int, int]:
        """The key range query ``q`` (inside ``[q_lo, q_hi)``) sees in this slice."""
        if self.kind is FULL:
            return self.k_lo, self.k_hi
        return self.k_lo, min(self.k_hi, self.k_lo + q - self.q_lo + 1)

    @property
    def area(self) -> int:
        """The number of (query, key) pairs this slice makes visible."""
        rows, cols = self.q_hi - self.q_lo, self.k_hi - self.k_lo
        if self.kind is FULL:
            return rows * cols
        # row i sees min(cols, i + 1) keys
        ramp = min(rows, cols)
        return ramp * (ramp + 1) // 2 + (rows - ramp) * cols

    def __str__(self) -> str:
        return f"q {self.q_lo}:{self.q_hi} k {self.k_lo}:{self.k_hi} {self.kind.value}"


@dataclass(frozen=True)
class MaskSpec:
    """A self-attention mask over ``length`` tokens as an ordered tuple of disjoint :class:`Slice` s.

    Built by the constructors below or from ``(q_lo, q_hi, k_lo, k_hi[, kind])`` tuples; validated at
    construction (ValueError naming the offending slices or rows). Hashable: layouts cache per spec.
    """

    length: int
    slices: tuple[Slice, ...]

    def __post_init__(self) -> None:
        _int("mask length", self.length, 1)
        # tuples are accepted too, their kind as Kind or its value ("full", "causal")
        slices = tuple(
            s if isinstance(s, Slice) else Slice(*s[:4], Kind(s[4]) if len(s) > 4 else FULL) for s in self.slices
        )
        object.__setattr__(self, "slices", slices)
        if not slices:
            raise ValueError("a mask spec needs at least one slice: every query row must see a key.")
        for index, s in enumerate(slices):
            for name in ("q_lo", "q_hi", "k_lo", "k_hi"):
                _int(f"slice {index} {name}", getattr(s, name))
            if not isinstance(s.kind, Kind):
                raise TypeError(f"slice {index}: kind must be FULL or CAUSAL, got {s.kind!r}.")
            if not (0 <= s.q_lo < s.q_hi <= self.length and 0 <= s.k_lo < s.k_hi <= self.length):
                raise ValueError(
                    f"slice {index} ({s}) must be a non-empty range inside the sequence of {self.length} tokens."
                )
        _check_disjoint_and_covering(slices, self.length)

    @property
    def area(self) -> int:
        """Visible (query, key) pairs: the attention FLOPs the mask leaves, over ``length ** 2`` unmasked."""
        return sum(s.area for s in self.slices)

    @property
    def density(self) -> float:
        return self.area / self.length**2

    @property
    def is_full(self) -> bool:
        return self.area == self.length**2

    def to_dense(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The ``(S, S)`` boolean mask (True: visible), for tests and references at small ``S`` only."""
        if self.length > DENSE_LIMIT:
            raise ValueError(
                f"to_dense builds {self.length} x {self.length} booleans; it is for tests at up to {DENSE_LIMIT} "
                "tokens. Attention takes the spec itself (cp_attention(..., mask=spec))."
            )
        dense = torch.zeros(self.length, self.length, dtype=torch.bool, device=device)
        for s in self.slices:
            block = dense[s.q_lo : s.q_hi, s.k_lo : s.k_hi]
            if s.kind is FULL:
                block.fill_(True)
            else:  # top-left diagonal, as SDPA's is_causal
                block.copy_(torch.ones_like(block).tril())
        return dense


def _check_disjoint_and_covering(slices: tuple[Slice, ...], length: int) -> None:
    """Raise ValueError unless the slices' rectangles are disjoint and every query row is in one.

    A sweep over the query boundaries: between two consecutive boundaries the same slices are active, and
    they must hold disjoint key ranges. O(n log n + boundaries x active), not O(n^2), for specs with
    thousands of documents.
    """
    order = sorted(range(len(slices)), key=lambda i: slices[i].q_lo)
    bounds = sorted({0, length, *(s.q_lo for s in slices), *(s.q_hi for s in slices)})
    active: list[int] = []
    nxt = 0
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        while nxt < len(order) and slices[order[nxt]].q_lo <= lo:
            active.append(order[nxt])
            nxt += 1
        active = [i for i in active if slices[i].q_hi > lo]
        if not active:
            raise ValueError(
                f"query rows {lo}:{hi} see no key: no slice of the mask covers them (a row with no visible key has "
                "no softmax; give every query at least one key, e.g. itself)."
            )
        by_key = sorted(active, key=lambda i: slices[i].k_lo)
        for a, b in zip(by_key, by_key[1:], strict=False):
            if slices[b].k_lo < slices[a].k_hi:
                raise ValueError(
                    f"mask slices {a} ({slices[a]}) and {b} ({slices[b]}) overlap at query rows {lo}:{hi}, keys "
                    f"{slices[b].k_lo}:{min(slices[a].k_hi, slices[b].k_hi)}; slices must be disjoint."
                )


def full(length: int) -> MaskSpec:
    """No mask: every query sees every key (one slice)."""
    return MaskSpec(length, (Slice(0, length, 0, length),))


def _block_frames(frames: int, frames_per_block: int) -> list[tuple[int, int]]:
    """The blocks' frame ranges; a tail shorter than ``frames_per_block`` is a block of its own, not dropped
    (diffusers' SkyReels-V2 floors the block count and leaves the tail frames out, diffusers#13609)."""
    return [(f, min(f + frames_per_block, frames)) for f in range(0, frames, frames_per_block)]


def _check_video(frames, frame_tokens, frames_per_block, window_frames, sink_frames) -> None:
    _int("frames", frames, 1)
    _int("frame_tokens", frame_tokens, 1)
    _int("frames_per_block", frames_per_block, 1)
    _int("sink_frames", sink_frames)
    if sink_frames > frames:
        raise ValueError(f"sink_frames={sink_frames} exceeds the {frames} frames.")
    if window_frames is not None and _int("window_frames", window_frames, 1) < min(frames_per_block, frames):
        raise ValueError(
            f"window_frames={window_frames} is shorter than a block of {frames_per_block} frames: the window ends "
            "at its block's end, so part of every block would not see itself."
        )


def _context(f_hi: int, window_frames: int | None, sink_frames: int) -> list[tuple[int, int]]:
    """The key frames a block ending at frame ``f_hi`` sees: the window ``[f_hi - window, f_hi)`` (everything
    before ``f_hi`` without one) and the first ``sink_frames`` frames (LongLive's frame sink)."""
    lo = 0 if window_frames is None else max(0, f_hi - window_frames)
    if lo <= sink_frames:
        return [(0, f_hi)]
    return [(0, sink_frames), (lo, f_hi)] if sink_frames else [(lo, f_hi)]


def block_causal(
    frames: int,
    frame_tokens: int,
    frames_per_block: int,
    window_frames: int | None = None,
    sink_frames: int = 0,
) -> MaskSpec:
    """Block-causal video attention: frames in blocks of ``frames_per_block``; a block sees itself and earlier
    blocks (``block(k) <= block(q)``: SkyReels-V2 DF, CausVid). ``window_frames``: keys only from the last
    ``window_frames`` frames up to the block's end (CausVid's local attention, ``kv >= end(q) - window``);
    ``sink_frames``: the first frames stay visible to every block (LongLive's frame sink). The sequence is
    ``frames * frame_tokens`` tokens, frame-major; a shorter tail block is a block.
    """
    _check_video(frames, frame_tokens, frames_per_block, window_frames, sink_frames)
    t = frame_tokens
    slices = [
        Slice(f_lo * t, f_hi * t, k_lo * t, k_hi * t)
        for f_lo, f_hi in _block_frames(frames, frames_per_block)
        for k_lo, k_hi in _context(f_hi, window_frames, sink_frames)
    ]
    return MaskSpec(frames * t, tuple(slices))


def teacher_forcing(
    frames: int,
    frame_tokens: int,
    frames_per_block: int,
    window_frames: int | None = None,
    sink_frames: int = 0,
) -> MaskSpec:
    """CausVid / Self-Forcing teacher forcing over ``[clean | noisy]`` (``2 * frames * frame_tokens`` tokens;
    RoPE positions repeat in both halves, which is the model's business, not the mask's).

    The clean half is :func:`block_causal`. Noisy block b sees the clean blocks before it (the context a
    block-causal model would give block b, its own frames excluded) and its own noisy block, nothing else
    (CausVid's ``_prepare_teacher_forcing_mask``; the window and sink, when given, cut the clean context as
    they do in :func:`block_causal`).
    """
    clean = block_causal(frames, frame_tokens, frames_per_block, window_frames, sink_frames)
    t, half = frame_tokens, frames * frame_tokens
    slices = list(clean.slices)
    for f_lo, f_hi in _block_frames(frames, frames_per_block):
        for k_lo, k_hi in _context(f_hi, window_frames, sink_frames):
            k_hi = min(k_hi, f_lo)  # clean context: the frames before this block
            if k_lo < k_hi:
                slices.append(Slice(half + f_lo * t, half + f_hi * t, k_lo * t, k_hi * t))
        slices.append(Slice(half + f_lo * t, half + f_hi * t, half + f_lo * t, half + f_hi * t))
    return MaskSpec(2 * half, tuple(slices))


def documents(lengths: Sequence[int], *, causal: bool = False) -> MaskSpec:
    """Packed documents (samples) of ``lengths`` tokens: each attends only within itself (causally if asked)."""
    lengths = [_int(f"document {i} length", n, 1) for i, n in enumerate(lengths)]
    if not lengths:
        raise ValueError("documents() needs at least one document length.")
    kind = CAUSAL if causal else FULL
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    slices = tuple(Slice(s, s + n, s, s + n, kind) for s, n in zip(starts, lengths, strict=True))
    return MaskSpec(sum(lengths), slices)


def prefix_only(text_tokens: int, reference_tokens: int, image_tokens: int) -> MaskSpec:
    """Flux.2's KV mode over ``[text, reference, image]``: reference tokens attend only to themselves; text and
    image tokens attend to everything (diffusers' ``_flux2_kv_causal_attention``, extract mode)."""
    t, r, i = (
        _int("text_tokens", text_tokens),
        _int("reference_tokens", reference_tokens),
        _int("image_tokens", image_tokens),
    )
    length = t + r + i
    slices = [Slice(0, t, 0, length)] if t else []
    if r:
        slices.append(Slice(t, t + r, t, t + r))
    if i:
        slices.append(Slice(t + r, length, 0, length))
    return MaskSpec(length, tuple(slices))


def qwen_image_segments(segments: Sequence[tuple[int, int, bool]], length: int) -> MaskSpec:
    """Qwen-Image 2.1's block-causal mask, ``(q >= k) or same_image_block``, from diffusers' prefix segments.

    ``segments``: the ``(start, end, is_text)`` runs of the prefix, as ``_qwenimage21_prefix_segments`` gives
    them to ``QwenImage21AttnProcessor``; the target image is ``[prefix_end, length)``. A text segment sees
    everything before it and a causal triangle over itself; an image segment everything up to its end; the
    target image everything. (Key padding of the text is a key mask, not part of the spec.)
    """
    _int("length", length, 1)
    slices, end = [], 0
    for index, (start, stop, is_text) in enumerate(segments):
        if start != end or stop <= start:
            raise ValueError(f"segment {index} ({start}, {stop}) must start where the previous one ended ({end}).")
        if start:
            slices.append(Slice(start, stop, 0, start))
        slices.append(Slice(start, stop, start, stop, CAUSAL if is_text else FULL))
        end = stop
    if end > length:
        raise ValueError(f"the segments end at {end}, past the sequence of {length} tokens.")
    if end < length:
        slices.append(Slice(end, length, 0, length))
    return MaskSpec(length, tuple(slices))
